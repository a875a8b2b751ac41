"""zerocalc.probe, the probe of a user's own job. One 2-rank CPU launch (gloo, DeepSpeed's launcher;
about 25 s on two cores) runs tests/scripts/probe_job.py: a tiny Qwen2 trained as a user writes it, in
a plain engine loop (stage 2; stage 3 with PEFT LoRA) and through HF Trainer with the docs' "auto"
ds_configs (zero2; zero3 with LoRA), a model of one's own (no HF config, a frozen layer, gradient
accumulation), the probe off, and a probe that raises on one rank. What the probe measured must be,
to the byte, what the validator's worker measured for the same four HF jobs (tests/data/cpu-probe-worker.csv,
made by `validate run` from validate/matrices/cpu-probe.json) and what zerocalc predicts from the
recorded tensors; from the config, what zerocalc's trace of it predicts. The quick tests need neither
torch nor DeepSpeed: the step counting on a stand-in engine, the row file, the imports."""
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_ROWS = os.path.join(ROOT, "tests", "data", "cpu-probe-worker.csv")
RUNS = ("engine-s2", "engine-s3-lora", "trainer-s2", "trainer-s3-lora")   # the worker's four jobs, as a user runs them


# ---- quick: no DeepSpeed ----------------------------------------------------------------------------

class StandIn:
    """An engine as the probe sees one: forward, backward, step, and DeepSpeed's optimizer-step counter."""

    def __init__(self, gas=1):
        self.global_steps, self.micro, self.gas, self.device = 0, 0, gas, types.SimpleNamespace(type="cpu")

    def forward(self, x):
        return x

    def backward(self, loss):
        return loss

    def step(self):
        self.micro += 1
        if self.micro % self.gas == 0:
            self.global_steps += 1


def train(engine, steps, gas=1):
    for _ in range(steps * gas):
        engine.backward(engine.forward(1))
        engine.step()


@pytest.mark.parametrize("gas", [1, 3])
def test_the_probe_measures_step_3_times_step_4_and_gives_the_engine_back(monkeypatch, gas):
    """Nothing but counting before step 3 (no synchronize, no recorder); step 3 measured, step 4 timed
    between two synchronizes, then the report and the engine's own methods back."""
    from zerocalc.probe import hook
    seen = []
    monkeypatch.setattr(hook.measure, "synchronize", lambda cuda: seen.append(("sync", engine.global_steps)))
    phases = types.SimpleNamespace(mark=lambda: None, phase=lambda name: seen.append((name, engine.global_steps)))

    def start(self):
        seen.append(("start", engine.global_steps))
        self.recorder = phases
    monkeypatch.setattr(hook.Probe, "_start_measured", start)
    monkeypatch.setattr(hook.Probe, "_end_measured", lambda self: seen.append(("end", engine.global_steps)))
    monkeypatch.setattr(hook.Probe, "_report", lambda self, ranks: seen.append(("report", engine.global_steps)))
    engine = StandIn(gas)
    own = {name: getattr(engine, name) for name in hook.WRAPPED}
    probe = hook.attach(engine, step=3)
    assert all(name in vars(engine) for name in hook.WRAPPED)
    train(engine, 6, gas)
    # started as step 3 began (2 steps done), its phases recorded micro-step by micro-step, ended after it,
    # step 4 between two synchronizes, reported after it
    assert seen == [("start", 2)] + [("forward", 2), ("backward", 2), ("step", 2)] * (gas - 1) + \
        [("forward", 2), ("backward", 2), ("step", 3), ("end", 3), ("sync", 3), ("sync", 4), ("report", 4)]
    assert probe.done and not any(name in vars(engine) for name in hook.WRAPPED)
    assert {name: getattr(engine, name) for name in hook.WRAPPED} == own


def test_off_wraps_nothing(monkeypatch):
    from zerocalc.probe import hook
    engine = StandIn()
    assert hook.attach(engine, step=None) is None
    monkeypatch.setenv("ZEROCALC_PROBE", "0")
    assert hook.attach(engine, step=3) is None
    assert vars(engine) == vars(StandIn())


def test_a_failure_is_one_line_and_the_steps_go_on(monkeypatch, capsys):
    """The measurement raising: one line on stderr, training goes on, and the probe still reaches the
    gather after step 4 (every rank must, or the others would wait in it)."""
    from zerocalc.probe import hook

    def broken(self):
        raise RuntimeError("injected")
    gathered = []
    monkeypatch.setattr(hook.Probe, "_start_measured", broken)
    monkeypatch.setattr(hook.Probe, "_gather", lambda self, payload: gathered.append(json.loads(payload)) or None)
    engine = StandIn()
    hook.attach(engine, step=3)
    train(engine, 5)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert err == ["zerocalc.probe (rank 0): starting its measurement: RuntimeError: injected; training goes on "
                   "without the probe"]
    assert engine.global_steps == 5 and gathered == [{"error": "starting its measurement: RuntimeError: injected"}]
    assert not any(name in vars(engine) for name in hook.WRAPPED)


def test_a_job_shorter_than_the_probe_reports_nothing_and_gathers_nothing(monkeypatch, capsys):
    from zerocalc.probe import hook
    monkeypatch.setattr(hook.Probe, "_gather", lambda self, payload: pytest.fail("gathered"))
    engine = StandIn()
    probe = hook.attach(engine, step=3)
    train(engine, 2)
    probe.close()
    assert "ended before optimizer step 3" in capsys.readouterr().err
    assert not any(name in vars(engine) for name in hook.WRAPPED)


def test_importing_the_probe_imports_neither_torch_nor_deepspeed():
    code = ("import sys, zerocalc.probe, zerocalc.probe.row, zerocalc.rows_schema; "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_the_validator_reads_the_schema_from_zerocalc():
    from validate import jobs, rows
    from zerocalc import rows_schema
    assert rows.COLUMNS is rows_schema.COLUMNS and rows.HF_COLUMNS is rows_schema.HF_COLUMNS
    assert jobs.SETUP_FIELDS is rows_schema.SETUP_FIELDS and jobs.ARCH_FIELDS is rows_schema.ARCH_FIELDS
    assert rows._cast("5e8", int) == 500_000_000 and rows._cast("", int) is None and rows._cast("True", bool)


def test_a_probe_row_file_is_a_results_file(tmp_path):
    """A new file gets the validator's header; a row with a column the file lacks rewrites it with the
    column added; the validator reads every row back (its rows' checks included: the rows are the
    worker's, as the probe writes them)."""
    import csv

    from validate import report
    from zerocalc.probe.row import append_row
    from zerocalc.rows_schema import COLUMNS
    with open(WORKER_ROWS, newline="") as f:
        worker = next(csv.DictReader(f))
    path = str(tmp_path / "rows.csv")
    first = {**{k: v for k, v in worker.items() if v != ""}, "key": "a", "probe_step": 3, "command": "train.py\n--x"}
    append_row(path, first)
    append_row(path, {**first, "key": "b", "config_step_s": 0.5})
    df, notes = report.read_results(path)
    assert list(df.columns)[:len(COLUMNS)] == list(COLUMNS)
    assert [c for c in df.columns if c not in COLUMNS][-2:] == ["probe_step", "config_step_s"]
    assert list(df["key"]) == ["a", "b"] and list(df["command"]) == ["train.py | --x"] * 2 and notes == []


@pytest.mark.parametrize("name,preset", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                         ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-SXM4-80GB", "a100-80g"),
                                         ("Tesla V100-SXM2-32GB", "v100-32g"), ("NVIDIA L4", None), (None, None)])
def test_the_gpu_preset_by_device_name(name, preset):
    from zerocalc.probe.describe import gpu_preset
    hw = gpu_preset(name)
    assert (hw.name if hw else None) == preset


def gpu_rank(state, peak, before, step_s, hwm):
    """One rank's measurement as a CUDA job hands it to rank 0 (`Probe.local`), made up."""
    phase = {"peak_allocated": peak, "peak_reserved": 2 * peak, "end_allocated": peak // 2, "retries": 0}
    return {"state": {"by_device": {"cuda": state, "cpu": 64}, "scalar_bytes": 12, "by_path": {"engine.x": state}},
            "comm": {"all_reduce | [Caller Func: f]": [[100, 2]], "all_gather_into_tensor | [Caller Func: g]": [[8, 1]]},
            "param_tensors": 3, "sharded_param_tensors": 0, "hostname": "a", "step_s": step_s,
            "host": {"VmHWM": hwm, "VmRSS": hwm // 2, "MemAvailable": 10 * 2**30, "MemTotal": 20 * 2**30},
            "memory": {"phases": {"forward": phase, "backward": phase, "step": phase}, "alloc_retries": 0,
                       "phase_seconds": {"forward": 0.1, "backward": 0.2, "step": 0.05}, "device_used_bytes": 10**10,
                       "reserved_now": 9 * 10**9, "peak_allocated": peak, "peak_reserved": 2 * peak,
                       "base_allocated": 3, "before": {"peak_allocated": before, "peak_reserved": before}}}


def test_a_gpu_row_is_the_busiest_ranks(monkeypatch):
    """The measured columns of a CUDA job from its ranks' measurements, as the validator's rows take
    them: state the largest (and smallest), communication the largest, peaks the largest of the step's
    phases and the job's before it, step time the slowest rank's, host peaks summed over the node."""
    from zerocalc.probe.row import measured, table
    ranks = [gpu_rank(1000, 5 * 2**30, 6 * 2**30, 0.2, 2**30), gpu_rank(900, 7 * 2**30, 2**30, 0.3, 2**31)]
    row = measured(ranks, "cuda")
    assert row["measured_state_bytes"] == 1000 and row["measured_state_min_bytes"] == 900
    assert row["measured_comm_bytes"] == 2 * 100 + 8 and json.loads(row["measured_comm_by_op"]) == \
        {"all_reduce": 200, "all_gather_into_tensor": 8}
    assert row["measured_peak_allocated_bytes"] == 7 * 2**30      # rank 1's step, above rank 0's before it (6)
    assert row["measured_peak_reserved_bytes"] == 14 * 2**30 and row["measured_base_allocated_bytes"] == 0
    assert row["measured_step_s"] == 0.3 and row["measured_forward_s"] == 0.1
    assert row["measured_host_peak_bytes"] == 2**31 and row["measured_host_node_peak_bytes"] == 3 * 2**30
    assert row["measured_host_state_bytes"] == 64 and row["measured_device_overhead_bytes"] == 10**9
    row.update(backend="cuda", gpu="NVIDIA H200", probe_step=3, nproc=2, stage=2, dtype="bf16", micro_batch=4,
               seq_len=1024, gas=1, activation_checkpointing=False, offload_optimizer="cpu", offload_param="none")
    ours = {"state": 1000, "comm": 208, "host": 2**31 + 2**20, "peak": 7 * 2**30 + 2**20, "reserved": None,
            "step_s": 0.33}
    text = table(row, ours, "the shipped qwen2.5-0.5b", ["a note"], hw=object())
    assert "2-rank DeepSpeed job on NVIDIA H200: stage 2, bf16, micro-batch 4 x 1024 tokens, gas 1, optimizer " \
        "offload to cpu" in text
    lines = {ln.split("  ")[0].strip(): ln.split() for ln in text.splitlines()[3:9]}
    assert lines["state per rank (device tensors)"][-1] == "exact" and lines["communication per optimizer step"][-1] \
        == "exact"
    # 1 MiB off 7 GiB: under 0.05%, said in bytes rather than as +0.0%
    assert lines["peak allocated"][-2:] == ["+1,048,576", "B"] and lines["peak reserved"][-2:] == ["GiB", "-"]
    assert lines["step time"][-1] == "+10.0%" and text.endswith("note: a note")


def test_the_gpu_demo_script_parses_its_arguments():
    out = subprocess.run([sys.executable, "validate/gpu/probe_demo.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "--probe-step" in out and "--variants" in out


def test_the_gpu_demo_pools_runs_and_separates_the_probes_steps():
    pytest.importorskip("torch")
    import importlib.util
    spec = importlib.util.spec_from_file_location("probe_demo", os.path.join(ROOT, "validate/gpu/probe_demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    # probe at step 4: 0-based steps 3 (measured) and 4 (timed) are its own, step 0 is warm-up
    without = [[9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    with_probe = [[9, 1.0, 1.0, 5.0, 4.0, 1.2, 1.2]]
    r = demo.summary(without, with_probe, probe_step=4, warmup=1)
    assert r["steps_compared"] == 4                    # steps 1, 2, 5, 6
    assert r["median_with_s"] == pytest.approx(1.1)     # median of 1.0, 1.0, 1.2, 1.2
    assert r["ratio"] == pytest.approx(1.1)
    assert r["after_over_before_ratio"] == pytest.approx(1.2)   # (1.2 / 1.0) over (1.0 / 1.0)
    assert (r["probe_measured_step_s"], r["probe_timed_step_s"]) == (5.0, 4.0)
    assert r["total_with_s"] == pytest.approx(13.4) and r["total_without_s"] == pytest.approx(6.0)


def test_the_callback_off_attaches_nothing(monkeypatch):
    pytest.importorskip("transformers")
    from zerocalc.probe import ZeroCalcCallback, trainer
    monkeypatch.setattr(trainer, "find_engine", lambda model: pytest.fail("looked for an engine"))
    cb = ZeroCalcCallback(step=None)
    for event in ("on_train_begin", "on_step_begin", "on_step_end", "on_train_end"):
        getattr(cb, event)(None, None, None, model=object())
    assert cb.probe is None and ZeroCalcCallback is trainer.callback_class()


# ---- the CPU launch ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """tests/scripts/probe_job.py on two CPU ranks: {run: [rank 0's record, rank 1's]}, and its folder."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    from validate.lifeline import remove_shm_buffers
    from validate.runner import _free_port
    out = tmp_path_factory.mktemp("probe")
    port = _free_port()
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    try:
        proc = subprocess.run([sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--master_port", str(port),
                               "--num_gpus", "2", "tests/scripts/probe_job.py", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for line in (out / "ranks.jsonl").read_text().splitlines():
        r = json.loads(line)
        runs.setdefault(r["name"], [None, None])[r["rank"]] = r
    return runs, out, proc.stdout


def probe_row(folder, name) -> dict:
    import pandas as pd
    df = pd.read_csv(folder / f"{name}.csv")
    assert len(df) == 1
    return df.iloc[0].to_dict()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_every_run_trains_on_and_is_left_as_it_was(launch):
    runs, _, _ = launch
    assert set(runs) == set(RUNS) | {"off", "raises", "own-s1"}
    for name, ranks in runs.items():
        for r in ranks:
            assert r["steps"] == 5 and len(r["losses"]) in (5, 10) and r["wrapped"] == [], (name, r)
            assert not r.get("logger_on"), name         # the comms logger as the job had it: off
            if name != "raises":
                assert r["probe_lines"] == [], (name, r["probe_lines"])


@pytest.mark.slow
@pytest.mark.deepspeed
def test_the_probe_measures_what_the_validators_worker_does(launch):
    """State, communication and the collectives op by op, equal to the worker's row for the same job
    (on these: 1,106,496 state and 414,917 communication bytes at stage 2, loop and Trainer alike;
    1,000,205,056 and 162,888 at stage 3 with LoRA in the loop (fp32 sub-group buffers at
    sub_group_size 1e9); 194,304 and 152,648 through Trainer's zero3-auto with LoRA on q/k/v/o)."""
    import pandas as pd
    _, folder, _ = launch
    worker = pd.read_csv(WORKER_ROWS)
    assert len(worker) == 4 and (worker["outcome"] == "ok").all()
    for name in RUNS:
        p = probe_row(folder, name)
        path, stage, lora = name.split("-")[0], int(name.split("-")[1][1:]), name.endswith("lora")
        w = worker[(worker["path"] == path) & (worker["stage"] == stage) & (worker["lora"].notna() == lora)]
        assert len(w) == 1, name
        w = w.iloc[0]
        assert p["path"] == ("loop" if path == "engine" else "trainer") and p["nproc"] == 2 and p["probe_step"] == 3
        for col in ("measured_state_bytes", "measured_state_min_bytes", "measured_comm_bytes", "measured_comm_by_op",
                    "num_params", "param_tensors", "sharded_param_tensors", "dtype", "micro_batch", "seq_len", "gas",
                    "reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold", "zero_init"):
            assert p[col] == w[col], (name, col, p[col], w[col])
        assert json.loads(p["measured_comm_detail"]) == json.loads(w["measured_comm_detail"]), name


@pytest.mark.slow
@pytest.mark.deepspeed
def test_zerocalc_predicts_what_the_probe_measured(launch):
    """From the recorded tensors (predicted_*): exact, every run. From the model's config (config_*: its
    trace, with the PEFT LoRA read from the model): what zerocalc's trace of that config predicts in the
    validator's report, which is exact but for Trainer's zero3 LoRA job (32 bytes of rotary buffer:
    transformers' zero.Init keeps inv_freq fp32, the trace counts it in the 16-bit dtype)."""
    import pandas as pd

    from validate.report import repredict_hf
    _, folder, _ = launch
    rows = pd.DataFrame([probe_row(folder, name) for name in RUNS + ("own-s1",)])
    for pred, meas in (("predicted_state_bytes", "measured_state_bytes"),
                       ("predicted_comm_bytes", "measured_comm_bytes")):
        assert (rows[pred] == rows[meas]).all(), rows[["key", pred, meas]]
    hf = rows[rows["family"] == "auto-qwen2"]
    now = repredict_hf(hf)
    assert (now["now_state_bytes"] == hf["measured_state_bytes"]).all()
    assert (now["pred_state_bytes"] == hf["config_state_bytes"]).all()
    assert (now["pred_comm_bytes"] == hf["config_comm_bytes"]).all()
    exact = hf["config_state_bytes"] == hf["measured_state_bytes"]
    assert list(hf.loc[~exact, "path"] + hf.loc[~exact, "stage"].astype(str)) == ["trainer3"]
    assert (hf["config_comm_bytes"] == hf["measured_comm_bytes"]).all()
    off = hf.loc[~exact].iloc[0]
    assert off["measured_state_bytes"] - off["config_state_bytes"] == 32
    assert hf["probe_model"].str.startswith("qwen2 traced from its config").all()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_model_of_ones_own(launch):
    """No HF config: zerocalc predicts from the module's recorded tensors and calls (its trainable flags:
    the frozen linear has no gradient or optimizer state), at gradient accumulation 2."""
    _, folder, stdout = launch
    p = probe_row(folder, "own-s1")
    assert p["family"] == "module-Own" and p["gas"] == 2 and p["micro_batch"] == 2 and p["seq_len"] == 12
    assert json.loads(p["freeze"]) == ["mix"] and p["num_params"] == 500 * 48 + 48 * 48 + 48 + 48 * 500
    spec = json.loads(p["hf_spec"])
    assert spec["trainable"] == [True, False, False, True] and spec["buffer_bytes"] == [48 * 4]
    assert p["predicted_state_bytes"] == p["measured_state_bytes"] and pd_isna(p.get("hf_config"))
    assert "Own's 4 parameter tensors" in stdout
    # `zerocalc report` reads it too, the model from its record
    from zerocalc import hardware, measured
    (row,), _ = measured.read([str(folder / "own-s1.csv")], hardware.gpu("h200"))
    assert row.model.num_params == p["num_params"] and row.model.trainable == (True, False, False, True)


def pd_isna(v) -> bool:
    return v is None or v != v


@pytest.mark.slow
@pytest.mark.deepspeed
def test_the_table_and_the_report(launch):
    """Rank 0 prints one table per run; `python -m validate report` reads the rows and finds state and
    communication exact from the recorded tensors on all five."""
    from validate import report
    _, folder, stdout = launch
    assert stdout.count("zerocalc probe, optimizer step 3 of a 2-rank DeepSpeed job on cpu") == 5
    assert stdout.count("exact") >= 9
    text, exact = report.report([str(folder / f"{name}.csv") for name in RUNS + ("own-s1",)])
    assert exact, text
    assert "State and communication exact from the recorded tensors: 5 of 5 rows" in text


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_probe_row_has_only_the_schemas_columns(launch):
    import pandas as pd

    from zerocalc.rows_schema import COLUMNS, HF_COLUMNS, PROBE_COLUMNS, RUN_COLUMNS
    _, folder, _ = launch
    for name in RUNS + ("own-s1",):
        header = list(pd.read_csv(folder / f"{name}.csv", nrows=0).columns)
        assert header[:len(COLUMNS)] == list(COLUMNS)
        assert set(header) <= set(COLUMNS + HF_COLUMNS + RUN_COLUMNS + PROBE_COLUMNS), name


@pytest.mark.slow
@pytest.mark.deepspeed
def test_the_probe_off_adds_no_calls(launch):
    runs, folder, _ = launch
    assert [r["probe_calls"] for r in runs["off"]] == [0, 0]
    assert not (folder / "off.csv").exists()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_a_probe_that_raises_does_not_stop_training(launch):
    """The state walk raises on rank 1 only: rank 1 says so in one line and stops measuring, rank 0
    measures on, both meet in the gather after step 4, rank 0 writes no row and says why; all 5 steps run."""
    runs, folder, _ = launch
    r0, r1 = runs["raises"]
    assert r1["probe_lines"] == ["zerocalc.probe (rank 1): reading what the step held and sent: RuntimeError: an "
                                 "injected failure; training goes on without the probe"]
    assert len(r0["probe_lines"]) == 1 and "rank 1 failed" in r0["probe_lines"][0]
    assert r0["losses"] and all(x == x for x in r0["losses"] + r1["losses"])
    assert not (folder / "raises.csv").exists()


def test_on_the_gpu_the_probes_rows_are_the_workers():
    """The four jobs of validate/matrices/h200-probe-vs-worker.json (Qwen2.5-0.5B, 4 x 1024, one H200:
    the engine loop at stage 2 and at stage 3 with LoRA, Trainer's zero2-auto and zero3-auto with LoRA),
    trained as a user writes them with the probe attached (data/probe-gpu/probe-rows/) and by the
    validator's worker (data/probe-gpu/worker.csv): state, communication and every logged collective
    equal to the byte; the peak reserved equal to the byte and the peak allocated within 5 parts in a million (66,560 B of 20.1 GB at most: the
    worker's own cross-entropy on the logits, HF's loss in the user's code)."""
    sys.path.insert(0, os.path.join(ROOT, "validate", "gpu"))
    import probe_vs_worker
    folder = os.path.join(ROOT, "data", "probe-gpu")
    records = probe_vs_worker.compare(os.path.join(folder, "probe-rows"), os.path.join(folder, "worker.csv"))
    assert sorted((r["path"], r["stage"], r["lora"]) for r in records) == [
        ("engine", "2", False), ("engine", "3", True), ("trainer", "2", False), ("trainer", "3", True)]
    for r in records:
        assert r["differ"] == [] and r["detail_equal"], r["key"]
        assert r["peak_ratio"]["measured_peak_reserved_bytes"] == 1.0, r["key"]
        assert abs(r["peak_ratio"]["measured_peak_allocated_bytes"] - 1) < 5e-6, r["key"]
