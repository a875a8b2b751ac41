"""What a rank holds and sends, read from the engine itself, torch's allocator and /proc: the one
definition of each measurement, used by the validator's worker (`validate.measure`) and by the probe
of a user's job (`zerocalc.probe`). torch and DeepSpeed are imported inside the functions."""
import os
import time

# Whose objects the state walk follows (besides every torch module, whatever package defines it): the
# models the validator trains are zerocalc.hf.families' (HFCausalLM, SeedGPT), Hugging Face's and PEFT's.
_WALK_MODULES = ("deepspeed", "torch", "validate", "zerocalc", "transformers", "collections", "peft")
# Storages this small are scalars (grad norm, overflow flag, inf/nan tracker, loss scale): reported
# apart as the named residual, not compared against the state model.
SCALAR_BYTES = 8


def synchronize(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def _children(obj, torch):
    """(name, child) pairs worth following from obj: containers, torch modules and DeepSpeed/torch objects."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (f"[{type(k).__name__}]", k)
            yield (f"[{k!r}]" if isinstance(k, (str, int)) else "[.]", v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield ("[]", v)
    elif isinstance(obj, torch.Tensor):
        yield from vars(obj).items() if hasattr(obj, "__dict__") else ()
    elif (type(obj).__module__.split(".")[0] in _WALK_MODULES or isinstance(obj, torch.nn.Module)) \
            and hasattr(obj, "__dict__"):
        yield from vars(obj).items()


def resident_state(engine) -> dict:
    """Bytes of every distinct tensor storage reachable from the engine, by the attribute that first
    reached it (breadth first). Storages are de-duplicated, so a parameter that is a view into a
    flat buffer counts once, in the buffer. {"by_device": {device type: bytes}, "scalar_bytes": bytes
    of storages of SCALAR_BYTES or less, "by_path": {path: bytes}}."""
    import torch
    seen_objects, seen_storages = set(), {}
    frontier = [("engine", engine)]
    while frontier:
        nxt = []
        for path, obj in frontier:
            if id(obj) in seen_objects or isinstance(obj, (type, str, bytes, int, float, bool)) or obj is None:
                continue
            seen_objects.add(id(obj))
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                key = (storage.data_ptr(), obj.device.type) if storage.data_ptr() else ("id", id(storage))
                if key not in seen_storages and storage.nbytes() > 0:
                    seen_storages[key] = (path, storage.nbytes(), obj.device.type)
            for name, child in _children(obj, torch):
                nxt.append((f"{path}.{name}" if not name.startswith("[") else path + name, child))
        frontier = nxt
    by_path, by_device, scalars = {}, {}, 0
    for path, nbytes, dev in seen_storages.values():
        by_path[path] = by_path.get(path, 0) + nbytes
        if nbytes <= SCALAR_BYTES:
            scalars += nbytes
        else:
            by_device[dev] = by_device.get(dev, 0) + nbytes
    return {"by_device": by_device, "scalar_bytes": scalars, "by_path": by_path}


def comm_summary(summary) -> dict:
    """{op: [[msg_size_bytes, count], ...]} from the comms logger's summary (`log_all(return_dict=True)`,
    as `deepspeed.comm.log_summary(return_dict=True)` returns it)."""
    out = {}
    for op, sizes in (summary or {}).get("summary", {}).items():
        out[op] = sorted([int(size), int(v["count"])] for size, v in sizes.items())
    return out


def comm_by_op(comm: dict) -> dict:
    """{op: bytes} from `comm_summary`'s {"op | [Caller Func: f]": [[size, count], ...]}."""
    out = {}
    for name, sizes in comm.items():
        op = name.split(" |")[0]
        out[op] = out.get(op, 0) + sum(size * count for size, count in sizes)
    return out


def tolerate_unknown_comm_ops() -> None:
    """DeepSpeed 0.19.8's comms logger calls `exit(0)` for an op missing from its bandwidth table
    (`utils/comms_logging.py`, `calc_bw_log`; seen with torch.optim.SGD at stage 2: the launch ended
    'successfully' half-way through a sweep). Give such an op zero bandwidth instead; its size and
    count are logged as before. Idempotent."""
    from deepspeed.utils import comms_logging
    known = comms_logging.calc_bw_log
    if getattr(known, "zerocalc_tolerant", False):
        return

    def calc_bw_log(comm_op, size, duration):
        try:
            return known(comm_op, size, duration)
        except SystemExit:
            return 0.0, 0.0

    calc_bw_log.zerocalc_tolerant = True
    comms_logging.calc_bw_log = calc_bw_log


class MemoryRecorder:
    """Peak allocated/reserved per phase (init, forward, backward, step) and what is allocated at the
    end of each phase; on CPU it records nothing."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.peaks = {}
        self.seconds = {}
        self._t = None

    def start(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base_allocated = torch.cuda.memory_allocated()
        self._t = time.perf_counter()

    def mark(self):
        """Start timing the next phase from now."""
        synchronize(self.cuda)
        self._t = time.perf_counter()

    def phase(self, name, record=True):
        """Close phase `name`: its peaks, what is allocated at its end, and its duration (record=False
        files it under first_<name>: the warm-up steps)."""
        if not self.cuda:
            return
        import torch
        torch.cuda.synchronize()
        now = time.perf_counter()
        key = name if record or name == "init" else "first_" + name
        self.seconds.setdefault(key, []).append(now - self._t)
        self._t = now
        stats = torch.cuda.memory_stats()
        cur = self.peaks.setdefault(key, {"peak_allocated": 0, "peak_reserved": 0, "end_allocated": 0})
        cur["peak_allocated"] = max(cur["peak_allocated"], stats["allocated_bytes.all.peak"])
        cur["peak_reserved"] = max(cur["peak_reserved"], stats["reserved_bytes.all.peak"])
        cur["end_allocated"] = max(cur["end_allocated"], stats["allocated_bytes.all.current"])
        cur["retries"] = stats.get("num_alloc_retries", 0)
        torch.cuda.reset_peak_memory_stats()

    def summary(self):
        if not self.cuda:
            return None
        import torch
        free, total = torch.cuda.mem_get_info()
        return {"phases": self.peaks,
                "phase_seconds": {k: sorted(v)[len(v) // 2] for k, v in self.seconds.items()},
                "device_used_bytes": total - free,
                "reserved_now": torch.cuda.memory_reserved(),
                "peak_allocated": max(p["peak_allocated"] for p in self.peaks.values()),
                "peak_reserved": max(p["peak_reserved"] for p in self.peaks.values()),
                "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
                "base_allocated": self.base_allocated}


def kb_fields_bytes(path: str, *keys) -> dict:
    """Fields of a /proc file given in kB (`/proc/self/status`, `/proc/meminfo`), in bytes; None where unreadable."""
    out = dict.fromkeys(keys)
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in out:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def status_bytes(*keys) -> dict:
    """This process's /proc/self/status fields in bytes (VmHWM: its peak resident set, VmRSS: now)."""
    return kb_fields_bytes("/proc/self/status", *keys)


def meminfo_bytes(*keys) -> dict:
    """The host's /proc/meminfo fields in bytes (MemAvailable, MemTotal)."""
    return kb_fields_bytes("/proc/meminfo", *keys)


def environment(device) -> dict:
    """Where a job ran: versions, host, date, CPUs and, on CUDA, the GPU."""
    import platform

    import deepspeed
    import torch
    env = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": platform.python_version(),
           "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "cpus": f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} of "
                   f"{os.cpu_count()}"}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            import subprocess
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env
