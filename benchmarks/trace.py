"""How long reading a model from its own code takes: a 7B config traced the first time (build on fake
tensors + one forward's module calls; target <= 20 s on one core, `taskset -c 0` to pin), read back
from the cache, and a shipped profile's estimate as a ratio to a transcribed preset's
(`--model qwen2.5-7b` against `--model llama-2-7b`). Prints numbers, no thresholds.

    python benchmarks/trace.py [--config zerocalc/hf/configs/qwen2.5-7b.json] [--repeat 5]
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerocalc import profile as P  # noqa: E402
from zerocalc import resolve  # noqa: E402
from zerocalc.estimate import estimate  # noqa: E402
from zerocalc.training import Setup, Stage  # noqa: E402


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(os.path.dirname(P.__file__), "hf", "configs", "qwen2.5-7b.json"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with open(args.config) as f:
        d = json.load(f)
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()      # a cold cache
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    t_import = time.perf_counter() - t0
    from zerocalc.hf import trace
    t0, c0 = time.perf_counter(), time.process_time()
    trace.cached_trace(d)
    t_first, c_first = time.perf_counter() - t0, time.process_time() - c0
    t_cached = best_of(lambda: trace.cached_trace(d), args.repeat)
    print(f"{os.path.basename(args.config)}: import torch+transformers {t_import:.1f} s, first trace {t_first:.1f} s "
          f"wall, {c_first:.1f} s CPU (the wall time on an idle core), from the cache {t_cached * 1e3:.1f} ms")

    setups = [Setup(stage=Stage(s), dp=8, micro_batch=1, seq_len=4096) for s in range(4)]

    def run(name):
        spec = resolve.preset_spec(name, {})
        for s in setups:
            estimate(spec, s).as_dict()

    def cold():
        P._loaded.clear()
        resolve._shipped_spec.cache_clear()
        run("qwen2.5-7b")
    t_ship_cold = best_of(cold, args.repeat)
    t_ship = best_of(lambda: run("qwen2.5-7b"), args.repeat)
    t_preset = best_of(lambda: run("llama-2-7b"), args.repeat)
    print(f"estimate, stages 0-3: --model llama-2-7b {t_preset * 1e3:.1f} ms (its allocation sequence simulated); "
          f"--model qwen2.5-7b {t_ship * 1e3:.1f} ms ({t_ship / t_preset:.2f}x), {t_ship_cold * 1e3:.1f} ms with the "
          f"profile read from disk ({t_ship_cold / t_preset:.2f}x)")
    import zerocalc.estimate as E
    plain = E.estimate
    E.estimate = lambda *a, **k: plain(*a, **k, simulate=False)
    global estimate
    estimate = E.estimate
    t_preset_ratio = best_of(lambda: run("llama-2-7b"), args.repeat)
    t_ship = best_of(lambda: run("qwen2.5-7b"), args.repeat)
    print(f"  without the simulation (reserved by the calibrated ratio for both): llama-2-7b {t_preset_ratio * 1e3:.1f} ms, "
          f"qwen2.5-7b {t_ship * 1e3:.1f} ms ({t_ship / t_preset_ratio:.2f}x)")


if __name__ == "__main__":
    main()
