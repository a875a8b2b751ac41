"""What a rank holds and sends, read from the engine itself and from torch's allocator."""
import contextlib
import gc
import json
import os
import threading
import time

import torch

# The measurements a user's job shares with the validator (zerocalc.probe) are defined there, once.
from zerocalc.probe.measure import (SCALAR_BYTES, MemoryRecorder, comm_summary, environment,  # noqa: F401
                                    meminfo_bytes as _meminfo_bytes, resident_state, status_bytes as _status_bytes,
                                    synchronize)


def append_line(path, record):
    """Append one JSON line and flush it to disk, so a killed run leaves only whole lines."""
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def probe_machine(device) -> dict:
    """How fast this host and this GPU are right now, measured beside each job's timed steps, so a
    step-time miss can be told apart from a slow host or a throttled GPU (both vary between runs):
    - launch_s: host seconds to issue one tiny kernel (2,000 in-place adds on one element, not waited
      for; the GPU runs them as fast as they come), median of 5 rounds;
    - matmul_flops_per_s: a bf16 8192^3 matmul, 10 in a row between synchronizes, median of 3 rounds.
    Empty off CUDA."""
    if device.type != "cuda":
        return {}
    import statistics
    x = torch.zeros(1, device=device)
    launches = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            x.add_(1.0)
        launches.append((time.perf_counter() - t0) / 2000)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a @ b
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        rates.append(10 * 2 * 8192**3 / (time.perf_counter() - t0))
    del x, a, b
    return {"launch_s": statistics.median(launches), "matmul_flops_per_s": statistics.median(rates)}


HOST_PROBE_LAUNCHES = 500


def host_issue_s(device) -> float | None:
    """Host seconds to issue one tiny kernel, from HOST_PROBE_LAUNCHES in-place adds not waited for:
    taken before each timed step (the step is timed after it, from a synchronize), so a slow step can be
    set beside how fast this host issued work just then. None off CUDA."""
    if device.type != "cuda":
        return None
    x = torch.zeros(1, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_PROBE_LAUNCHES):
        x.add_(1.0)
    return (time.perf_counter() - t0) / HOST_PROBE_LAUNCHES


HOST_PROBE_PYTHON_CALLS = 20_000


class _Module:
    """A stand-in for the Python a training step runs between kernels: a call through __call__ with
    keyword arguments, attribute and dict lookups, a small allocation."""

    def __init__(self):
        self.hooks, self.count = {}, 0

    def __call__(self, x, *, scale=1):
        hook = self.hooks.get(x & 63)
        self.count += scale if hook is None else hook
        return (x, self.count)


def host_python_s() -> float:
    """Host seconds per call of HOST_PROBE_PYTHON_CALLS calls of `_Module`: how fast this host runs
    Python that issues nothing, taken beside `host_issue_s` before each timed step. The launch probe
    follows only part of the host's time (`zerocalc.timing.host_scale`, phi); this one asks whether the
    rest, the interpreter's own speed, moves with the step time too. No device needed."""
    m = _Module()
    t0 = time.perf_counter()
    for i in range(HOST_PROBE_PYTHON_CALLS):
        m(i, scale=1)
    return (time.perf_counter() - t0) / HOST_PROBE_PYTHON_CALLS


def _siblings(cpu: int) -> set[int]:
    """The CPUs sharing `cpu`'s core (its SMT siblings, itself included), from sysfs; {cpu} where unreadable."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@contextlib.contextmanager
def main_thread_alone():
    """Run the calling thread alone on one core: it is pinned to the last CPU it may use, and every other
    thread of this process (CUDA's, NCCL's, OpenMP's, DeepSpeed's, all started by now) is kept off that
    CPU and its SMT siblings (off that CPU alone where nothing else would be left). Masks are restored on
    exit. Yields the main thread's CPU, or None where affinity cannot be set. An experiment on the host's
    two speeds (data/README.md, t10 probes): does a step time steady when nothing of ours shares the
    core of the thread that issues the work?"""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    me = threading.get_native_id()
    allowed = set(os.sched_getaffinity(0))
    cpu = max(allowed)
    others = allowed - _siblings(cpu) or allowed - {cpu} or allowed
    saved = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu} if tid == me else others)
        except OSError:            # a thread that ended meanwhile
            saved.pop(tid, None)
    try:
        yield cpu
    finally:
        for tid, mask in saved.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass


class HostCounters:
    """Where a timed step's host time went, read around each step (Linux; None where unreadable):
    - runq_s: seconds the main thread was runnable but waited for a CPU (/proc/thread-self/schedstat,
      field 2): other threads or processes of this guest took its core;
    - steal_s: CPU seconds the hypervisor gave to someone else, summed over this guest's CPUs
      (/proc/stat, `steal`, in clock ticks of 10 ms);
    - gc_s: seconds in Python's garbage collector (gc.callbacks);
    - sm_mhz: the GPU's SM clock right after the step (NVML through torch; None without pynvml).
    The main thread spins in synchronize(), so its CPU time equals the wall time and tells nothing;
    these say whether a slow step waited for a CPU, lost it to the hypervisor or collected garbage."""

    def __init__(self, device):
        self.device = device
        self.gc_s, self._gc_t0 = 0.0, None
        gc.callbacks.append(self._gc)

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def close(self):
        gc.callbacks.remove(self._gc)

    @staticmethod
    def _read():
        try:
            with open("/proc/thread-self/schedstat") as f:
                runq_ns = int(f.read().split()[1])
            with open("/proc/stat") as f:
                steal_ticks = int(f.readline().split()[8])
            return runq_ns / 1e9, steal_ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None, None

    def start(self):
        self._t0 = self._read() + (self.gc_s,)

    def stop(self) -> dict:
        (runq0, steal0, gc0), (runq1, steal1) = self._t0, self._read()
        out = {"runq_s": None if runq0 is None or runq1 is None else runq1 - runq0,
               "steal_s": None if steal0 is None or steal1 is None else steal1 - steal0,
               "gc_s": self.gc_s - gc0, "sm_mhz": None}
        if self.device.type == "cuda":
            try:
                out["sm_mhz"] = torch.cuda.clock_rate(self.device)
            except Exception:  # noqa: BLE001  -- pynvml missing or NVML unreadable: not recorded
                pass
        return out


def reset_host_peak() -> bool:
    """Reset this process's peak resident set (VmHWM) to its current one (`echo 5 > /proc/self/clear_refs`,
    Linux 4.0+); True when the reset took (VmHWM fell to within 1 MiB of VmRSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    s = _status_bytes("VmHWM", "VmRSS")
    return None not in s.values() and s["VmHWM"] - s["VmRSS"] < 2**20


def _pinned_bytes(cuda) -> dict:
    """Pinned host memory: what torch's caching host allocator holds (its blocks are rounded up to a
    power of two and kept cached after a free: `allocated_bytes` counts them, active or cached) and
    the bytes DeepSpeed asked to pin (`deepspeed.utils.pin_memory_tracker`, unrounded)."""
    out = {"pinned_bytes": None, "pinned_peak_bytes": None, "ds_pinned_bytes": None}
    if cuda and hasattr(torch.cuda, "host_memory_stats"):
        try:
            stats = torch.cuda.host_memory_stats()
            out["pinned_bytes"] = stats.get("allocated_bytes.all.current", stats.get("allocated_bytes.current"))
            out["pinned_peak_bytes"] = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.peak"))
        except Exception:  # noqa: BLE001  -- a torch without host stats: not recorded
            pass
    try:
        from deepspeed.utils.pin_memory_tracker import _tracker
        out["ds_pinned_bytes"] = _tracker._bytes
    except (ImportError, AttributeError):
        pass
    return out


class HostRecorder:
    """The host memory of this rank over a job's life: at the job's start (the runtime's baseline: torch,
    CUDA, NCCL and what earlier jobs left) and at the end of each of HOST_PHASES, the peak resident set
    within the phase (VmHWM, reset at each boundary through /proc/self/clear_refs), the resident set at
    its end (VmRSS), the pinned bytes (`_pinned_bytes`) and the host's MemAvailable. Where the reset
    does not take, each phase's peak is the process's peak so far (`hwm_reset` False)."""

    def __init__(self, cuda):
        self.cuda, self.phases = cuda, {}

    def _snapshot(self) -> dict:
        s = _status_bytes("VmHWM", "VmRSS")
        m = _meminfo_bytes("MemAvailable", "MemTotal")
        return {"hwm_bytes": s["VmHWM"], "rss_bytes": s["VmRSS"], "available_bytes": m["MemAvailable"],
                "total_bytes": m["MemTotal"], **_pinned_bytes(self.cuda)}

    def start(self):
        gc.collect()
        try:
            from deepspeed.utils.pin_memory_tracker import _tracker
            _tracker.reset()
        except (ImportError, AttributeError):
            pass
        if self.cuda and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            try:
                torch.cuda.reset_peak_host_memory_stats()
            except Exception:  # noqa: BLE001
                pass
        self.hwm_reset = reset_host_peak()
        self.phases["start"] = self._snapshot()

    def mark(self, name):
        self.phases[name] = self._snapshot()
        reset_host_peak()

    def summary(self) -> dict:
        return {"hwm_reset": self.hwm_reset, "phases": self.phases}
