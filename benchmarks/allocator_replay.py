"""How fast `zerocalc.allocator` replays a real allocation history (data/snapshots/t3-warmup*): events
per second and the time of one whole history beside an `estimate` call. It decides where the
simulation can run once a generator feeds it: inside `estimate` (a few tens of ms per history) but
not inside `sweep`'s millions of configurations per second. Prints numbers, no thresholds.

    python benchmarks/allocator_replay.py [--repeat 5]
"""
import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # validate/ beside zerocalc/
os.chdir(sys.path[0])                                                               # data/ from anywhere

from validate.snapshot import allocator_events, load, start_segments  # noqa: E402
from zerocalc.allocator import replay  # noqa: E402
from zerocalc.estimate import estimate  # noqa: E402
from zerocalc.model import from_params  # noqa: E402
from zerocalc.training import Setup  # noqa: E402


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    one_estimate = best_of(lambda: estimate(from_params(7e9), Setup(dp=8)).peak_bytes, args.repeat * 20)
    print(f"one estimate (7e9, N = 8, stage 2)            {one_estimate * 1e3:8.2f} ms")
    for path in sorted(glob.glob("data/snapshots/t3-warmup*/*.json.gz")):
        snap = load(path)
        events = allocator_events(snap["device_traces"][0])
        s = best_of(lambda: replay(events, start_segments(snap)), args.repeat)
        name = "/".join(path.split("/")[-2:])[:62]
        print(f"{name:62s} {len(events):7d} events {s * 1e3:8.1f} ms "
              f"{len(events) / s / 1e6:5.2f} M events/s  {s / one_estimate:7.0f}× an estimate")


if __name__ == "__main__":
    main()
