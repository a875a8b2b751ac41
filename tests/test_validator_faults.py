"""The validator under faults loses nothing: every job ends in exactly one whole row, and nothing the
runner started outlives it. The launches are stand-ins (tests/scripts/fake_launch.py: the launcher and
two ranks doing what the worker does around a job, without torch or DeepSpeed); what is under test is
the runner, the results file and the worker's lifeline (validate/lifeline.py), which the stand-in
ranks call as the worker does."""
import csv
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from validate import lifeline, report, results_file, runner
from validate.cli import main as validate_main
from validate.jobs import make_job
from zerocalc.arch import Architecture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "scripts", "fake_launch.py")
ARCH = Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False)


def jobs(n, **setup):
    return [make_job(ARCH, 2, stage=0, seq_len=8, micro_batch=i + 1, **setup) for i in range(n)]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Launches go to the stand-in; returns a function that sets the jobs' behaviours."""
    log = tmp_path / "log"
    log.mkdir()
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_PLAN", str(plan))
    monkeypatch.setattr(runner, "launch_command",
                        lambda backend, nproc, jobs_path, out_dir, include, port: [sys.executable, FAKE, jobs_path, out_dir, str(nproc)])
    monkeypatch.setattr(lifeline, "RANK_FAILURE_GRACE_S", 1.0)

    def set_plan(behaviours):
        plan.write_text(json.dumps(behaviours))
        return log
    return set_plan


def file_rows(path):
    """The file's rows, checking that every line is a whole row of the header's width."""
    with open(path, newline="") as f:
        text = f.read()
    assert text.endswith("\n")
    table = list(csv.reader(text.splitlines()))
    assert all(len(r) == len(table[0]) for r in table), "a row of the wrong width"
    return [dict(zip(table[0], r)) for r in table[1:]]


def alive(pid):
    return lifeline.process_start(pid) is not None


def wait_gone(pids, seconds=10):
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# --- whole rows ---------------------------------------------------------------------------------------

def test_a_failing_write_leaves_whole_rows_and_the_resume_runs_the_job_once(tmp_path, fake, monkeypatch):
    """The disk fills while the second row is written: half of it reaches the file, then ENOSPC. The
    runner cuts the file back to its whole rows and stops with a one-line error; once there is room,
    the same call writes the second and third rows, each key once."""
    fake({})
    out = str(tmp_path / "rows.csv")
    todo = jobs(3)
    real, calls = results_file._write_all, []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            os.write(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)
    monkeypatch.setattr(results_file, "_write_all", full_disk)
    with pytest.raises(runner.RowWriteError, match="No space left on device"):
        runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    assert [r["key"] for r in file_rows(out)] == [todo[0]["key"]]
    monkeypatch.setattr(results_file, "_write_all", real)
    written = runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    assert [r["key"] for r in written] == [todo[1]["key"], todo[2]["key"]]
    assert sorted(r["key"] for r in file_rows(out)) == sorted(j["key"] for j in todo)
    assert {r["outcome"] for r in file_rows(out)} == {"ok"}


def test_a_full_disk_while_a_column_is_added_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """A row with a column the file lacks rewrites the file through OUT.tmp: if the disk fills then, the
    file keeps its rows and header and no OUT.tmp is left beside it."""
    from validate.rows import rejected_row
    out = str(tmp_path / "rows.csv")
    job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 1, stage=0, seq_len=8, micro_batch=1)
    results_file.append_row(out, rejected_row(job, "first", "cpu", "test"))
    before = open(out).read()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(results_file.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        results_file.append_row(out, {**rejected_row(job, "second", "cpu", "test"), "a_new_column": 1})
    assert open(out).read() == before and not os.path.exists(out + ".tmp")


def test_a_half_row_is_skipped_by_report_and_dropped_on_resume(tmp_path, fake):
    """A sweep killed mid-write leaves a half row at the end: `validate report` reads the whole rows and
    says it skipped one (no ParserError); the resume cuts it off before appending, so the next row
    starts on its own line, and runs its job again."""
    fake({})
    out = str(tmp_path / "rows.csv")
    todo = jobs(2)
    runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    with open(out) as f:
        text = f.read()
    cut = text.rindex("\n", 0, len(text) - 1) + 1 + 70      # 70 characters into the last row
    with open(out, "w") as f:
        f.write(text[:cut])
    df, notes = report.read_results(out)
    assert list(df["key"]) == [todo[0]["key"]]
    assert len(notes) == 1 and "half-written last row" in notes[0]
    result = CliRunner().invoke(validate_main, ["report", out])
    assert result.exit_code == 0, result.output
    assert "half-written last row" in result.output
    logged = []
    written = runner.run(todo, "cpu", 2, out, log=logged.append)
    assert [r["key"] for r in written] == [todo[1]["key"]]
    assert any("dropped a half-written last row" in m for m in logged)
    assert [r["key"] for r in file_rows(out)] == [j["key"] for j in todo]


def test_a_row_written_onto_a_half_row_is_skipped_not_a_parser_error(tmp_path):
    """A file an older validator damaged: a half row, then a whole row appended onto it (one line too
    wide). The report skips that line and names it; the rows around it are read."""
    from validate.rows import COLUMNS, rejected_row
    job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 1, stage=0, seq_len=8, micro_batch=1)
    row = {k: results_file.render(list(COLUMNS), [{**rejected_row(job, "a reason", "cpu", "test"), "key": k}])
           for k in "ABCD"}
    path = tmp_path / "old.csv"
    path.write_text(results_file.render(list(COLUMNS), [], with_header=True) + row["A"] + row["B"][:20] + row["C"]
                    + row["D"])
    df, notes = report.read_results(str(path))
    assert list(df["key"]) == ["A", "D"]
    assert len(notes) == 1 and "field count" in notes[0]
    assert results_file.done_keys(str(path)) == {"A", "D"}   # B and C run again on a resume


# --- every job ends in a row --------------------------------------------------------------------------

def test_rejected_jobs_are_error_rows_and_the_sweep_goes_on(tmp_path, fake):
    """A job zerocalc rejects (reduce_bucket_size 0) is not launched: an error row with the reason. A
    job every rank fails (as when DeepSpeed refuses its config) is an error row from the gather, in the
    same launch. The good jobs run; a resume runs nothing and does not stop on either."""
    todo = jobs(3)
    zero_bucket = make_job(ARCH, 2, stage=0, seq_len=8, reduce_bucket_size=0)
    log = fake({todo[1]["key"]: "raise_all"})
    out = str(tmp_path / "rows.csv")
    written = runner.run([todo[0], zero_bucket, todo[1], todo[2]], "cpu", 2, out, log=lambda *a: None)
    by_key = {r["key"]: r for r in file_rows(out)}
    assert len(by_key) == 4 == len(written)
    assert by_key[zero_bucket["key"]]["outcome"] == "error"
    assert "reduce_bucket_size must be a positive integer" in by_key[zero_bucket["key"]]["error"]
    assert by_key[todo[1]["key"]]["outcome"] == "error"
    assert "ValueError: boom from rank 0" in by_key[todo[1]["key"]]["error"]
    assert by_key[todo[0]["key"]]["outcome"] == by_key[todo[2]["key"]]["outcome"] == "ok"
    assert (log / "launches").read_text() == "3 jobs\n"      # the rejected job was not launched
    assert runner.run([todo[0], zero_bucket, todo[1], todo[2]], "cpu", 2, out, log=lambda *a: None) == []
    assert len(file_rows(out)) == 4


def test_a_rank_that_raises_ends_its_job_promptly_with_its_traceback(tmp_path, fake):
    """Rank 1 raises while rank 0 is blocked in the job's collective: rank 1 records its traceback and
    waits outside any collective; the runner ends the launch after the grace period (1 s here, not the
    600 s timeout) and writes rank 1's exception and where it was raised; the next job runs in a
    fresh launch."""
    todo = jobs(2)
    log = fake({todo[0]["key"]: "raise"})
    out = str(tmp_path / "rows.csv")
    t0 = time.time()
    runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    took = time.time() - t0
    rows_ = file_rows(out)
    assert [r["key"] for r in rows_] == [todo[0]["key"], todo[1]["key"]]
    assert rows_[0]["outcome"] == "error"
    assert rows_[0]["error"].startswith("rank 1: ")
    assert "ValueError: boom from rank 1" in rows_[0]["error"] and "fake_launch.py" in rows_[0]["error"]
    assert rows_[1]["outcome"] == "ok"
    assert (log / "launches").read_text() == "2 jobs\n1 jobs\n"
    assert took < 30, took
    assert not wait_gone([int((log / f"pid-{n}").read_text()) for n in ("launcher", "rank0", "rank1")], 5)


def test_a_rank_that_dies_ends_its_job_with_a_crash_row(tmp_path, fake):
    """Rank 1 dies without a word (os._exit, as a segfault or the OOM killer): the launcher ends the
    other rank and exits; the job's row is a crash with the launcher's last lines, the next job runs."""
    todo = jobs(2)
    fake({todo[0]["key"]: "die"})
    out = str(tmp_path / "rows.csv")
    runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    rows_ = file_rows(out)
    assert [(r["key"], r["outcome"]) for r in rows_] == [(todo[0]["key"], "crash"), (todo[1]["key"], "ok")]
    assert "return code = 3" in rows_[0]["error"]


def test_a_rank_that_fails_outside_a_job_gives_its_traceback_to_the_crash_row(tmp_path, fake):
    """Rank 1 fails where the worker catches nothing (between jobs, in a gather): the worker's __main__
    records its traceback before dying, and the crash row carries it instead of the launcher's lines."""
    todo = jobs(2)
    fake({todo[0]["key"]: "crash"})
    out = str(tmp_path / "rows.csv")
    runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    rows_ = file_rows(out)
    assert [(r["key"], r["outcome"]) for r in rows_] == [(todo[0]["key"], "crash"), (todo[1]["key"], "ok")]
    assert rows_[0]["error"].startswith("rank 1: ") and rows_[0]["error"].endswith("ConnectionError: rank 1 lost its peer")


def test_a_result_the_runner_cannot_read_is_still_a_row(tmp_path, fake, monkeypatch):
    """A worker result the row cannot be made from (a field missing) is an error row, not a runner crash."""
    todo = jobs(2)
    fake({})
    real = runner.rows.make_row
    monkeypatch.setattr(runner.rows, "make_row", lambda job, res, *a: real(job, res, *a) if job["key"] != todo[0]["key"]
                        else real(job, {**res, "ranks": [{"outcome": "ok"}]}, *a))
    out = str(tmp_path / "rows.csv")
    runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    rows_ = file_rows(out)
    assert [(r["key"], r["outcome"]) for r in rows_] == [(todo[0]["key"], "error"), (todo[1]["key"], "ok")]
    assert "the worker's result could not be read: KeyError" in rows_[0]["error"]


# --- nothing outlives the runner; one runner per file -------------------------------------------------

DRIVER = textwrap.dedent("""
    import sys
    from validate import runner
    from validate.jobs import make_job
    from zerocalc.arch import Architecture
    runner.launch_command = lambda b, n, jobs_path, out_dir, i, p: [sys.executable, {fake!r}, jobs_path, out_dir, str(n)]
    todo = [make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 2, stage=0, seq_len=8, micro_batch=1)]
    runner.run(todo, "cpu", 2, {out!r}, log=lambda *a: None)
""")


def test_sigkill_of_the_runner_leaves_no_process_and_a_second_runner_is_refused(tmp_path, fake):
    """Runner A (a subprocess) runs a long job. Runner B on the same --out is refused, naming A, before
    any launch. A is killed with SIGKILL: its launcher and both ranks die within seconds (the launcher
    by PR_SET_PDEATHSIG, the ranks by their watch of the runner, which also removes the launch's temp
    folder and shared-memory buffers). Then B takes the stale lock and runs the job: one row."""
    out = str(tmp_path / "rows.csv")
    todo = jobs(1)
    log = fake({todo[0]["key"]: "sleep"})
    script = tmp_path / "drive.py"
    script.write_text(DRIVER.format(fake=FAKE, out=out))
    a = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    names = ("launcher", "rank0", "rank1")
    deadline = time.time() + 60
    while not all((log / f"pid-{n}").exists() for n in names) and time.time() < deadline:
        time.sleep(0.1)
    pids = [int((log / f"pid-{n}").read_text()) for n in names]
    temp = [d for d in os.listdir(lifeline.tempfile.gettempdir()) if d.startswith(lifeline.TEMP_PREFIX)
            and (lifeline.read_owner(os.path.join(lifeline.tempfile.gettempdir(), d)) or {}).get("runner", "").startswith(f"{a.pid}:")]
    assert len(temp) == 1
    port = lifeline.read_owner(os.path.join(lifeline.tempfile.gettempdir(), temp[0]))["port"]
    buffers = [os.path.join(lifeline.SHM_DIR, f"deepspeed_fake_127.0.0.1_{port}_{r}") for r in (0, 1)]
    assert all(os.path.exists(b) for b in buffers)

    with pytest.raises(results_file.ResultsFileError, match=f"another `validate run` \\(pid {a.pid}\\)"):
        runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    assert (log / "launches").read_text() == "1 jobs\n"        # B launched nothing

    a.send_signal(signal.SIGKILL)
    a.wait()
    assert wait_gone(pids) == []
    assert not os.path.exists(os.path.join(lifeline.tempfile.gettempdir(), temp[0]))
    assert not any(os.path.exists(b) for b in buffers)

    fake({})
    written = runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    assert [r["outcome"] for r in written] == ["ok"]
    assert [r["key"] for r in file_rows(out)] == [todo[0]["key"]]
    assert not os.path.exists(out + ".lock")


def test_a_dead_runners_leftovers_are_removed_by_the_next(tmp_path, monkeypatch):
    """What a launch leaves when even its ranks could not clean up (killed together with the runner):
    the next runner removes the temp folder, the shared-memory buffers and the build locks it recorded,
    and leaves a live runner's folder alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(lifeline.tempfile, "gettempdir", lambda: str(tmp_path))
    shm = tmp_path / "shm"
    shm.mkdir()
    dead, live = tmp_path / (lifeline.TEMP_PREFIX + "dead"), tmp_path / (lifeline.TEMP_PREFIX + "live")
    dead.mkdir()
    live.mkdir()
    (dead / lifeline.OWNER_FILE).write_text(json.dumps({"runner": f"{gone.pid}::{gone.pid}", "port": 41013}))
    (live / lifeline.OWNER_FILE).write_text(json.dumps({"runner": lifeline.identity(), "port": 41014}))
    (shm / "deepspeed_allreduce_buffer_0_127.0.0.1_41013_0").write_text("x")
    (shm / "deepspeed_allreduce_buffer_0_127.0.0.1_41014_0").write_text("x")
    lock = tmp_path / "lock"
    lock.write_text("")
    lifeline.note_build_lock(str(dead), str(lock))
    assert lifeline.clean_orphans(shm_dir=str(shm)) == [str(dead)]
    assert not dead.exists() and live.exists() and not lock.exists()
    assert [p.name for p in shm.iterdir()] == ["deepspeed_allreduce_buffer_0_127.0.0.1_41014_0"]


def test_worker_records_the_build_locks_torchs_filebaton_creates(tmp_path):
    """The worker's patch of torch's FileBaton notes the locks it creates (and not those it waits on),
    so a failed launch removes only its own."""
    import importlib.util
    torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)   # torch's own file, without importing torch
    spec = importlib.util.spec_from_file_location("file_baton", os.path.join(torch_dir, "utils", "file_baton.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lifeline.record_build_locks(str(tmp_path), module.FileBaton)
    mine, other = module.FileBaton(str(tmp_path / "a.lock")), module.FileBaton(str(tmp_path / "a.lock"))
    assert mine.try_acquire() and not other.try_acquire()
    os.close(mine.fd)
    assert lifeline.remove_own_build_locks(str(tmp_path)) == [str(tmp_path / "a.lock")]


# --- the output and the matrix, checked before any launch ----------------------------------------------

def _no_launch(*a, **k):
    raise AssertionError("launched")


@pytest.mark.parametrize("case", ["missing dir", "foreign csv", "doubled column", "read-only dir", "matrix typo"])
def test_bad_output_or_matrix_is_a_one_line_error_before_any_launch(tmp_path, monkeypatch, case):
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    args = ["run", "--backend", "cpu", "--nproc", "1", "--stages", "0", "--hidden-size", "32", "--num-layers", "1",
            "--vocab-size", "64", "--seq-len", "8"]
    out = tmp_path / "rows.csv"
    if case == "missing dir":
        out, expect = tmp_path / "nope" / "rows.csv", "does not exist"
    elif case == "foreign csv":
        out.write_text("name,score\nx,1\n")
        expect = "not a validator results file"
    elif case == "doubled column":   # which value a reader took would depend on the reader
        out.write_text("key,outcome,stage,stage\nA,ok,0,1\n")
        expect = "column 'stage' appears twice in its header"
    elif case == "read-only dir":
        monkeypatch.setattr(results_file.os, "access", lambda p, mode: False)
        expect = "not writable"
    else:
        matrix = tmp_path / "m.json"
        matrix.write_text(json.dumps({"nproc": 1, "architectures": [{"vocab_size": 64, "hidden_size": 32,
                                      "num_layers": 1, "num_heads": 4}], "axes": {"stages": [0, 1]}}))
        args += ["--matrix", str(matrix)]
        expect = "unknown key 'stages' in axes; valid keys: "
    result = CliRunner().invoke(validate_main, args + ["--out", str(out)])
    assert result.exit_code == 2, result.output
    assert expect in result.output and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    if case in ("foreign csv", "doubled column"):
        assert out.read_text() in ("name,score\nx,1\n", "key,outcome,stage,stage\nA,ok,0,1\n")


A = {"vocab_size": 64, "hidden_size": 32, "num_layers": 1, "num_heads": 4}


@pytest.mark.parametrize("text, says", [
    ('{"nproc": 1, "nproc": 2, "architectures": []}', "not a readable JSON matrix (the key 'nproc' is given twice "
                                                      "in one object)"),   # json kept the last one silently
    ("[" * 100_000 + "]" * 100_000, "not a readable JSON matrix (nested too deeply)"),   # a RecursionError
    ({"nproc": 1, "architectures": [A], "axes": {"micro_batch": ["2"]}}, 'axes: micro_batch must be a whole number, '
                                                                         'got "2"'),   # each job an error row
    ({"nproc": 1, "architectures": [A], "axes": {"activation_checkpointing": ["yes"]}},
     'axes: activation_checkpointing must be true or false, got "yes"'),   # launched, read as true
    ({"nproc": 1, "architectures": [A], "axes": {"seq_len": [None]}}, "axes: seq_len must be a whole number, got "
                                                                      "null"),   # launched, failed in each job
    ({"nproc": 1, "architectures": [{**A, "hidden_size": 32.0}]}, "architectures[0]: hidden_size must be a whole "
                                                                  "number, got 32.0"),
    ({"nproc": 1, "hf_models": [{"config": "qwen3-0.6b"}], "hf_axes": {"stage": 3}},
     "axis 'stage' of hf_axes must be a non-empty list, got 3"),   # a TypeError
    ({"nproc": 1, "architectures": []}, "no jobs: give architectures (with axes), jobs or hf_models")],   # exit 0
    ids=["repeated key", "nested", "text count", "text flag", "null length", "float size", "axis not a list", "empty"])
def test_a_matrix_of_the_wrong_shape_is_one_error_line_before_any_launch(tmp_path, monkeypatch, text, says):
    """A matrix whose values are not of their key's kind is refused as a misspelt key is (exit 2, one
    line naming the key), not launched, nor written as a row per job."""
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    matrix, out = tmp_path / "m.json", tmp_path / "rows.csv"
    matrix.write_text(text if isinstance(text, str) else json.dumps(text))
    result = CliRunner().invoke(validate_main, ["run", "--backend", "cpu", "--nproc", "1", "--matrix", str(matrix),
                                                "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output == f"Error: {matrix}: {says}\n" and not out.exists()


@pytest.mark.parametrize("flag, content, says", [
    ("--hf-config", b"[" * 100_000 + b"]" * 100_000, "not a readable config.json (nested too deeply)"),
    ("--hf-config", b'{"model_type": "llama", "hidden_size": "64"}',
     "transformers refuses this llama config: "),
    ("--trainer-ds-config", b"[1]", "not a ds_config (a JSON object, its zero_optimization an object)"),
    ("--trainer-ds-config", b"", "not a readable ds_config (JSONDecodeError: Expecting value")],
    ids=["nested config", "text size", "ds list", "ds empty"])
def test_a_malformed_hf_config_or_ds_config_is_one_error_line(tmp_path, monkeypatch, flag, content, says):
    """--hf-config and --trainer-ds-config files that are not what they say (each traced back: a
    RecursionError, transformers' own validation error, an AttributeError, a JSONDecodeError)."""
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    given = tmp_path / "given.json"
    given.write_bytes(content)
    args = ["run", "--backend", "cpu", "--nproc", "1", "--hf-layers", "1", "--out", str(tmp_path / "rows.csv")]
    args += ["--hf-config", str(given)] if flag == "--hf-config" else [
        "--hf-config", "validate/hf_configs/qwen3-0.6b.json", "--trainer-ds-config", str(given)]
    result = CliRunner().invoke(validate_main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.count("\n") == 1 and says in result.output, result.output


def test_a_fake_world_of_trainer_jobs_is_refused_before_any_launch(tmp_path, monkeypatch):
    """HF Trainer's path sets up its own distributed state: not run as rank 0 of a fake world."""
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    result = CliRunner().invoke(validate_main, [
        "run", "--backend", "cpu", "--nproc", "8", "--fake-world", "--hf-config", "validate/hf_configs/qwen3-0.6b.json",
        "--trainer-ds-config", "zero2-auto", "--out", str(tmp_path / "rows.csv")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith("Error: --fake-world runs DeepSpeed's engine directly")
    assert not (tmp_path / "rows.csv").exists()


def test_fake_world_jobs_are_their_own_configurations():
    """A fake row never resumes or stands for a real one: its key says fake and hashes the flag."""
    from validate.jobs import with_fake_world
    job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 8, stage=3, seq_len=8, micro_batch=1)
    fake = with_fake_world(job)
    assert fake["key"] != job["key"] and "-n8fake-" in fake["key"] and "-n8-" in job["key"]
    assert fake["fake_world"] is True and "fake_world" not in job


@pytest.mark.parametrize("content", ["header", "failed job"])
def test_fit_on_rows_without_a_gpu_measurement_is_a_one_line_error(tmp_path, content):
    """A header alone, or only a job that failed (as CPU rows, they hold no device peak): nothing to fit."""
    from validate.rows import COLUMNS, rejected_row
    out = tmp_path / "rows.csv"
    if content == "header":
        out.write_text(",".join(COLUMNS) + "\n")
    else:
        job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 1, stage=0, seq_len=8, micro_batch=1)
        results_file.append_row(str(out), rejected_row(job, "an injected reason", "cpu", "test"))
    cal = tmp_path / "cal.json"
    result = CliRunner().invoke(validate_main, ["fit", str(out), "--out", str(cal)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith("Error: no GPU row with a measured peak in ") and result.output.count("\n") == 1
    assert not cal.exists()


def _gpt_row(held_out: bool) -> dict:
    """An ok H200 row of data/h200-n1-gpt.csv whose configuration is (or is not) in the held-out split."""
    from validate.fit import held_out as is_held_out
    with open(os.path.join(ROOT, "data", "h200-n1-gpt.csv"), newline="") as f:
        return next(r for r in csv.DictReader(f) if r["outcome"] == "ok" and is_held_out(r) == held_out)


def test_fit_on_held_out_rows_only_is_one_error_line(tmp_path):
    """GPU rows, but every one of a configuration the fit never sees (the held-out quarter): nothing to
    fit on, said in one line, nothing written (it raised a TypeError in the allocator fit)."""
    out, cal = tmp_path / "rows.csv", tmp_path / "cal.json"
    results_file.append_row(str(out), _gpt_row(held_out=True))
    result = CliRunner().invoke(validate_main, ["fit", str(out), "--out", str(cal)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output == (f"Error: the 1 GPU rows in {out} are all of held-out configurations (`fit.held_out`, "
                             "a quarter of them, never fitted): give more rows; nothing written\n")
    assert not cal.exists()


def test_fit_says_what_it_kept_and_a_full_disk_keeps_the_old_calibration(tmp_path, monkeypatch):
    """One training row: the device context is fitted, every other constant kept (and said so). Written
    whole: a disk that fills while it is written leaves the old calibration and no .tmp (exit 1)."""
    out, cal = tmp_path / "rows.csv", tmp_path / "cal.json"
    results_file.append_row(str(out), _gpt_row(held_out=False))
    cal.write_text("old")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(results_file.os, "fsync", full)
        result = CliRunner().invoke(validate_main, ["fit", str(out), "--out", str(cal)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.endswith(f"Error: could not write {cal}: No space left on device; it is as it was before\n")
    assert cal.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["cal.json", "rows.csv"]
    result = CliRunner().invoke(validate_main, ["fit", str(out), "--out", str(cal)])
    assert result.exit_code == 0, result.output
    assert ("too few rows to fit, kept as they were: activations.hf-llama, allocator_param_offload, allocator, "
            "allocator_simulated, allocator_expandable, time\n") in result.output
    assert json.loads(cal.read_text())["device"]["gpu"] == "NVIDIA H200"


@pytest.mark.parametrize("content", [b"", b"not a pickle", b"\x80\x04K\x01."])   # the last: pickled 1
def test_snapshot_of_a_file_that_is_not_one_is_one_line_and_writes_nothing(tmp_path, content):
    """`validate snapshot --compact-to DIR`: a file that is not an allocator history is one Error line,
    and no empty or half .json.gz is left in DIR (it was opened before the input was read)."""
    path = tmp_path / "s.pickle"
    path.write_bytes(content)
    result = CliRunner().invoke(validate_main, ["snapshot", str(path), "--compact-to", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"Error: {path} is not a torch memory snapshot written by the worker (")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def _ok_row(**edits) -> dict:
    """A CPU row as the runner writes an ok job's (the measured columns a report reads filled), edited."""
    from validate.rows import rejected_row
    job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 1, stage=0, seq_len=8, micro_batch=1)
    row = rejected_row(job, "", "cpu", "test")
    row.update(outcome="ok", measured_state_bytes=1000, measured_comm_bytes=0, predicted_state_bytes=123)
    return {**row, **edits}


@pytest.mark.parametrize("column, value, says", [
    ("outcome", "7", "line 2, column outcome: '7' is not one of ok, oom, error, crash, timeout"),
    ("stage", "two", "line 2, column stage: 'two' is not a number"),
    ("predicted_state_bytes", "lots", "line 2, column predicted_state_bytes: 'lots' is not a number"),
    ("nproc", "1.5", "line 2, column nproc: '1.5' is not a whole number"),
    ("measured_state_bytes", "inf", "line 2, column measured_state_bytes: 'inf' is not a number"),
    ("measured_state_bytes", "", "line 2, column measured_state_bytes: empty on an ok row"),
    ("key", "", "line 2, column key: empty"),
    ("activation_checkpointing", "maybe", "line 2, column activation_checkpointing: 'maybe' is not True or False"),
    ("optimizer", "lion", "line 2, column optimizer: 'lion' is not one of adam, adamw, sgd, sgd-momentum"),
    ("measured_step_times_s", "[0.1,", "line 2, column measured_step_times_s: '[0.1,' is not JSON"),
    ("losses", '["x"]', "line 2, column losses: '[\"x\"]' is not a list of numbers"),
    # a value of the right kind that zerocalc refuses: its own words name the field
    ("stage", "9", "line 2: stage must be 0, 1, 2 or 3, got 9"),
    ("dtype", "fp8", "line 2: dtype must be one of fp32, fp16, bf16, got 'fp8'"),
    ("micro_batch", "0", "line 2: micro_batch must be a positive integer, got 0")])
def test_report_on_a_hand_edited_row_names_it(tmp_path, column, value, says):
    """A results file edited by hand or by another tool: one Error line naming the file, the line and the
    column, before any table is printed (exit 2)."""
    out = tmp_path / "rows.csv"
    results_file.append_row(str(out), _ok_row(**{column: value}))
    result = CliRunner().invoke(validate_main, ["report", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output == f"Error: {out}, {says}\n"


@pytest.mark.parametrize("value, says", [
    ("{}", "empty on an ok row of an HF config"),   # an AttributeError in the markdown tables
    ('{"trace": []}', "not what a run records (KeyError: 'param_numels')")])   # a KeyError
def test_report_on_an_hf_row_without_its_recorded_model_names_it(tmp_path, value, says):
    """An HF config's row is predicted from the model its run recorded (hf_spec): one edited away is
    named like any other column."""
    with open(os.path.join(ROOT, "data", "h200-hf-time-a.csv"), newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["outcome"] == "ok")
    out = tmp_path / "rows.csv"
    results_file.append_row(str(out), {**row, "hf_spec": value})
    result = CliRunner().invoke(validate_main, ["report", "--markdown", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output == f"Error: {out}, line 2, column hf_spec: {says}\n"


def _joined(tmp_path):
    """Two results files joined with `cat`: the second header is line 3."""
    one = tmp_path / "one.csv"
    results_file.append_row(str(one), _ok_row())
    return one.read_text() * 2


@pytest.mark.parametrize("command", ["report", "fit", "crossval", "host"])
@pytest.mark.parametrize("content, says", [
    (b"", "{f} has no header line: not a validator results file"),
    (bytes(range(256)), "{f} is not a validator results file (not UTF-8 text at byte 128)"),
    (b"name,score\nx,1\n", "{f} is not a validator results file (its header starts 'name,score')"),
    (b"key,outcome,stage\nA,ok,0\n", "{f}: no column 'backend', which every results file has (key, outcome, "
                                      "backend, nproc, stage, optimizer, family, vocab_size, hidden_size, num_layers, "
                                      "num_heads, num_kv_heads, ffn_hidden_size, tie_embeddings)"),
    (b"key,outcome,key\nA,ok,B\n", "{f}, line 1: column 'key' appears twice in the header"),
    (_joined, "{f}, line 3 repeats the header line (files joined end to end?): remove it")])
def test_a_file_no_validator_wrote_is_one_error_line_for_every_reader(tmp_path, command, content, says):
    """Whatever reads results files (report, fit, crossval, host) reads them through one check: an empty
    or binary file, someone else's CSV, a missing or doubled column, two files joined end to end."""
    path = tmp_path / "rows.csv"
    path.write_bytes(content(tmp_path).encode() if callable(content) else content)
    args = [command, str(path)] + (["--out", str(tmp_path / "cal.json")] if command == "fit" else [])
    result = CliRunner().invoke(validate_main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output == "Error: " + says.format(f=path) + "\n"
    assert not (tmp_path / "cal.json").exists()


def test_one_runner_per_file_through_any_link(tmp_path, monkeypatch):
    """Two runners given one results file by two names (a symbolic link) take one lock: the second is
    refused rather than appending the same rows."""
    real = tmp_path / "rows.csv"
    link = tmp_path / "alias.csv"
    link.symlink_to(real)
    with results_file.OutputLock(str(real)):
        with pytest.raises(results_file.ResultsFileError, match="another `validate run`"):
            with results_file.OutputLock(str(link)):
                pass
    with results_file.OutputLock(str(link)):   # released: taken again through the link
        pass
    monkeypatch.chdir(tmp_path)
    with results_file.OutputLock("./rows.csv"):   # a relative name and an absolute one: one lock
        with pytest.raises(results_file.ResultsFileError, match="another `validate run`"):
            with results_file.OutputLock(str(real)):
                pass


def test_a_row_through_a_link_lands_in_the_linked_file(tmp_path):
    """A row with a column the file lacks rewrites the file: through a link, the file the link names is
    rewritten and the link stays a link (it was replaced by a copy, the row missing from the real file)."""
    real, link = tmp_path / "rows.csv", tmp_path / "alias.csv"
    results_file.append_row(str(real), _ok_row(key="A"))
    link.symlink_to(real)
    results_file.append_row(str(link), {**_ok_row(key="B"), "a_new_column": 1})
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert [(r["key"], r["a_new_column"]) for r in file_rows(str(real))] == [("A", ""), ("B", "1")]
    assert sorted(os.listdir(tmp_path)) == ["alias.csv", "rows.csv"]   # no rows.csv.tmp


def test_a_whole_file_write_that_fails_leaves_the_old_file_and_no_tmp(tmp_path, monkeypatch):
    """What the validator writes whole (a results file given a column, the calibration, the documents,
    a compacted snapshot) goes through `<path>.tmp` and a rename: a full disk leaves the old file."""
    path = tmp_path / "cal.json"
    path.write_text("old")
    path.chmod(0o640)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(results_file.os, "fsync", full)
        with pytest.raises(OSError, match="No space left"):
            results_file.replace_whole(str(path), b"new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["cal.json"]
    results_file.replace_whole(str(path), b"new")
    assert path.read_text() == "new" and (path.stat().st_mode & 0o777) == 0o640   # its mode kept


@pytest.mark.parametrize("name, value, says", [
    ("VALIDATE_STEPS", "2,x,1", "VALIDATE_STEPS='2,x,1': give three whole numbers W,P,T"),
    ("VALIDATE_SNAPSHOT_SCOPE", "warm", "VALIDATE_SNAPSHOT_SCOPE='warm': give 'step' or 'warmup' or 'job', or unset it"),
    ("VALIDATE_FEW_STEPS", "0", "VALIDATE_FEW_STEPS='0': give '1', or unset it"),   # the worker read "0" as on
    ("VALIDATE_FAKE_WORLD", "abc", "VALIDATE_FAKE_WORLD is set by `validate run --fake-world`: unset it"),
    ("VALIDATE_STEP", "2,1,1", "VALIDATE_STEP is not a variable validate reads (it reads VALIDATE_STEPS, "),
    ("VALIDATE_SNAPSHOT_DIR", "@file/snap", "VALIDATE_SNAPSHOT_DIR='@file/snap': @file is not a directory")])
def test_a_bad_validate_variable_is_refused_before_any_launch(tmp_path, monkeypatch, name, value, says):
    """A VALIDATE_* variable every worker would refuse or misread (VALIDATE_FAKE_WORLD=abc failed each
    launch at import: a launch and a crash row per job, naming an int() error), or a misspelt one that
    would be ignored: one line naming it, exit 2, before any launch."""
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    (tmp_path / "file").write_text("")
    value, says = (x.replace("@", str(tmp_path) + os.sep) for x in (value, says))
    monkeypatch.setenv(name, value)
    out = tmp_path / "rows.csv"
    result = CliRunner().invoke(validate_main, ["run", "--backend", "cpu", "--nproc", "1", "--stages", "0",
                                                "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "64",
                                                "--seq-len", "8", "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith("Error: " + says) and result.output.count("\n") == 1, result.output
    assert not out.exists()


def test_launches_that_start_no_job_cost_no_row_and_stop_the_sweep(tmp_path, fake, monkeypatch):
    """Every launch fails before its first job (a library the ranks cannot load): no job is charged a
    row (each was a crash row, done on resume), the second such launch stops the sweep with one line
    naming the rank's exception (exit 1), and once it is fixed the same command runs every job."""
    todo = jobs(3)
    log = fake({})
    monkeypatch.setenv("FAKE_START", "raise")
    out = str(tmp_path / "rows.csv")
    with pytest.raises(runner.LaunchError) as err:
        runner.run(todo, "cpu", 2, out, log=lambda *a: None)
    assert str(err.value).startswith("two launches in a row ended before a job started the same way: rank ")
    assert "ImportError: libfake.so: cannot open shared object file (rank " in str(err.value)
    assert str(err.value).endswith("no row written for the 3 jobs left: fix it and run the same command again")
    assert (log / "launches").read_text() == "3 jobs\n3 jobs\n" and not os.path.exists(out)
    monkeypatch.setenv("FAKE_START", "print")   # the launcher's own output, no rank record: its exception line
    result = CliRunner().invoke(validate_main, ["run", "--backend", "cpu", "--nproc", "2", "--stages", "0",
                                                "--hidden-size", "32", "--num-layers", "1", "--vocab-size", "64",
                                                "--seq-len", "8", "--out", out])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1] == (
        "Error: two launches in a row ended before a job started the same way: ValueError: invalid literal for "
        "int() with base 10: 'abc'; no row written for the 1 job left: fix it and run the same command again")
    monkeypatch.delenv("FAKE_START")
    assert [r["outcome"] for r in runner.run(todo, "cpu", 2, out, log=lambda *a: None)] == ["ok"] * 3


def test_a_full_temp_disk_is_one_line_and_leaves_no_launch_folder(tmp_path, fake, monkeypatch):
    """The launch's folder (its jobs file, the ranks' records) cannot be written: the sweep stops with one
    line saying where and why (it traced back), and the half-made folder is removed."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(runner.tempfile, "tempdir", str(temp))
    real = json.dump

    def full(obj, f, *a, **k):
        if f.name.endswith("jobs.json"):
            f.write("[{")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(runner.json, "dump", full)
    with pytest.raises(runner.LaunchError, match=r"could not write a launch's files in .*: No space left on device; "
                                                 r"make room \(or set TMPDIR\) and run the same command again"):
        runner.run(jobs(1), "cpu", 2, str(tmp_path / "rows.csv"), log=lambda *a: None)
    assert os.listdir(temp) == [] and not (tmp_path / "rows.csv").exists()


def test_a_launch_that_fails_once_before_any_job_is_launched_again(tmp_path, fake, monkeypatch):
    """A failure of one launch only (a port taken, a file system slow to mount): launched again, no row
    lost or charged."""
    todo = jobs(2)
    log = fake({})
    monkeypatch.setenv("FAKE_START", "raise-once")
    logged = []
    written = runner.run(todo, "cpu", 2, str(tmp_path / "rows.csv"), log=logged.append)
    assert [(r["key"], r["outcome"]) for r in written] == [(j["key"], "ok") for j in todo]
    assert (log / "launches").read_text() == "2 jobs\n2 jobs\n"
    assert any(m.startswith("the launch ended (exit 1) before its first job started: rank ") for m in logged)


def test_a_sweep_whose_every_job_failed_says_so(tmp_path, monkeypatch):
    """Every job refused (here by zerocalc: parameter offload at stage 2, not launched): the rows are kept,
    and the command ends with one Error line naming the first, exit 2, not a quiet 'done'."""
    monkeypatch.setattr(runner, "launch_command", _no_launch)
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"nproc": 1, "architectures": [{"vocab_size": 64, "hidden_size": 32, "num_layers": 1,
                                  "num_heads": 4}], "axes": {"stage": [1, 2], "offload_param": ["cpu"]}}))
    out = tmp_path / "rows.csv"
    result = CliRunner().invoke(validate_main, ["run", "--backend", "cpu", "--nproc", "1", "--matrix", str(matrix),
                                                "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: every one of the 2 jobs failed; the first (")
    assert [r["outcome"] for r in file_rows(str(out))] == ["error", "error"]


def test_the_launcher_is_this_interpreters():
    """`validate run` started outside its virtual environment still launches DeepSpeed's launcher of
    the interpreter running it (no `deepspeed` on PATH needed)."""
    cmd = runner.launch_command("cpu", 2, "jobs.json", "out", None, 29500)
    assert cmd[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_rank_that_raises_in_a_real_launch(tmp_path, monkeypatch):
    """The one real DeepSpeed launch of this file (2 CPU ranks, gloo, the smallest model): rank 1's
    forward raises after the engine is built (tests/scripts/raising_worker.py), so rank 0 blocks in the
    step's all-reduce. The worker records rank 1's traceback, the runner ends the launch after the
    grace period (2 s here), and the row holds rank 1's exception and where it was raised."""
    real = runner.launch_command
    monkeypatch.setattr(runner, "launch_command",
                        lambda *a: [x if x != "validate.worker" else "tests.scripts.raising_worker" for x in real(*a)])
    monkeypatch.setattr(lifeline, "RANK_FAILURE_GRACE_S", 2.0)
    job = make_job(Architecture("seed-gpt", 64, 16, 1, 2, 2, 64, False), 2, stage=0, seq_len=8, micro_batch=1)
    out = str(tmp_path / "rows.csv")
    written = runner.run([job], "cpu", 2, out, timeout_s=300, log=lambda *a: None)
    assert [r["outcome"] for r in written] == ["error"]
    error = file_rows(out)[0]["error"]
    assert error.startswith("rank 1: ") and "raising_worker.py" in error
    assert error.endswith("RuntimeError: injected fault in rank 1's forward")
