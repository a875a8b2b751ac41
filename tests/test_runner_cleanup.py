"""The runner removes the shared-memory buffers DeepSpeed's CPU all-reduce leaves and the build locks a
failed launch's ranks created, and only its own;
it extends an older results file by a new column instead of refusing the row."""
import os

import pytest

from validate import runner


def test_only_this_launchs_buffers_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "SHM_DIR", str(tmp_path))
    names = ["deepspeed_allreduce_buffer_0_127.0.0.1_41013_0", "deepspeed_allreduce_buffer_0_127.0.0.1_41013_1",
             "deepspeed_allreduce_buffer_0_127.0.0.1_29500_0", "something_else_41013_0"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    runner.remove_shm_buffers(41013)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepspeed_allreduce_buffer_0_127.0.0.1_29500_0",
                                                           "something_else_41013_0"]


def test_a_terminated_driver_takes_its_launch_down(tmp_path):
    """`validate run` killed by SIGTERM (a time limit, a cancelled job) must not leave the launch running:
    it runs in a session of its own, so nothing else would stop it. A stand-in launch (two sleeps in one
    process group) replaces DeepSpeed's launcher."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "drive.py"
    script.write_text(textwrap.dedent(f"""
        from validate import runner
        from validate.jobs import make_job
        from zerocalc.arch import Architecture
        runner.launch_command = lambda *a, **k: ["sh", "-c", "echo $$ > {tmp_path}/pgid; sleep 60 & sleep 60"]
        job = make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 1, stage=0, seq_len=8)
        runner.run([job], "cpu", 1, "{tmp_path}/rows.csv", log=lambda *a: None)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, env={**os.environ, "PYTHONPATH": root})
    pgid_file = tmp_path / "pgid"
    deadline = time.time() + 30
    while not (pgid_file.exists() and pgid_file.read_text().strip()) and time.time() < deadline:
        time.sleep(0.1)
    pgid = int(pgid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    for _ in range(50):   # the killed sleeps are reaped by init
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launch's process group {pgid} is still alive")


def test_a_row_with_a_new_column_extends_an_older_file(tmp_path):
    """Resuming a sweep whose file predates a Setup field (expandable_segments): the file gains the
    column, its earlier rows read back with the field's default."""
    import csv

    from validate.rows import job_from_row
    from validate.runner import append_row, done_keys
    path = str(tmp_path / "old.csv")
    with open(path, "w", newline="") as f:
        f.write("key,outcome,stage\nA,ok,2\n")
    append_row(path, {"key": "B", "outcome": "ok", "stage": 3, "expandable_segments": True})
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert [(r["key"], r["stage"], r["expandable_segments"]) for r in got] == [("A", "2", ""), ("B", "3", "True")]
    assert done_keys(path) == {"A", "B"}
    assert not os.path.exists(path + ".tmp")
    # A committed row from before the column: absent or empty, it is the default (False).
    with open("data/h200-t2-repeat.csv", newline="") as f:
        committed = next(csv.DictReader(f))
    assert "expandable_segments" not in committed
    assert job_from_row(committed)["expandable_segments"] is False
    assert job_from_row({**committed, "expandable_segments": ""})["expandable_segments"] is False
    assert job_from_row({**committed, "expandable_segments": "True"})["expandable_segments"] is True


def test_a_failed_launch_leaves_no_build_lock_of_its_own(tmp_path, monkeypatch):
    """A rank that dies while it JIT-builds an extension leaves torch's build lock, on which every later
    launch would wait until its timeout. A stand-in launch creates a lock and records it as the worker
    does (`lifeline.note_build_lock`, called by the patched FileBaton), then fails, twice; a lock created
    during the launch by another process (another build in the shared cache, not recorded) and one
    made before the launch both stay."""
    import sys
    import time
    from validate.jobs import make_job
    from zerocalc.arch import Architecture
    ext = tmp_path / "torch_extensions"
    for name in ("deepspeed_shm_comm", "cpu_adam", "fused_adam"):
        (ext / "py311_cpu" / name).mkdir(parents=True)
    older = ext / "py311_cpu" / "cpu_adam" / "lock"
    older.write_text("")
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    new_lock = ext / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    others = ext / "py311_cpu" / "fused_adam" / "lock"

    def launch(backend, nproc, jobs_path, out_dir, include, port):
        code = (f"import os; from validate import lifeline; os.close(os.open({str(new_lock)!r}, os.O_CREAT | os.O_EXCL)); "
                f"lifeline.note_build_lock({out_dir!r}, {str(new_lock)!r}); "
                f"open({str(others)!r}, 'w').close(); raise SystemExit(1)")
        return [sys.executable, "-c", code]
    monkeypatch.setattr(runner, "launch_command", launch)
    job = make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 1, stage=0, seq_len=8)
    with pytest.raises(runner.LaunchError, match="two launches in a row ended before a job started"):
        runner.run([job], "cpu", 1, str(tmp_path / "rows.csv"), log=lambda *a: None)
    assert not (tmp_path / "rows.csv").exists()   # it failed before its job started: no row, a resume runs it
    assert not new_lock.exists()
    assert others.exists()
    assert older.exists()
