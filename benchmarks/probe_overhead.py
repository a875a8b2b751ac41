"""What `zerocalc.probe` adds to the optimizer steps it does not measure: an engine whose forward,
backward and step do nothing (so nothing hides the probe's own Python) is stepped bare, with a probe
attached for a step it never reaches (the loop's wrapped calls, and Trainer's step events), and after
the probe is done (its wrappers removed). Printed: microseconds per optimizer step, and that as a
share of a 250 ms step (Qwen2.5-0.5B at 8 x 2048 tokens on an H200, data/probe-gpu/). The probe's
own two steps are the measurement; what they cost on a GPU is in data/README.md.

    python benchmarks/probe_overhead.py [--steps 200000] [--repeat 5]
"""
import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerocalc.probe.hook import Probe  # noqa: E402

GPU_STEP_S = 0.25


class Engine:
    """The calls the probe wraps, doing nothing, and DeepSpeed's optimizer step counter."""
    device = SimpleNamespace(type="cpu")

    def __init__(self):
        self.global_steps = 0

    def forward(self, *args, **kwargs):
        return None

    def backward(self, loss):
        return None

    def step(self):
        self.global_steps += 1


def loop_steps(engine, n):
    for _ in range(n):
        engine.forward(None)
        engine.backward(None)
        engine.step()


def trainer_steps(engine, probe, n):
    for _ in range(n):
        probe.begin_step()
        engine.forward(None)
        engine.backward(None)
        engine.step()
        probe.end_step()


def per_step_us(fn, steps, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(steps)
        best = min(best, time.perf_counter() - t0)
    return best / steps * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    never = 10**12
    bare = per_step_us(lambda n: loop_steps(Engine(), n), args.steps, args.repeat)
    looped = Engine()
    Probe(looped, never, path="loop")
    loop = per_step_us(lambda n: loop_steps(looped, n), args.steps, args.repeat)
    driven = Engine()
    events = Probe(driven, never, path="trainer")
    trainer = per_step_us(lambda n: trainer_steps(driven, events, n), args.steps, args.repeat)
    done = Engine()
    Probe(done, never, path="loop")._detach()
    after = per_step_us(lambda n: loop_steps(done, n), args.steps, args.repeat)
    print(f"{'':<40} {'us per step':>11} {'added us':>9} {'of a 250 ms step':>17}")
    for name, us in (("bare engine calls", bare), ("probe waiting, engine loop", loop),
                     ("probe waiting, Trainer's step events", trainer), ("probe done (unwrapped)", after)):
        added = us - bare
        print(f"{name:<40} {us:>11.3f} {added:>9.3f} {added * 1e-6 / GPU_STEP_S:>16.6%}")


if __name__ == "__main__":
    main()
