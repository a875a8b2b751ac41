"""What simulating reserved costs an `estimate`: generating a job's allocation sequence
(`zerocalc.sequence`) and replaying it (`zerocalc.allocator`) for preset architectures, beside the
same estimate with the simulation off (the ratio). Prints times and ratios, no thresholds.

    python benchmarks/sequence_replay.py [--repeat 3]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from allocator_replay import best_of  # noqa: E402  (beside this script)
from zerocalc import allocator, sequence  # noqa: E402
from zerocalc.arch import preset  # noqa: E402
from zerocalc.estimate import estimate  # noqa: E402
from zerocalc.model import from_architecture  # noqa: E402
from zerocalc.training import Setup, Stage  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'model':12s} {'setup':36s} {'events':>7s} {'generate':>9s} {'replay':>8s} {'estimate':>9s} "
          f"{'no sim':>8s} {'ratio':>6s}")
    for name in ("seed-gpt", "llama-2-7b", "llama-2-70b"):
        model = from_architecture(preset(name), name)
        for stage, ckpt in ((2, False), (2, True), (0, False), (3, False)):
            setup = Setup(stage=Stage(stage), dp=8, seq_len=4096, micro_batch=1, activation_checkpointing=ckpt)
            events = sequence.events(model, setup)
            gen = best_of(lambda: sequence.events(model, setup), args.repeat)
            rep = best_of(lambda: allocator.replay(events), args.repeat)
            full = best_of(lambda: estimate(model, setup).peak_reserved_bytes, args.repeat)
            plain = best_of(lambda: estimate(model, setup, simulate=False).peak_reserved_bytes, args.repeat)
            label = f"stage {stage}{', checkpointed' if ckpt else ''}, N = 8, 1×4096"
            print(f"{name:12s} {label:36s} {len(events):7d} {gen * 1e3:8.1f}ms {rep * 1e3:7.1f}ms "
                  f"{full * 1e3:8.1f}ms {plain * 1e3:7.2f}ms {full / plain:6.0f}×")


if __name__ == "__main__":
    main()
