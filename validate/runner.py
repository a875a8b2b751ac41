"""Launch jobs through DeepSpeed's own launcher and turn what the worker measured into tidy rows.

Resumable and crash-proof: rows go to the CSV as each job finishes (whole lines only,
`validate.results_file`), jobs already in the CSV are skipped, and every job ends in a row: a job
zerocalc rejects is not launched but written as an `error` row with the reason, a job whose launch
crashes, hangs past the timeout or loses one rank becomes a row with that outcome (and the failing
rank's traceback, `validate.lifeline`) while the rest are relaunched. One runner per results file (a
lock); the output is checked before the first launch; nothing the runner started outlives it.
"""
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from validate import lifeline, results_file, rows
from validate.jobs import steps_override, to_worker
from validate.results_file import ResultsFileError, append_row, done_keys  # noqa: F401  (the runner's file API)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where `validate` and `zerocalc` live


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHM_DIR = "/dev/shm"


def remove_shm_buffers(port: int) -> None:
    """The shared-memory buffers of the launch that used `port` (`lifeline.remove_shm_buffers`)."""
    lifeline.remove_shm_buffers(port, SHM_DIR)


class _Stop:
    """Around a running launch: SIGTERM or Ctrl-C in the driver becomes SystemExit, and however the
    driver leaves the block (a signal, an error such as a row the CSV cannot take, or normally), a launch
    still running is killed as a group (it runs in a session of its own, so it would otherwise live on,
    holding GPUs and locks) and its shared-memory buffers are removed; a launch that did not exit
    cleanly also leaves no extension-build lock its ranks made (`lifeline.remove_own_build_locks`).
    SIGKILL cannot be caught: then the launch dies by `lifeline` and the next runner cleans up."""

    def __init__(self, port, out_dir: str):
        self.proc, self.port, self.out_dir = None, port, out_dir   # proc: set once launched
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
        if self.proc is not None:
            kill_launch(self.proc)
        remove_shm_buffers(self.port)
        if self.proc is None or self.proc.returncode != 0:
            lifeline.remove_own_build_locks(self.out_dir)


def kill_launch(proc) -> None:
    """SIGKILL the launch's whole session (the launcher is its leader): the ranks, and the compilers of
    an extension build, which run in process groups of their own."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    lifeline.kill_session(proc.pid)
    proc.wait()


def launcher() -> list[str]:
    """DeepSpeed's launcher run by this interpreter (`deepspeed` is `deepspeed.launcher.runner.main`),
    so `validate run` finds it when started outside its virtual environment, and the launch's ranks
    (started with the launcher's sys.executable) use the same Python and packages."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


@dataclass(frozen=True)
class Nodes:
    """A job across nodes: DeepSpeed's hostfile ("host slots=N" a line), this node's index in it, and
    node 0's address and port, which every node's launch meets at. Each node runs its own `validate
    run` (DeepSpeed's launcher without ssh, `--no_ssh --node_rank`); node 0's writes the rows."""
    hostfile: str
    node_rank: int
    master_addr: str
    master_port: int
    slots: tuple[int, ...]        # ranks per node, in the hostfile's order

    @property
    def count(self) -> int:
        return len(self.slots)

    @property
    def leader(self) -> bool:
        return self.node_rank == 0


def read_hostfile(path: str) -> tuple[int, ...]:
    """The slots of each host in DeepSpeed's hostfile (`hostname slots=N` a line, # comments), as
    DeepSpeed's `fetch_hostfile` reads it; SetupError naming the line for one it would refuse."""
    slots, hosts = [], set()
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise SetupError(f"--hostfile {path}: {err.strerror or err}")
    for i, line in enumerate(lines, 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit() or parts[0] in hosts:
            raise SetupError(f"--hostfile {path}:{i}: {line!r}: write one `hostname slots=N` per node, each host once")
        hosts.add(parts[0])
        slots.append(int(parts[1][6:]))
    if not slots:
        raise SetupError(f"--hostfile {path}: no `hostname slots=N` line")
    return tuple(slots)


def launch_command(backend: str, nproc: int, jobs_path: str, out_dir: str, include: str | None,
                   port: int, nodes: Nodes | None = None) -> list[str]:
    cmd = launcher() + ["--master_port", str(port)]
    if nodes is not None:   # this node's share of the ranks, meeting node 0's at its address
        cmd += ["--hostfile", nodes.hostfile, "--no_ssh", "--node_rank", str(nodes.node_rank),
                "--master_addr", nodes.master_addr]
    else:
        cmd += ["--include", include] if include else ["--num_gpus", str(nproc)]
    return cmd + ["--module", "validate.worker", jobs_path, out_dir]


class SetupError(ValueError):
    """Nothing can be launched from this Python (DeepSpeed missing): one line, before any job."""


def check_launcher() -> None:
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        raise SetupError(f"DeepSpeed is not installed for {sys.executable}: install it there "
                         "(pip install deepspeed==0.19.8) or run validate with the Python that has it")


# Every VALIDATE_* variable the runner or its worker reads, and what it may hold: a tuple of values ("" where
# an empty value is read as unset), "dir" (the worker creates it), "steps" (`jobs.steps_override`), or None
# for the runner's own, which it sets for each launch (docs/validating.md).
ENV_KNOBS = {"VALIDATE_STEPS": "steps", "VALIDATE_FEW_STEPS": ("", "1"), "VALIDATE_ONE_JOB": ("", "0", "1"),
             "VALIDATE_SNAPSHOT_DIR": "dir", "VALIDATE_SNAPSHOT_SCOPE": ("step", "warmup", "job"),
             "VALIDATE_SNAPSHOT_STACKS": ("python", "all", "none"), "VALIDATE_PROFILE_DIR": "dir",
             "VALIDATE_PIN_CPUS": ("", "rank", "main"), "VALIDATE_PROTOCOL": ("", "concurrent"),
             "VALIDATE_FAKE_WORLD": None, "VALIDATE_FAKE_RANK": None, "VALIDATE_NODES": None, lifeline.RUNNER_ENV: None}
_SET_BY = {"VALIDATE_FAKE_WORLD": "--fake-world", "VALIDATE_FAKE_RANK": "--fake-rank", "VALIDATE_NODES": "--hostfile"}


def _env_problem(name: str, value: str) -> str | None:
    rule = ENV_KNOBS.get(name, "unknown")
    if rule == "unknown":
        return f"{name} is not a variable validate reads (it reads {', '.join(ENV_KNOBS)}): fix its name or unset it"
    if rule is None:
        return None if name == lifeline.RUNNER_ENV else f"{name} is set by `validate run {_SET_BY[name]}`: unset it"
    if rule == "steps":
        try:
            steps_override(value)
        except ValueError as err:
            return str(err)
    elif rule == "dir":
        parent = os.path.abspath(value)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if value and not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            return f"{name}={value!r}: {parent} is not a directory this user can write to; give another or unset it"
    elif value not in rule:
        return f"{name}={value!r}: give {' or '.join(repr(v) for v in rule if v)}, or unset it"
    return None


def check_env() -> None:
    """The VALIDATE_* variables, read before any launch: a value every worker would refuse or misread (a
    misspelt name is silently ignored) would otherwise cost a launch and a row per job."""
    for name in sorted(os.environ):
        problem = name.startswith("VALIDATE_") and _env_problem(name, os.environ[name])
        if problem:
            raise SetupError(problem)


def run(jobs: list[dict], backend: str, nproc: int, csv_path: str, timeout_s: float = 600,
        include: str | None = None, log=print, command: str | None = None, retry_failed: bool = False,
        nodes: Nodes | None = None) -> list[dict]:
    """Run every job not yet in csv_path; return the rows written. Raises ResultsFileError (one line)
    for an --out it cannot use, before any launch, or for a row it cannot write (the file keeps its
    whole rows: run the same command again to resume), SetupError without DeepSpeed or for a VALIDATE_*
    variable the worker would refuse, and LaunchError when two launches in a row start no job. Jobs
    marked `fake_world` (all or none) run as rank 0 (or all as `fake_rank`) of nproc ranks in one process
    (`validate.worker`).
    With `nodes`, this node's ranks of each job; a node other than 0 runs node 0's jobs, writes no row."""
    check_launcher()
    check_env()
    if nodes is not None and not nodes.leader:
        return _follow_leader(jobs, backend, nproc, timeout_s, log, command, nodes)
    results_file.check_output(csv_path)
    with results_file.OutputLock(csv_path):
        for d in lifeline.clean_orphans(shm_dir=SHM_DIR):
            log(f"removed {d}, left by a runner that is gone")
        dropped = results_file.drop_partial_row(csv_path)
        if dropped:
            log(f"dropped a half-written last row of {csv_path} ({len(dropped.encode())} bytes, "
                f"{dropped[:60]!r}...): its job runs again")
        return _run(jobs, backend, nproc, csv_path, timeout_s, include, log, command, retry_failed, nodes)


class RowWriteError(ResultsFileError):
    """A row the results file could not take (a full disk): the sweep stops, the file keeps its whole
    rows, and the same command resumes it."""


def _write(csv_path: str, row: dict, written: list) -> None:
    try:
        append_row(csv_path, row)
    except OSError as err:
        raise RowWriteError(f"could not write a row to {csv_path}: {err.strerror or err}; the file keeps its "
                               "whole rows: make room and run the same command again to resume") from err
    written.append(row)


def _launch_env(backend: str, fake_world: int = 0, nodes: Nodes | None = None, fake_rank: int = 0) -> dict:
    env = dict(os.environ)
    for name in ("VALIDATE_FAKE_WORLD", "VALIDATE_FAKE_RANK"):   # the launch's own, never inherited
        env.pop(name, None)
    if fake_world:
        env["VALIDATE_FAKE_WORLD"] = str(fake_world)
        env["VALIDATE_FAKE_RANK"] = str(fake_rank)
    if nodes is not None:
        env["VALIDATE_NODES"] = str(nodes.count)
    if backend == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[lifeline.RUNNER_ENV] = lifeline.identity()
    return env


def _run(jobs, backend, nproc, csv_path, timeout_s, include, log, command, retry_failed, nodes=None) -> list[dict]:
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    done = done_keys(csv_path, retry_failed)
    todo = [j for j in jobs if j["key"] not in done]
    skipped = len(jobs) - len(todo)
    if skipped:
        log(f"{skipped} of {len(jobs)} jobs already in {csv_path}; running the other {len(todo)}")
    written, total, t_start = [], len(todo), time.time()
    pending = []
    for j in todo:
        reason = rows.rejection(j, backend)
        if reason is None:
            pending.append(j)
            continue
        _write(csv_path, rows.rejected_row(j, reason, backend, command), written)
        log(f"[{len(written)}/{total}] {j['key']}: error, not launched: {reason}")
    # Stage-3 engines are not freed by DeepSpeed (the worker restarts after one): run them last.
    pending.sort(key=lambda j: j["stage"] == 3)
    fake = {bool(j.get("fake_world")) for j in jobs}
    if len(fake) > 1:
        raise SetupError("some jobs ask for a fake world and some do not: run them with separate commands")
    fake_ranks = {j.get("fake_rank", 0) for j in jobs}
    if len(fake_ranks) > 1:
        raise SetupError("the jobs ask for different fake ranks: run each rank's with its own command")
    env = _launch_env(backend, nproc if fake == {True} else 0, nodes, fake_ranks.pop() if jobs else 0)
    processes = 1 if fake == {True} else nproc
    causes = []   # of the launches in a row that started no job
    if nodes is not None and not pending:   # the other nodes' launches wait for one: an empty one ends them
        _launch([], backend, processes, csv_path, timeout_s, include, log, command, env, written, total, t_start, nodes)
    while pending:
        finished, cause = _launch(pending, backend, processes, csv_path, timeout_s, include, log, command, env,
                                  written, total, t_start, nodes)
        pending = [j for j in pending if j["key"] not in finished]
        causes = [] if finished else causes + [cause]
        _two_in_a_row(causes, len(pending))
    return written


class LaunchError(RuntimeError):
    """Launches that end before any job starts (an import, the process group, the environment): not the
    jobs' fault, so they get no row; the sweep stops, naming the cause, and the same command resumes it."""


def _two_in_a_row(causes: list, left: int) -> None:
    """LaunchError where the last two launches both ended before a job started."""
    if len(causes) == 2:
        same = re.sub(r"\d+", "N", causes[0]) == re.sub(r"\d+", "N", causes[1])
        raise LaunchError(f"two launches in a row ended before a job started{' the same way' if same else ''}: "
                          f"{causes[-1][:300]}; no row written for the {left} job{'s' * (left != 1)} "
                          "left: fix it and run the same command again")


def _follow_leader(jobs, backend, nproc, timeout_s, log, command, nodes) -> list[dict]:
    """A node other than 0: launch its ranks of node 0's jobs (the worker takes node 0's list) until node
    0 has none left, as node 0's runner decides it from the same launch: every job finished or lost
    (`_lost_row`); two launches in a row that start no job stop it as they stop node 0's. Writes no row;
    returns []."""
    env = _launch_env(backend, 0, nodes)
    pending, causes = jobs, []
    while True:
        seen = {"jobs": None}
        finished, cause = _launch(pending, backend, nproc, None, timeout_s, None, log, command, env, [], len(pending),
                                  time.time(), nodes, seen)
        pending = [j for j in (pending if seen["jobs"] is None else seen["jobs"]) if j["key"] not in finished]
        if not pending:
            return []
        causes = [] if finished else causes + [cause or "the launch ended before node 0's jobs reached this node"]
        _two_in_a_row(causes, len(pending))
        log(f"node {nodes.node_rank}: node 0 has {len(pending)} jobs left; launching again")


def _launch(pending, backend, nproc, csv_path, timeout_s, include, log, command, env, written, total,
            t_start, nodes=None, leader=None) -> tuple[set[str], str | None]:
    """One launch over the pending jobs, until it ends, hangs or loses a rank; every job it finished or
    lost has a row. Returns their keys, and why the launch ended before its next job started (None if
    it did not). On a node other than 0 (`leader` a dict whose "jobs" become node 0's jobs as this
    node's worker received them) no row is written."""
    tmp = None
    try:
        try:   # a full temp disk: one line, nothing left there
            tmp = tempfile.mkdtemp(prefix=lifeline.TEMP_PREFIX)
            jobs_path = os.path.join(tmp, "jobs.json")
            with open(jobs_path, "w") as f:
                json.dump([to_worker(j) for j in pending], f)
            port = nodes.master_port if nodes else _free_port()
            lifeline.write_owner(tmp, port)
        except OSError as err:
            raise LaunchError(f"could not write a launch's files in {tmp or tempfile.gettempdir()}: "
                              f"{err.strerror or err}; make room (or set TMPDIR) and run the same command again")
        cmd = launch_command(backend, nproc, jobs_path, tmp, include, port, **({"nodes": nodes} if nodes else {}))
        where = f" (node {nodes.node_rank}: {nodes.slots[nodes.node_rank]} of them, node 0 at {nodes.master_addr})" \
            if nodes else ""
        log(f"launching {len(pending)} jobs on {nproc} ranks{where}, master port {port}")
        by_key = {j["key"]: j for j in pending}
        follower = leader is not None
        finished, last_progress = set(), [time.time()]

        def collect():
            """Rows for the results the launch has written so far."""
            if follower:
                by_key.update(_leader_jobs(tmp, leader))
            for res in lifeline.read_lines(os.path.join(tmp, "results.jsonl")):
                if res["key"] in finished or res["key"] not in by_key:
                    continue
                if follower:
                    finished.add(res["key"])
                    last_progress[0] = time.time()
                    continue
                try:
                    row = rows.make_row(by_key[res["key"]], res, backend, command)
                except (KeyError, IndexError, TypeError, ValueError) as err:   # still one row for the job
                    row = rows.failed_row(by_key[res["key"]], "error", f"the worker's result could not be read: "
                                          f"{type(err).__name__}: {err}", backend, command)
                _write(csv_path, row, written)
                finished.add(res["key"])
                last_progress[0] = time.time()
                log(f"[{len(written)}/{total}] {res['key']}: {rows.describe(row)}  ({time.time() - t_start:.0f} s)")

        # The launch runs in its own session (a hang is killed as a group): if this driver is
        # interrupted, terminated or fails, take the launch and its shared memory down with it.
        with open(os.path.join(tmp, "launch.log"), "w") as logf, _Stop(port, tmp) as stop:
            proc = stop.proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=lifeline.die_with_parent())
            failed_rank, hung = _follow(proc, tmp, by_key, finished, collect, last_progress, timeout_s)
            collect()   # results that landed as the launch ended
            cause = _lost_row(tmp, leader["jobs"] or pending if follower else pending, by_key, finished, failed_rank,
                              hung, proc, backend, command, None if follower else csv_path, written, total, log)
        return finished, cause
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _leader_jobs(tmp: str, leader: dict) -> dict:
    """Node 0's jobs as this node's worker received them (`leader_jobs.json`, `validate.worker`), into
    leader["jobs"] once written; {key: job} of them."""
    path = os.path.join(tmp, "leader_jobs.json")
    if leader["jobs"] is None and os.path.exists(path):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                leader["jobs"] = json.load(f)
    return {j["key"]: j for j in leader["jobs"] or []}


def _follow(proc, tmp, by_key, finished, collect, last_progress, timeout_s) -> tuple[str | None, str | None]:
    """Write rows as the launch finishes jobs, until it exits, a rank's failure outlasts the grace
    period (the other ranks are blocked in one of the job's collectives: `lifeline.arrive`), or a job
    runs past the timeout; the launch is killed in the last two cases. Returns (the key of the job a
    rank failed, the key of the job that hung: "" where none had started), None where not so."""
    failure_seen = {}
    while True:
        code = proc.poll()
        collect()
        if code is not None:
            return None, None
        now = time.time()
        for key in lifeline.rank_failures(tmp):
            if key in by_key and key not in finished:
                failure_seen.setdefault(key, now)
        late = [k for k, t in failure_seen.items() if k not in finished and now - t > lifeline.RANK_FAILURE_GRACE_S]
        if late:
            kill_launch(proc)
            return late[0], None
        started = lifeline.read_lines(os.path.join(tmp, "started.jsonl"))
        running = [s for s in started if s["key"] not in finished]
        since = running[-1]["time"] if running else last_progress[0]
        if now - max(since, last_progress[0]) > timeout_s:
            kill_launch(proc)
            return None, (running[-1]["key"] if running else "")   # "": before any job started
        time.sleep(0.5)


def _lost_row(tmp, pending, by_key, finished, failed_rank, hung, proc, backend, command, csv_path, written,
              total, log) -> str | None:
    """The row of the job a launch lost (started and not finished), with the failing rank's traceback
    where one was recorded, else the launcher's last lines. The jobs after it are relaunched. A launch
    that ended before its next job started (at import, in the process group, between jobs) cost that
    job nothing: no row, it runs in the next launch; returns why the launch ended, else None."""
    started = [s["key"] for s in lifeline.read_lines(os.path.join(tmp, "started.jsonl"))]
    lost = [k for k in started if k not in finished and k in by_key]
    restarted = lifeline.read_lines(os.path.join(tmp, "restart.jsonl"))
    if failed_rank and failed_rank not in finished:
        lost = [failed_rank]
    elif restarted and not lost:
        log(f"fresh process for the remaining {len(pending) - len(finished)} jobs "
            "(the last engine left memory allocated, or was a Trainer's)")
        return None
    elif not lost and len(finished) < len(pending):
        cause = _launch_failure(tmp, stalled=hung == "")
        log(f"the launch ended (exit {proc.returncode}) before its {'next' if finished else 'first'} job started: "
            f"{cause[:300]}")
        return cause
    if not lost:
        return None
    key = lost[0]
    failures = lifeline.rank_failures(tmp)
    record = failures.get(key) or failures.get("")
    if key == hung:
        outcome = "timeout"
    elif record and record["key"] == key:
        outcome = record["outcome"]
    else:
        outcome = "crash"
    if record:
        text = lifeline.describe_failure(record)
    else:
        with open(os.path.join(tmp, "launch.log"), errors="replace") as f:
            text = f.read()[-2000:]
    finished.add(key)
    if csv_path is None:   # a node other than 0: node 0's runner writes the row
        log(f"{key}: {outcome} (launch exit {proc.returncode}); node 0 writes its row")
        return None
    row = rows.failed_row(by_key[key], outcome, text, backend, command)
    _write(csv_path, row, written)
    log(f"[{len(written)}/{total}] {key}: {outcome} (launch exit {proc.returncode}): {row['error'][:200]}; continuing")
    return None


def _launch_failure(tmp: str, stalled: bool) -> str:
    """Why a launch ended before a job started, in one line: a rank's recorded traceback, else the last
    exception the launcher's output names, else its last lines."""
    failures = lifeline.rank_failures(tmp)
    if failures:
        return lifeline.describe_failure(min(failures.values(), key=lambda r: r["time"]))
    with open(os.path.join(tmp, "launch.log"), errors="replace") as f:
        lines = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", ln)]
    why = errors[-1] if errors else " | ".join(lines[-3:]) or "no output"
    return f"no job started within the timeout ({why})" if stalled else why
