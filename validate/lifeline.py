"""What ties a launch to the runner that started it, so that nothing outlives the runner and a failed
rank is reported by itself.

- The launcher dies with the runner (PR_SET_PDEATHSIG, Linux), and every worker watches the runner's
  pid (VALIDATE_RUNNER) and kills the launch's process group when it is gone: the launch runs in a
  session of its own (a hang is killed as a group), so a SIGKILLed runner would otherwise leave the
  launcher and the ranks running, holding GPUs, into an orphaned temp folder.
- Each launch's temp folder names its runner (OWNER_FILE); a runner that starts removes the folders,
  shared-memory buffers and build locks of launches whose runner is gone.
- A worker records the extension-build locks it creates (torch's FileBaton), so that after a failed
  launch only those are removed, never another process's build lock in the shared cache.
- Every rank writes its job outcome to RANK_FILE before the ranks gather their results; a rank that
  failed (with its traceback) waits there, outside any collective, until every rank has arrived, so
  a failure on every rank is gathered as usual, and a failure on one rank (the others blocked in a
  collective) is seen by the runner, which ends the launch after RANK_FAILURE_GRACE_S and writes the
  failing rank's traceback into the row.

Imports neither torch nor DeepSpeed: the runner uses it too.
"""
import contextlib
import glob
import json
import os
import shutil
import signal
import tempfile
import threading
import time

RUNNER_ENV = "VALIDATE_RUNNER"          # "<pid>:<start time>:<session>" of the runner
OWNER_FILE = "owner.json"               # in a launch's temp folder: its runner and port
BUILD_LOCKS_FILE = "build_locks.jsonl"  # in a launch's temp folder: build locks its ranks created
TEMP_PREFIX = "zerocalc-validate-"
SHM_DIR = "/dev/shm"
WATCH_INTERVAL_S = 1.0   # a read of /proc/PID/stat a second: nothing a timed step could notice


def append_line(path: str, record: dict) -> None:
    """One JSON line, flushed and fsynced."""
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: str) -> list[dict]:
    """The whole JSON lines of path (a line cut by a kill is skipped)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line))
    return out


# --- is a process still the one we mean -------------------------------------------------------------

def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which tells a pid
    reused by another process from the one we mean; "" where /proc is absent and the pid exists;
    None for no such process (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""


def identity(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start(pid) or ''}:{os.getsid(pid)}"


def alive(ident: str) -> bool:
    pid, start, _ = ident.split(":")
    now = process_start(int(pid))
    return now is not None and (not start or not now or now == start)


# --- launcher side: die with the runner -------------------------------------------------------------

def die_with_parent():
    """A preexec_fn: the launched process gets SIGKILL when the runner dies (Linux's PR_SET_PDEATHSIG;
    elsewhere the workers' watch alone does it)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()   # the runner, the launched process's parent

    def preexec():
        prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:          # the runner died before the call
            os._exit(1)
    return preexec


def watch_runner(ident: str | None = None, out_dir: str | None = None) -> threading.Thread | None:
    """In a worker: a daemon thread that, once the runner is gone, removes the launch's shared memory,
    build locks and temp folder and kills the launch's process group (launcher and every rank). Not
    started without VALIDATE_RUNNER (a worker started by hand)."""
    ident = ident or os.environ.get(RUNNER_ENV)
    if not ident:
        return None

    def watch():
        while alive(ident):
            time.sleep(WATCH_INTERVAL_S)
        if out_dir:
            clean_launch(out_dir)
        session = os.getsid(0)
        if str(session) != ident.split(":")[2]:    # never the runner's own session
            kill_session(session)
        os._exit(1)
    t = threading.Thread(target=watch, name="validate-runner-watch", daemon=True)
    t.start()
    return t


def kill_session(session: int) -> None:
    """SIGKILL every process of a session (a launch runs in one of its own): its process group, and the
    processes that made groups of their own inside it (torch's extension builds run the compiler in
    one), found by their session in /proc; this process last, when it is one of them."""
    with contextlib.suppress(OSError):
        if os.getpgid(session) == session and os.getpgrp() != session:
            os.killpg(session, signal.SIGKILL)
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) == session:
                    os.kill(int(entry), signal.SIGKILL)
    if os.getsid(0) == session:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)


# --- build locks ------------------------------------------------------------------------------------

def note_build_lock(out_dir: str, path: str) -> None:
    """Record a build lock this launch created, with its inode and modification time: whoever creates
    a lock at that path later gets another file."""
    st = os.stat(path)
    append_line(os.path.join(out_dir, BUILD_LOCKS_FILE),
                {"path": path, "ino": st.st_ino, "dev": st.st_dev, "mtime_ns": st.st_mtime_ns, "pid": os.getpid()})


def record_build_locks(out_dir: str, baton_class=None) -> None:
    """In a worker: every build lock torch's FileBaton creates in this process is noted in out_dir."""
    if baton_class is None:
        from torch.utils.file_baton import FileBaton as baton_class
    acquire = baton_class.try_acquire
    if getattr(acquire, "_validate_records", False):
        return

    def try_acquire(self):
        got = acquire(self)
        if got:
            with contextlib.suppress(OSError):
                note_build_lock(out_dir, self.lock_file_path)
        return got
    try_acquire._validate_records = True
    baton_class.try_acquire = try_acquire


def remove_own_build_locks(out_dir: str) -> list[str]:
    """Remove the build locks the launch in out_dir created and did not release (a rank that dies while
    it JIT-builds an extension leaves the lock, and every later launch waits on it forever); a lock at
    the same path that is another file (another process's build) stays. Returns what it removed."""
    removed = []
    for rec in read_lines(os.path.join(out_dir, BUILD_LOCKS_FILE)):
        with contextlib.suppress(OSError):
            st = os.stat(rec["path"])
            if (st.st_ino, st.st_dev, st.st_mtime_ns) == (rec["ino"], rec["dev"], rec["mtime_ns"]):
                os.remove(rec["path"])
                removed.append(rec["path"])
    return removed


def remove_shm_buffers(port: int, shm_dir: str | None = None) -> None:
    """DeepSpeed 0.19.8's CPU all-reduce (deepspeed_shm_comm) makes one 66 MiB shared-memory buffer
    per rank, `/dev/shm/deepspeed_allreduce_buffer_0_<addr>_<port>_<rank>`, and never unlinks it: RAM
    that outlives the launch. Remove the buffers of the launch that used `port`."""
    for path in glob.glob(os.path.join(shm_dir or SHM_DIR, f"deepspeed_*_{port}_*")):
        with contextlib.suppress(OSError):
            os.remove(path)


def clean_launch(out_dir: str, shm_dir: str | None = None) -> None:
    """Everything a launch leaves outside its processes: shared memory, unreleased build locks, its temp
    folder."""
    owner = read_owner(out_dir)
    if owner and owner.get("port"):
        remove_shm_buffers(owner["port"], shm_dir)
    remove_own_build_locks(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)


# --- the runner's temp folders ----------------------------------------------------------------------

def write_owner(out_dir: str, port: int) -> None:
    with open(os.path.join(out_dir, OWNER_FILE), "w") as f:
        json.dump({"runner": identity(), "port": port}, f)


def read_owner(out_dir: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(out_dir, OWNER_FILE)) as f:
            return json.load(f)
    return None


def clean_orphans(temp_root: str | None = None, shm_dir: str | None = None) -> list[str]:
    """Remove what launches of runners that are gone left behind (a runner killed with SIGKILL cleans
    nothing): their temp folders, shared-memory buffers and build locks. Folders without an owner
    file, or whose runner is alive, stay. Returns the folders removed."""
    removed = []
    for d in glob.glob(os.path.join(temp_root or tempfile.gettempdir(), TEMP_PREFIX + "*")):
        owner = read_owner(d)
        if not owner or not os.path.isdir(d) or alive(owner["runner"]):
            continue
        clean_launch(d, shm_dir)
        removed.append(d)
    return removed


# --- rank outcomes ----------------------------------------------------------------------------------

RANK_FILE = "rank{rank}.jsonl"
RANK_FAILURE_GRACE_S = 20.0   # how long the runner waits for every rank to reach the gather after one failed


def arrive(out_dir: str, key: str, rank: int, world: int, outcome: str, error: str = "",
           poll_s: float = 0.2) -> None:
    """Called by every rank after a job, before the ranks gather their results: notes this rank's
    outcome (and a failed rank's traceback). A failed rank then waits for every rank to arrive, so that
    it never enters the gather while another rank is still blocked in one of the job's collectives
    (the collectives would pair up wrongly); if they never arrive, the runner ends the launch."""
    append_line(os.path.join(out_dir, RANK_FILE.format(rank=rank)),
                {"key": key, "rank": rank, "outcome": outcome, "error": error, "time": time.time()})
    if outcome == "ok":
        return
    while not all(any(r["key"] == key for r in read_lines(os.path.join(out_dir, RANK_FILE.format(rank=i))))
                  for i in range(world)):
        time.sleep(poll_s)


def rank_failures(out_dir: str) -> dict:
    """{key: the first failed rank's record} from the launch's rank files."""
    out = {}
    for path in sorted(glob.glob(os.path.join(out_dir, RANK_FILE.format(rank="*")))):
        for r in read_lines(path):
            if r.get("outcome") not in (None, "ok"):
                if r["key"] not in out or r["time"] < out[r["key"]]["time"]:
                    out[r["key"]] = r
    return out


def describe_failure(record: dict, max_chars: int = 500) -> str:
    """A failed rank's record as one line for the row: "rank R: " and the last lines of its traceback
    (the exception, then where it was raised), the end kept when too long."""
    lines = [ln.strip() for ln in str(record.get("error", "")).splitlines() if ln.strip(" \t^~")]
    text = f"rank {record.get('rank')}: " + " | ".join(lines[-4:])
    return text if len(text) <= max_chars else text[:40] + " ... " + text[-(max_chars - 45):]


def record_crash(out_dir: str, rank: int, error: str) -> None:
    """A rank that dies outside a job (at start, in a gather): its traceback, for the runner's crash row."""
    with contextlib.suppress(OSError):
        append_line(os.path.join(out_dir, RANK_FILE.format(rank=rank)),
                    {"key": "", "rank": rank, "outcome": "crash", "error": error, "time": time.time()})
