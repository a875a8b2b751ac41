"""The cold cases of `run_all.py` that matter most (the P-only start, an estimate with an architecture
on a card, the 70B plan) run here and in another checkout of zerocalc, interleaved round by round in
fresh processes: the median CPU time of each and how much slower or faster this checkout is. How
"no case slower than at commit X" is checked on a shared machine, whose speed drifts between runs:

    git worktree add /tmp/zerocalc-x X
    python benchmarks/against.py /tmp/zerocalc-x [--rounds 9]

Bytecode is allowed (the environment's PYTHONDONTWRITEBYTECODE removed), as in `run_all.py`.
Prints numbers, asserts nothing.
"""
import argparse
import os
import resource
import statistics
import subprocess

from run_all import CLI, COLD

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run_all's own cases, by their keys: the command lines are `run_all.COLD`'s, without the interpreter
CASES = {what: command[len(CLI):] for key, what, command, _ in COLD
         if key in ("baseline", "estimate-arch", "plan-70b")}


def cpu_seconds(root: str, args: list[str], env: dict) -> float:
    """User + system time of one fresh `python -m zerocalc.cli` run from the checkout at root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(CLI + args, cwd=root, env=dict(env, PYTHONPATH=root),
                   capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", help="another checkout of zerocalc (a git worktree)")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = {"other": os.path.abspath(a.other), "this": HERE}
    times = {(t, c): [] for t in trees for c in CASES}
    for root in trees.values():                  # compiled once before timing
        for args in CASES.values():
            cpu_seconds(root, args, env)
    for r in range(a.rounds):
        for case, args in CASES.items():
            order = list(trees.items()) if r % 2 else list(trees.items())[::-1]
            for tree, root in order:
                times[(tree, case)].append(cpu_seconds(root, args, env))
    print(f"CPU time, medians of {a.rounds} rounds; other = {trees['other']}")
    for case in CASES:
        other, this = (statistics.median(times[(t, case)]) for t in ("other", "this"))
        print(f"{case:100s} other {other * 1e3:5.0f} ms  this {this * 1e3:5.0f} ms  {100 * (this / other - 1):+.1f}%")


if __name__ == "__main__":
    main()
