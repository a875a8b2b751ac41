"""Every speed figure zerocalc quotes, measured in one run, each as a ratio to the P-only cold start
`zerocalc estimate --params 7e9 --dp 8` measured in the same run (the absolute times beside it, and
the machine named), so a figure is re-measured wherever it is quoted rather than copied.

    python benchmarks/run_all.py [--repeat 7] [--json data/speed.json]

Cold cases are fresh processes, run round-robin (one of each per round), each run just after a run of
the baseline; each case reports the median over rounds of its wall time and of its CPU time (user +
system, from the kernel's accounting of the child), and the median of its ratios to the baseline run
beside it (a loaded or throttled machine slows a pair alike). Bytecode is allowed (the environment's
PYTHONDONTWRITEBYTECODE removed) but for the row that sets it, which runs a copy of the package never
compiled.
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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "zerocalc.cli"]
ARCH_ARGS = ["estimate", "--model", "llama-2-7b", "--dp", "8", "--seq-len", "4096", "--micro-batch", "1", "--gpu", "h100"]
SCRATCH = "<scratch>"     # a case's PYTHONPATH: run from a fresh copy of the package (`measure`)
# (key, what, command, environment); the keys name the figures data/speed.json gives the documents.
BASELINE = ("baseline", "P-only cold start: estimate --params 7e9 --dp 8", CLI + ["estimate", "--params", "7e9", "--dp", "8"], {})
COLD = [
    BASELINE,
    ("estimate-arch", "estimate --model llama-2-7b --dp 8 --seq-len 4096 --micro-batch 1 --gpu h100",
     CLI + ARCH_ARGS, {}),
    # the same command's replays alone, timed inside it: its times are the replays' (`timed_replays.py`)
    ("replay-arch", "the allocator replays inside that command (timed in its process)",
     [sys.executable, os.path.join(ROOT, "benchmarks", "timed_replays.py")] + ARCH_ARGS, {}),
    ("plan-70b", "plan --params 70e9 --gpu h100 --gpu-memory 80GiB --max-gpus 64 --seq-len 4096 --global-batch 1024",
     CLI + ["plan", "--params", "70e9", "--gpu", "h100", "--gpu-memory", "80GiB", "--max-gpus", "64",
            "--seq-len", "4096", "--global-batch", "1024"], {}),
    ("plan-70b-min-gpus", "the same plan with --min-gpus",
     CLI + ["plan", "--params", "70e9", "--gpu", "h100", "--gpu-memory", "80GiB", "--max-gpus", "64",
            "--seq-len", "4096", "--global-batch", "1024", "--min-gpus"], {}),
    # a copy of the package never compiled (no __pycache__), run from its folder: an editable checkout
    # under PYTHONDONTWRITEBYTECODE, which compiles every module at every start
    ("no-bytecode", "P-only cold start of a never-compiled checkout, PYTHONDONTWRITEBYTECODE=1", BASELINE[2],
     {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": SCRATCH}),
    ("interpreter", "python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"], {}),
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
print(json.dumps({"n": len(out["peak_bytes"]), "sweep-first": first, "sweep-later": later, "events": len(events),
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


def cold(cmd, extra_env, scratch: str = ROOT) -> tuple[float, ...]:
    """(wall s, CPU s) of one fresh process, in the checkout (or in `scratch` where the case says); for
    `timed_replays.py`, (wall s, CPU s) of its replays and then of the rest of the process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env)
    where = ROOT
    if env["PYTHONPATH"] == SCRATCH:
        where = env["PYTHONPATH"] = scratch    # and run there: `python -m` looks in its folder first
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode()
    p.stderr.close()
    if p.returncode not in (0, 1):      # plan exits 1 when nothing fits
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {err[-2000:]}")
    last = err.strip().splitlines()[-1:] or [""]
    cpu = usage.ru_utime + usage.ru_stime
    if last[0].startswith("replays: "):     # timed_replays.py: the replays' own times
        replay_wall, replay_cpu = (float(x) for x in last[0].split()[1:])
        return replay_wall, replay_cpu, wall - replay_wall, cpu - replay_cpu
    return wall, cpu


def measure(repeat: int) -> dict:
    """Every case's median wall and CPU seconds over `repeat` rounds and its ratios to the baseline: each
    run is paired with a baseline run just before it, and a ratio is the median of the pairs' (this
    machine's speed drifts by a third within a minute; a pair sees the same speed), with the machine
    and the commit."""
    scratch = tempfile.mkdtemp(prefix="zerocalc-bench-")
    shutil.copytree(os.path.join(ROOT, "zerocalc"), os.path.join(scratch, "zerocalc"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    base_cmd, base_env = BASELINE[2], BASELINE[3]
    try:
        for _, _, cmd, env in COLD:        # compile bytecode where it may be written; warm the page cache
            cold(cmd, env, scratch)
        runs = {key: [] for key, _, _, _ in COLD}     # (wall, CPU) of each run
        pairs = {key: [] for key, _, _, _ in COLD}    # (wall, CPU) of its baseline run
        inproc, inproc_base = [], []
        for _ in range(repeat):
            for key, _, cmd, env in COLD:
                pairs[key].append(cold(base_cmd, base_env, scratch))
                runs[key].append(cold(cmd, env, scratch))
            inproc_base.append(cold(base_cmd, base_env, scratch))
            out = subprocess.run([sys.executable, "-c", IN_PROCESS], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": ROOT}, check=True).stdout
            inproc.append(json.loads(out))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def case(key, name, times, baselines):
        ratios = [[t[k] / b[k] for t, b in zip(times, baselines)] for k in (0, 1)]
        return {"key": key, "case": name, "wall_s": statistics.median(t[0] for t in times),
                "cpu_s": statistics.median(t[1] for t in times), "wall_ratio": statistics.median(ratios[0]),
                "cpu_ratio": statistics.median(ratios[1]), "cpu_ratio_range": [min(ratios[1]), max(ratios[1])]}
    cases = [case(key, name, [t[:2] for t in runs[key]], pairs[key]) for key, name, _, _ in COLD]
    # the same processes less their replays: what replays costing nothing would leave
    k = next(i for i, c in enumerate(cases) if c["key"] == "replay-arch")
    cases.insert(k + 1, case("estimate-arch-rest", "that command less its replays (the same processes)",
                             [t[2:] for t in runs["replay-arch"]], pairs["replay-arch"]))
    n, events = inproc[0]["n"], inproc[0]["events"]
    for key, name in (("sweep-first", f"sweep over {n:,} configurations, first call (stage-3 replays included)"),
                      ("sweep-later", f"sweep over {n:,} configurations, later calls"),
                      ("replay", f"allocator replay of llama-2-7b stage 2 N = 8 4k, {events:,} events")):
        cases.append(case(key, name, [r[key] for r in inproc], inproc_base))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "rounds": repeat,
            "sweep_configurations": n, "replay_events": events, "cases": cases}


def show(result: dict) -> None:
    cases = {c["key"]: c for c in result["cases"]}
    base = cases["baseline"]
    n, events = result["sweep_configurations"], result["replay_events"]
    print(f"machine: {result['machine']}")
    print(f"{result['rounds']} rounds; medians; ratio = the median over rounds of time / the P-only cold start's "
          f"run just before it (wall {base['wall_s'] * 1e3:.0f} ms, CPU {base['cpu_s'] * 1e3:.0f} ms)\n")
    print(f"{'case':100s} {'wall':>8s} {'ratio':>6s} {'CPU':>8s} {'ratio':>6s}  CPU ratio range / rate")
    for c in result["cases"]:
        w, cpu = c["wall_s"], c["cpu_s"]
        extra = f"{c['cpu_ratio_range'][0]:.2f}-{c['cpu_ratio_range'][1]:.2f}×"
        if c["key"] == "sweep-later":
            extra += f"; {n / w / 1e6:.1f}M configurations/s wall, {n / cpu / 1e6:.1f}M CPU"
        elif c["key"] == "replay":
            extra += f"; {events / w / 1e6:.2f}M events/s wall, {events / cpu / 1e6:.2f}M CPU"
        print(f"{c['case']:100s} {w * 1e3:6.0f}ms {c['wall_ratio']:5.2f}× {cpu * 1e3:6.0f}ms "
              f"{c['cpu_ratio']:5.2f}×  {extra}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--json", metavar="PATH", help="also write the medians there (data/speed.json: the "
                    "README's and docs/speed.md's figures, `python -m validate docs`)")
    args = ap.parse_args()
    result = measure(args.repeat)
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
