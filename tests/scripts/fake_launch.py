"""A stand-in for DeepSpeed's launcher and the validator's worker, for the runner's fault tests: no
torch, no DeepSpeed, a launch in well under a second.

`python fake_launch.py JOBS OUT_DIR NPROC` plays the launcher: it starts NPROC ranks in its own process
group and, as DeepSpeed's launch.py does, ends the others and exits with a rank's code when that rank
exits non-zero. Each rank does what the worker does around a job (lifeline.watch_runner at start,
started.jsonl from rank 0, lifeline.arrive before the gather, results.jsonl from rank 0), with the
gather done through files. What each job does is FAKE_PLAN (a JSON file {key: behaviour}):
  ok         every rank succeeds (the default)
  raise      rank 1 raises; rank 0 blocks in the job's collective (waits for rank 1 forever)
  raise_all  every rank raises (a config DeepSpeed refuses)
  die        rank 1 dies with os._exit(3), no traceback
  crash      rank 1 fails outside the job's try (its traceback recorded as the worker's __main__ does)
  sleep      every rank sleeps (a long job)
FAKE_LOG (a folder) gets each process's pid as LOG/pid-<name>, and one line per launch in LOG/launches.
FAKE_START makes a launch fail before any job, as a broken environment does: "raise", each rank raises
at start (its traceback recorded as the worker's __main__ does); "print", the launcher prints an
exception and exits 1 without starting a rank; "raise-once", only the first launch raises.
"""
import json
import os
import signal
import subprocess
import sys
import time
import traceback

from validate import lifeline


def _note_pid(name):
    log = os.environ.get("FAKE_LOG")
    if log:
        with open(os.path.join(log, f"pid-{name}.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(log, f"pid-{name}.tmp"), os.path.join(log, f"pid-{name}"))


def ok_result(rank):
    return {"outcome": "ok", "rank": rank, "losses": [2.0, 1.5], "comm": {}, "param_tensors": 1,
            "state": {"by_device": {"cpu": 1000 + rank}, "scalar_bytes": 0, "by_path": {}}}


def gather(out_dir, key, rank, world, result):
    """all_gather_object through files: every rank's result, in rank order."""
    with open(os.path.join(out_dir, f"gather-{key}-{rank}.json"), "w") as f:
        json.dump(result, f)
    paths = [os.path.join(out_dir, f"gather-{key}-{r}.json") for r in range(world)]
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)
    time.sleep(0.05)
    return [json.load(open(p)) for p in paths]


def rank_main(jobs_path, out_dir, rank, world):
    lifeline.watch_runner(out_dir=out_dir)
    start = os.environ.get("FAKE_START", "")
    if start == "raise" or (start == "raise-once" and
                            open(os.path.join(os.environ["FAKE_LOG"], "launches")).read().count("\n") == 1):
        try:
            raise ImportError(f"libfake.so: cannot open shared object file (rank {rank})")
        except ImportError:
            lifeline.record_crash(out_dir, rank, traceback.format_exc())
        sys.exit(1)
    plan = json.load(open(os.environ["FAKE_PLAN"])) if os.environ.get("FAKE_PLAN") else {}
    port = json.load(open(os.path.join(out_dir, lifeline.OWNER_FILE)))["port"]
    with open(os.path.join(lifeline.SHM_DIR, f"deepspeed_fake_127.0.0.1_{port}_{rank}"), "w") as f:
        f.write("x")   # as DeepSpeed's CPU all-reduce buffer
    _note_pid(f"rank{rank}")   # after the buffer: the test reads both once it sees the pid
    for job in json.load(open(jobs_path)):
        key, what = job["key"], plan.get(job["key"], "ok")
        if rank == 0:
            lifeline.append_line(os.path.join(out_dir, "started.jsonl"), {"key": key, "time": time.time()})
        if what == "sleep":
            time.sleep(120)
        if what == "die" and rank == 1:
            os._exit(3)
        if what == "crash" and rank == 1:   # an error outside a job, as the worker's __main__ records it
            try:
                raise ConnectionError("rank 1 lost its peer")
            except ConnectionError:
                lifeline.record_crash(out_dir, rank, traceback.format_exc())
            sys.exit(1)
        failure = ""
        result = ok_result(rank)
        if what == "raise_all" or (what == "raise" and rank == 1):
            try:
                raise ValueError(f"boom from rank {rank}")
            except ValueError as err:
                result = {"outcome": "error", "rank": rank, "error": f"{type(err).__name__}: {err}"}
                failure = traceback.format_exc()
        elif what == "raise":
            time.sleep(120)   # rank 0 in the job's collective, waiting for rank 1
        lifeline.arrive(out_dir, key, rank, world, result["outcome"], failure, poll_s=0.05)
        ranks = gather(out_dir, key, rank, world, result)
        if rank == 0:
            lifeline.append_line(os.path.join(out_dir, "results.jsonl"),
                                 {"key": key, "world_size": world, "ranks": ranks, "env": {}})


def launcher_main(jobs_path, out_dir, world):
    _note_pid("launcher")
    if os.environ.get("FAKE_LOG"):
        with open(os.path.join(os.environ["FAKE_LOG"], "launches"), "a") as f:
            f.write(f"{len(json.load(open(jobs_path)))} jobs\n")
    if os.environ.get("FAKE_START") == "print":
        print("[launch.py] starting ranks\nValueError: invalid literal for int() with base 10: 'abc'", flush=True)
        sys.exit(1)
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), jobs_path, out_dir, str(world)])
             for r in range(world)]
    alive = list(ranks)
    while alive:
        for p in list(alive):
            code = p.poll()
            if code is None:
                continue
            alive.remove(p)
            if code != 0:   # as launch.py: end the others, exit with the rank's code
                for q in alive:
                    q.send_signal(signal.SIGTERM)
                for q in alive:
                    q.wait()
                print(f"rank exited with return code = {code}", flush=True)
                sys.exit(code)
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[3], sys.argv[4], int(sys.argv[2]), int(sys.argv[5]))
    else:
        launcher_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
