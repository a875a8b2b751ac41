"""`zerocalc ARGS` with the time spent in the allocator's replays (`allocator._Allocator.run`, every
call) measured inside the command and printed last on stderr as `replays: WALL_S CPU_S`: what the
replays cost in a cold process, beside everything else the command does (benchmarks/run_all.py)."""
import sys
import time

from zerocalc import allocator

_run = allocator._Allocator.run
spent = [0.0, 0.0]


def run(self, events):
    t0 = time.perf_counter(), time.process_time()
    try:
        return _run(self, events)
    finally:
        spent[0] += time.perf_counter() - t0[0]
        spent[1] += time.process_time() - t0[1]


allocator._Allocator.run = run
from zerocalc.cli import main  # noqa: E402  (after the patch, as the command imports the allocator lazily)

try:
    main(sys.argv[1:], prog_name="zerocalc")
finally:
    print(f"replays: {spent[0]:.6f} {spent[1]:.6f}", file=sys.stderr)
