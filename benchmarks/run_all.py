"""Every speed figure zerocalc quotes, measured in one run, each as a ratio to the P-only cold start
`zerocalc estimate --params 7e9 --dp 8` measured in the same run (the absolute times beside it, and
the machine named), so a figure is re-measured wherever it is quoted rather than copied.

    python benchmarks/run_all.py [--repeat 7]

Cold cases are fresh processes, run round-robin (one of each per round) so that a loaded machine
slows them alike; each reports the median over rounds of its wall time and of its CPU time (user +
system, from the kernel's accounting of the child), and the ratio of each to the baseline's. Bytecode
is allowed (the environment's PYTHONDONTWRITEBYTECODE removed) but for the row that sets it.
In-process cases (the sweep, the allocator replay) run in a fresh process each round too (their first
call pays for empty caches) and report wall and CPU time likewise.
Prints numbers, asserts nothing: a benchmark, not a test. It replaces sweep_and_plan.py; cold_start.py
(zerocalc beside DeepSpeed's own estimator), allocator_replay.py (the recorded histories) and
sequence_replay.py (generation and replay per stage) still measure what they say. docs/speed.md says
what each case costs and why.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "zerocalc.cli"]
BASELINE = ("P-only cold start: estimate --params 7e9 --dp 8", CLI + ["estimate", "--params", "7e9", "--dp", "8"], {})
COLD = [
    BASELINE,
    ("estimate --model llama-2-7b --dp 8 --seq-len 4096 --micro-batch 1 --gpu h100",
     CLI + ["estimate", "--model", "llama-2-7b", "--dp", "8", "--seq-len", "4096", "--micro-batch", "1",
            "--gpu", "h100"], {}),
    ("plan --params 70e9 --gpu h100 --gpu-memory 80GiB --max-gpus 64 --seq-len 4096 --global-batch 1024",
     CLI + ["plan", "--params", "70e9", "--gpu", "h100", "--gpu-memory", "80GiB", "--max-gpus", "64",
            "--seq-len", "4096", "--global-batch", "1024"], {}),
    ("the same plan with --min-gpus",
     CLI + ["plan", "--params", "70e9", "--gpu", "h100", "--gpu-memory", "80GiB", "--max-gpus", "64",
            "--seq-len", "4096", "--global-batch", "1024", "--min-gpus"], {}),
    ("P-only cold start with PYTHONDONTWRITEBYTECODE=1", BASELINE[1], {"PYTHONDONTWRITEBYTECODE": "1"}),
    ("python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"], {}),
]

# In a fresh process: the sweep's first call (stage-3 replays included) and later calls on a grid of
# 1e6 configurations, and the allocator's replay of a generated sequence.
IN_PROCESS = r"""
import json, time
import numpy as np
clocks = (time.perf_counter, time.process_time)        # wall, CPU

def timed(fn):
    t0 = [c() for c in clocks]
    out = fn()
    return out, [c() - t for c, t in zip(clocks, t0)]

from zerocalc import sweep
axes = dict(num_params=np.round(np.linspace(1e8, 2e11, 250)), dp=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            stage=[0, 1, 2, 3], param_bytes=[2, 4], gas=list(range(1, 51)))
out, first = timed(lambda: sweep.evaluate(sweep.grid(**axes)))
later = min((timed(lambda: sweep.evaluate(sweep.grid(**axes)))[1] for _ in range(3)), key=lambda t: t[1])
from zerocalc import allocator, sequence
from zerocalc.arch import preset
from zerocalc.model import from_architecture
from zerocalc.training import Setup, Stage
events = sequence.events(from_architecture(preset("llama-2-7b"), "llama-2-7b"),
                         Setup(stage=Stage.GRADIENTS, dp=8, seq_len=4096))
replay = min((timed(lambda: allocator.replay(events))[1] for _ in range(3)), key=lambda t: t[1])
print(json.dumps({"n": len(out["peak_bytes"]), "first": first, "later": later, "events": len(events),
                  "replay": replay}))
"""

def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} cores, {model}; Python {platform.python_version()}; "
            f"load average {load:.2f} at the start")


def cold(cmd, extra_env) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode()
    p.stderr.close()
    if p.returncode not in (0, 1):      # plan exits 1 when nothing fits
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    for name, cmd, env in COLD:        # compile bytecode where it may be written; warm the page cache
        cold(cmd, env)
    times = {name: [] for name, _, _ in COLD}
    inproc = []
    for _ in range(args.repeat):
        for name, cmd, env in COLD:
            times[name].append(cold(cmd, env))
        out = subprocess.run([sys.executable, "-c", IN_PROCESS], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT}, check=True).stdout
        inproc.append(json.loads(out))
    base_wall = statistics.median(w for w, _ in times[BASELINE[0]])
    base_cpu = statistics.median(c for _, c in times[BASELINE[0]])
    print(f"{args.repeat} rounds; medians; ratio = time / the P-only cold start's in this run "
          f"(wall {base_wall * 1e3:.0f} ms, CPU {base_cpu * 1e3:.0f} ms)\n")
    print(f"{'case':100s} {'wall':>8s} {'ratio':>6s} {'CPU':>8s} {'ratio':>6s}  wall spread")
    for name, _, _ in COLD:
        walls, cpus = [w for w, _ in times[name]], [c for _, c in times[name]]
        w, c = statistics.median(walls), statistics.median(cpus)
        print(f"{name:100s} {w * 1e3:6.0f}ms {w / base_wall:5.2f}× {c * 1e3:6.0f}ms {c / base_cpu:5.2f}×  "
              f"{min(walls) / base_wall:.2f}-{max(walls) / base_wall:.2f}×")
    n, events = inproc[0]["n"], inproc[0]["events"]

    def row(name, key, extra=lambda wall, cpu: ""):
        w = statistics.median(r[key][0] for r in inproc)
        c = statistics.median(r[key][1] for r in inproc)
        print(f"{name:100s} {w * 1e3:6.0f}ms {w / base_wall:5.2f}× {c * 1e3:6.0f}ms {c / base_cpu:5.2f}×  {extra(w, c)}")

    row(f"sweep over {n:,} configurations, first call (stage-3 replays included)", "first")
    row(f"sweep over {n:,} configurations, later calls", "later",
        lambda w, c: f"{n / w / 1e6:.1f}M configurations/s wall, {n / c / 1e6:.1f}M CPU")
    row(f"allocator replay of llama-2-7b stage 2 N = 8 4k, {events:,} events", "replay",
        lambda w, c: f"{events / w / 1e6:.2f}M events/s wall, {events / c / 1e6:.2f}M CPU")

if __name__ == "__main__":
    main()
