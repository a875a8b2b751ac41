"""Launch jobs through DeepSpeed's own launcher and turn what the worker measured into tidy rows.

Resumable and crash-proof: rows go to the CSV as each job finishes (appended, flushed, whole lines),
jobs already in the CSV are skipped, and a job that crashes its launch or hangs past the timeout
becomes a row with that outcome while the rest are relaunched.
"""
import contextlib
import csv
import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from validate import rows
from validate.jobs import to_worker


def done_keys(csv_path: str, retry_failed: bool = False) -> set[str]:
    """Keys with a row already; with retry_failed, only those whose last row is ok."""
    if not os.path.exists(csv_path):
        return set()
    last = {}
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            last[r["key"]] = r["outcome"]
    return {k for k, o in last.items() if o == "ok" or not retry_failed}


def append_row(csv_path: str, row: dict) -> None:
    """Append one row; the header is written with the first. Flushed and fsynced: a killed sweep
    leaves whole lines only. A file written before a column existed (a new Setup field) gets it,
    empty in its earlier rows (read back as the field's default, `rows.job_from_row`)."""
    new = not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0
    if not new:
        with open(csv_path, newline="") as f:
            header = next(csv.reader(f))
    else:
        header = list(rows.COLUMNS)
    missing = [k for k in row if k not in header]
    if missing:
        header = _add_columns(csv_path, header, missing)
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in header})
        f.flush()
        os.fsync(f.fileno())


def _add_columns(csv_path: str, header: list[str], missing: list[str]) -> list[str]:
    """Rewrite the file with the missing columns at the end of its header (atomically: a killed sweep
    keeps the old file or the new one)."""
    with open(csv_path, newline="") as f:
        old = list(csv.DictReader(f))
    header = header + missing
    tmp = csv_path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, lineterminator="\n")
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in header} for r in old)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, csv_path)
    return header


def _read_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHM_DIR = "/dev/shm"


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed 0.19.8's CPU all-reduce (deepspeed_shm_comm) makes one 66 MiB shared-memory buffer
    per rank, `/dev/shm/deepspeed_allreduce_buffer_0_<addr>_<port>_<rank>`, and never unlinks it: RAM
    that outlives the launch (19 GB had piled up on the CI-like machine after a day of CPU tests).
    Remove the buffers of the launch that used `port`."""
    for path in glob.glob(os.path.join(SHM_DIR, f"deepspeed_*_{port}_*")):
        with contextlib.suppress(OSError):
            os.remove(path)


def extensions_dir() -> str:
    """Where torch JIT-builds C++ extensions (DeepSpeed's FusedAdam, CPUAdam, the CPU all-reduce):
    torch.utils.cpp_extension's build root, one folder per Python/device flavour and extension."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")


def remove_build_locks_since(t0: float) -> list[str]:
    """A rank that dies while it JIT-builds an extension leaves the build's `lock` file behind, and every
    later launch waits on it forever (torch's FileBaton): seen when one rank failed at start while rank 0
    built deepspeed_shm_comm; the next launches hung until their timeout. Remove the locks made since t0
    (the failed launch's start); a lock older than that is someone else's build. Returns what it removed."""
    removed = []
    for path in glob.glob(os.path.join(extensions_dir(), "*", "*", "lock")):
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) >= t0:
                os.remove(path)
                removed.append(path)
    return removed


class _Stop:
    """Around a running launch: SIGTERM or Ctrl-C in the driver becomes SystemExit, and however the
    driver leaves the block (a signal, an error such as a row the CSV cannot take, or normally), a launch
    still running is killed as a group (it runs in a session of its own, so it would otherwise live on,
    holding GPUs and locks) and its shared-memory buffers are removed; a launch that did not exit
    cleanly also leaves no extension-build lock it made (`remove_build_locks_since`)."""

    def __init__(self, proc, port, started: float):
        self.proc, self.port, self.started = proc, port, started
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    @staticmethod
    def _handle(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        remove_shm_buffers(self.port)
        if self.proc.returncode != 0:
            remove_build_locks_since(self.started)


def launch_command(backend: str, nproc: int, jobs_path: str, out_dir: str, include: str | None,
                   port: int) -> list[str]:
    cmd = ["deepspeed", "--master_port", str(port)]
    cmd += ["--include", include] if include else ["--num_gpus", str(nproc)]
    return cmd + ["--module", "validate.worker", jobs_path, out_dir]


def run(jobs: list[dict], backend: str, nproc: int, csv_path: str, timeout_s: float = 600,
        include: str | None = None, log=print, command: str | None = None, retry_failed: bool = False) -> list[dict]:
    """Run every job not yet in csv_path; return the rows written."""
    done = done_keys(csv_path, retry_failed)
    # Stage-3 engines are not freed by DeepSpeed (the worker restarts after one): run them last.
    pending = sorted((j for j in jobs if j["key"] not in done), key=lambda j: j["stage"] == 3)
    skipped = len(jobs) - len(pending)
    if skipped:
        log(f"{skipped} of {len(jobs)} jobs already in {csv_path}; running the other {len(pending)}")
    env = dict(os.environ)
    if backend == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    written, total, t_start = [], len(pending), time.time()
    while pending:
        with tempfile.TemporaryDirectory(prefix="zerocalc-validate-") as tmp:
            jobs_path = os.path.join(tmp, "jobs.json")
            with open(jobs_path, "w") as f:
                json.dump([to_worker(j) for j in pending], f)
            port = _free_port()
            launched = time.time() - 1   # file times may be rounded down to the second
            cmd = launch_command(backend, nproc, jobs_path, tmp, include, port)
            logf = open(os.path.join(tmp, "launch.log"), "w")
            proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            # The launch runs in its own session (a hang is killed as a group): if this driver is
            # interrupted, terminated or fails, take the launch and its shared memory down with it.
            with _Stop(proc, port, launched):
                by_key = {j["key"]: j for j in pending}
                finished, last_progress, hung = set(), time.time(), None
                while True:
                    code = proc.poll()
                    for res in _read_lines(os.path.join(tmp, "results.jsonl")):
                        if res["key"] in finished:
                            continue
                        finished.add(res["key"])
                        row = rows.make_row(by_key[res["key"]], res, backend, command)
                        append_row(csv_path, row)
                        written.append(row)
                        last_progress = time.time()
                        log(f"[{len(written)}/{total}] {res['key']}: {rows.describe(row)}  "
                            f"({time.time() - t_start:.0f} s)")
                    if code is not None:
                        break
                    started = _read_lines(os.path.join(tmp, "started.jsonl"))
                    running = [s for s in started if s["key"] not in finished]
                    since = running[-1]["time"] if running else last_progress
                    if time.time() - max(since, last_progress) > timeout_s:
                        hung = running[-1]["key"] if running else None
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        break
                    time.sleep(0.5)
            logf.close()
            started = [s["key"] for s in _read_lines(os.path.join(tmp, "started.jsonl"))]
            lost = [k for k in started if k not in finished]
            restarted = _read_lines(os.path.join(tmp, "restart.jsonl"))
            if restarted and not lost:
                log(f"fresh process for the remaining {len(pending) - len(finished)} jobs "
                    "(the last engine left memory allocated)")
            elif not lost and len(finished) < len(pending):
                # The launch died before starting the next job (e.g. at import): report the first pending.
                lost = [next(j["key"] for j in pending if j["key"] not in finished)]
            with open(os.path.join(tmp, "launch.log")) as f:
                tail = f.read()[-2000:]
            for key in lost[:1]:
                outcome = "timeout" if key == hung else "crash"
                row = rows.failed_row(by_key[key], outcome, tail, backend, command)
                append_row(csv_path, row)
                written.append(row)
                finished.add(key)
                log(f"[{len(written)}/{total}] {key}: {outcome} (launch exit {proc.returncode}); continuing")
            pending = [j for j in pending if j["key"] not in finished]
    return written
