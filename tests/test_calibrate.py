"""`zerocalc calibrate` and `zerocalc report`: a user's own rows to their own calibration. The fit on the
committed H200 rows gives back the committed constants; on a slower cluster's rows (the same rows'
step times × 1.3) the calibration fitted on three quarters predicts the held-out quarter as well as the
shipped one predicts the H200's, where the shipped one is 20-odd % off; rows that cannot determine a
constant leave it at the shipped value and say why; bad input is one line and exit 2."""
import csv
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from zerocalc import calibrate, calibration, measured
from zerocalc.cli import main
from zerocalc.hardware import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The files the shipped calibration was fitted on (`python -m validate fit`), as it records them.
FITTED_ON = [os.path.join(ROOT, p) for p in calibration.default()["fitted_on"]]


def write_rows(path, rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="module")
def committed():
    """Every ok row of the files the shipped calibration was fitted on, and each row's CSV fields."""
    pytest.importorskip("torch")        # the HF configs' rows are traced (from data/hf-traces/)
    rows, _ = measured.read(FITTED_ON, gpu("h200"))
    raw = {r["_where"]: r for p in FITTED_ON for r in measured.read_csv(p)[1]}
    return rows, raw


def test_zerocalc_reads_a_row_as_the_validator_does(committed):
    """One description of a job: every timed row's step-time features, as zerocalc reads the CSV, are
    the validator's (`validate.fit.time_features`, from its pandas rows), and so are its times."""
    pytest.importorskip("pandas")
    from validate.fit import time_features
    from validate.report import load, timed_whole_steps
    rows, _ = committed
    timed = [r for r in rows if r.timed]
    df = load(FITTED_ON)
    df = df[(df["outcome"] == "ok") & df["measured_peak_allocated_bytes"].notna()]
    df = df[timed_whole_steps(df)]
    assert len(timed) == len(df) == 374
    ours = calibrate.time_features(timed, calibration.default())
    theirs = time_features(df, calibration.default())
    assert ours == theirs
    times = df[["measured_forward_s", "measured_backward_s", "measured_step_phase_s", "measured_step_s"]].to_numpy(float)
    assert np.allclose(calibrate.measured_times(timed), times, equal_nan=True) or \
        np.allclose(calibrate.measured_times(timed)[:, 3], times[:, 3])


@pytest.fixture(scope="module")
def checks(committed):
    """`validate.fit.calibrate_checks` on the committed rows: what docs/your-cluster.md shows."""
    pytest.importorskip("pandas")
    from validate.fit import calibrate_checks
    return calibrate_checks(FITTED_ON)


def test_calibrate_on_the_committed_rows_gives_back_the_committed_constants(checks):
    """On the rows `python -m validate fit` fitted (its training split: every configuration but the
    held-out quarter), started from the validator's usual start, not from the answer: each constant
    the rows determine comes back within its fit error (one standard error); stage 1's gradient
    move, which they leave uncertain, is kept at the committed value. The device's constants held as
    that fit holds them
    (measured without DeepSpeed, `validate.fit.device_constants`)."""
    result, shipped = checks["committed"], calibration.default()
    time = [f for f in result.fitted if f.name.startswith("time.")]
    assert len(time) >= 20
    for f in time:
        committed_value = calibrate._get(shipped["time"], f.name.removeprefix("time."))
        assert abs(np.log(f.value / committed_value)) <= f.error, (f.name, f.value, committed_value, f.error)
    kept = {k.name for k in result.kept}
    assert "time.grad_move_s" in kept
    ratio = next(f for f in result.fitted if f.name == "allocator.reserved_over_allocated")
    # the HF configs' rows count here too (validate fit leaves them out of this ratio)
    assert abs(np.log(ratio.value / shipped["allocator"]["reserved_over_allocated"])) <= ratio.error
    assert result.after["mean_abs_error"] == pytest.approx(shipped["time"]["accuracy"]["mean_abs_error"], abs=0.01)


def test_on_a_slower_cluster_the_calibration_beats_the_shipped_constants_on_rows_it_never_saw(checks):
    """The committed timed rows, their step times × 1.3 (a cluster 30% slower), split by a hash of each
    row's key: fitted on three quarters, the held-out quarter's mean |error| falls from the shipped
    constants' (22%) to what the shipped constants achieve on the H200's own rows (11%)."""
    own, slower = (checks["held_out"][k] for k in ("as measured", "× 1.3"))
    shipped, calibrated = (slower[k]["mean_abs_error"] for k in ("shipped", "calibrated"))
    assert shipped > 0.2
    assert calibrated <= own["shipped"]["mean_abs_error"] + 0.01 and calibrated < shipped / 1.8
    # on the rows it was fitted for, no worse than shipped
    assert own["calibrated"]["mean_abs_error"] <= own["shipped"]["mean_abs_error"] + 0.01


# A user's own jobs, written as they would write them: a --model name, the setup, the step time.
USER_SETUPS = [dict(model=m, nproc=n, stage=s, micro_batch=b, seq_len=q, dtype="bf16")
               for m in ("gpt2-medium", "llama-3.2-1b") for n in (1, 8) for s in (1, 2) for b, q in ((1, 1024), (4, 2048))]


def _user_rows(tmp_path, factor=1.0, time=None, setups=USER_SETUPS):
    """The setups' rows with measured_step_s = zerocalc's step time with `time` constants, × `factor`."""
    base = calibration.default()
    cal = {**base, "time": {**base["time"], **(time or {})}}
    path = write_rows(tmp_path / "setup.csv", [{**s, "measured_step_s": 1} for s in setups])
    rows, _ = measured.read([path], gpu("h200"))
    steps = calibrate.predict(calibrate.time_features(rows, cal), cal["time"])[:, 3] * factor
    return write_rows(tmp_path / "rows.csv", [{**s, "measured_step_s": f"{t:.6g}"} for s, t in zip(setups, steps)])


def test_a_users_rows_fit_what_they_determine_and_keep_the_rest(tmp_path):
    """16 jobs of two models at stages 1-2 on 1 and 8 GPUs, 25% slower than the shipped model says: the
    calibration fits the step's constants these rows move, keeps (and names) the stage-3, offload and
    cross-node ones, writes a file estimate takes, and the rows are then predicted within 1%."""
    rows = _user_rows(tmp_path, factor=1.25)
    out = tmp_path / "mycluster.json"
    r = CliRunner().invoke(main, ["calibrate", rows, "-o", str(out)])
    assert r.exit_code == 0, r.output
    cal = json.loads(out.read_text())
    fitted, kept = cal["calibrated"]["fitted"], cal["calibrated"]["kept"]
    assert "time.efficiency" in fitted and "time.module_hook_s" in kept and "time.host_adam_elements_per_s" in kept
    assert "stage-3 rows" in kept["time.module_hook_s"] and "Kept at the shipped" in r.output
    # a slower device: the efficiency down, the device's passes per byte up by the same factor (tied: step
    # times cannot tell them apart); the host's constants up (these rows fit exactly with several
    # splits of the 25% between the per-layer and per-operator costs, so not each × 1.25)
    factor = fitted["time.efficiency"]["shipped"] / fitted["time.efficiency"]["value"]
    assert 1.1 < factor < 1.3
    for name in ("activation_passes", "backward_activation_passes"):   # the loss path's moves none of these rows
        assert fitted[f"time.{name}"]["scaled_with"] == "time.efficiency"
        assert fitted[f"time.{name}"]["value"] == pytest.approx(factor * fitted[f"time.{name}"]["shipped"], rel=0.001)
    for name in ("launch_fwd_s_per_layer", "launch_bwd_s_per_layer", "launch_s_per_op", "grad_hook_s"):
        assert 1.0 < fitted[f"time.{name}"]["value"] / fitted[f"time.{name}"]["shipped"] < 1.35
    assert all(k in r.output for k in fitted) and all(k in r.output for k in kept)
    for name, f in fitted.items():
        assert {"value", "shipped", "rows", "relative_error"} <= set(f) and f["rows"] >= calibrate.MIN_ROWS
    assert cal["time"]["module_hook_s"] == calibration.default()["time"]["module_hook_s"]
    assert cal["time"]["accuracy"]["mean_abs_error"] < 0.01
    report = CliRunner().invoke(main, ["report", rows, "--calibration", str(out)])
    assert report.exit_code == 0, report.output
    assert "step time: 16 of 16 rows within 15%" in report.output
    before = CliRunner().invoke(main, ["report", rows])
    assert "step time: 0 of 16 rows within 15%" in before.output


def test_a_calibration_changes_only_the_constants_it_fitted(tmp_path):
    """estimate, plan and sweep take the file: memory and bytes as with the shipped calibration, only
    the step time (fitted) moves; a file equal to the shipped one changes nothing."""
    out = tmp_path / "mycluster.json"
    assert CliRunner().invoke(main, ["calibrate", _user_rows(tmp_path, 1.25), "-o", str(out)]).exit_code == 0
    args = ["estimate", "--model", "llama-3.2-1b", "--dp", "8", "--seq-len", "2048", "--gpu", "h200", "--format", "json"]
    shipped = json.loads(CliRunner().invoke(main, args).output)
    mine = json.loads(CliRunner().invoke(main, args + ["--calibration", str(out)]).output)
    for a, b in zip(shipped["estimates"], mine["estimates"]):
        assert a["per_rank_bytes"] == b["per_rank_bytes"] and a["comm"] == b["comm"] and a["peak_bytes"] == b["peak_bytes"]
        if a["stage"] in (1, 2):   # what the rows measured: the step's constants there, × 1.25
            assert b["time"]["step_s"] == pytest.approx(1.25 * a["time"]["step_s"], rel=0.02)
    same = tmp_path / "same.json"
    same.write_text(json.dumps(calibration.default()))
    assert json.loads(CliRunner().invoke(main, args + ["--calibration", str(same)]).output)["estimates"] == \
        shipped["estimates"]
    plan = ["plan", "--model", "llama-3.2-1b", "--gpu", "h200", "--max-gpus", "8", "--seq-len", "2048",
            "--global-batch", "64", "--top", "1", "--format", "json"]
    r = CliRunner().invoke(main, plan + ["--calibration", str(out)])
    assert r.exit_code == 0, r.output
    sweep = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--dp", "8", "--stage", "2", "--calibration", str(out)])
    assert sweep.exit_code == 0 and "reserved_bytes" in sweep.output.splitlines()[0]


def test_rows_of_jobs_across_nodes_fit_the_networks_own_link_efficiency(tmp_path):
    """Jobs of 16 GPUs on 2 nodes beside jobs within one: made by the model with the network at 0.6 of
    its bandwidth and NVLink at the shipped efficiency, the calibration finds 0.6 across nodes and
    estimate uses it only where N spans nodes."""
    setups = [dict(s, nproc=16, nodes=2) for s in USER_SETUPS if s["nproc"] == 8] + USER_SETUPS
    rows = _user_rows(tmp_path, time={"inter_node_link_efficiency": 0.6}, setups=setups)
    out = tmp_path / "nodes.json"
    r = CliRunner().invoke(main, ["calibrate", rows, "-o", str(out)])
    assert r.exit_code == 0, r.output
    cal = json.loads(out.read_text())
    assert cal["time"]["inter_node_link_efficiency"] == pytest.approx(0.6, rel=0.02)
    est = ["estimate", "--model", "llama-3.2-1b", "--seq-len", "2048", "--gpu", "h200", "--stage", "2", "--format", "json"]
    one = ["--dp", "8"]
    two = ["--nodes", "2", "--gpus-per-node", "8"]
    for flags, changes in ((one, False), (two, True)):
        a = json.loads(CliRunner().invoke(main, est + flags).output)["estimates"][0]["time"]["step_s"]
        b = json.loads(CliRunner().invoke(main, est + flags + ["--calibration", str(out)]).output)["estimates"][0]
        assert (b["time"]["step_s"] > a * 1.001) == changes


@pytest.mark.parametrize("content, says", [
    ("", "empty"),
    ("a,b\n1,2\n", "no model column"),
    ("model,stage,measured_step_s\ngpt2,2,0.1\n", "no `nproc` column"),
    ("model,nproc,stage\ngpt2,1,2\n", "nothing measured"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt2,one,2,512,0.1\n", "nproc = 'one': must be a whole number"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt2,1,2,512,fast\n", "measured_step_s = 'fast': must be a finite number"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt-9,1,2,512,0.1\n", "is not a --model name"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt2,1,7,512,0.1\n", "stage = 7: must be 0, 1, 2 or 3"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt2,1,2,512,\n", "no usable row"),
    ("model,nproc,stage,seq_len,measured_step_s,outcome\ngpt2,1,2,512,0.1,oom\n", "no usable row"),
    ("model,nproc,stage,seq_len,measured_step_s\ngpt2,1,2\n", "3 fields where the header has 5"),
    ("model,nproc,stage,seq_len,measured_step_s,nodes\ngpt2,2,2,512,0.1,3\n", "nodes = 3: must divide nproc 2"),
])
@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_bad_rows_are_one_line_and_exit_2(tmp_path, content, says, command):
    path = tmp_path / "rows.csv"
    path.write_text(content)
    args = [command, str(path)] + (["-o", str(tmp_path / "c.json")] if command == "calibrate" else [])
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    error = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1 and says in error[0], r.output
    assert not (tmp_path / "c.json").exists()


def test_a_missing_file_and_an_unwritable_output_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["calibrate", str(tmp_path / "none.csv"), "-o", str(tmp_path / "c.json")])
    assert r.exit_code == 2 and "cannot read it" in r.output
    rows = _user_rows(tmp_path)
    r = CliRunner().invoke(main, ["calibrate", rows, "-o", str(tmp_path / "no" / "c.json")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_report_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _user_rows(tmp_path)
    r = CliRunner().invoke(main, ["report", rows, "--figure", str(tmp_path / "f.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_a_calibration_file_with_a_bad_inter_node_efficiency_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    shipped = calibration.default()
    bad.write_text(json.dumps({**shipped, "time": {**shipped["time"], "inter_node_link_efficiency": 1.5}}))
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--calibration", str(bad)])
    assert r.exit_code == 2 and "at most 1" in r.output


def test_sweep_adds_reserved_and_the_wires_time():
    """--gpu h200: P = 1e9 bf16 at stage 2; at N = 8 the wire bytes cross NVLink (450 GB/s), at N = 16
    over two nodes the network (50 GB/s), each at the shipped link efficiency; reserved is the peak
    times the shipped reserved/allocated ratio (a P-only model's sequence is not simulated)."""
    r = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--dp", "8,16", "--stage", "2", "--gpu", "h200"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(r.output.splitlines()))
    k, a = calibration.default()["time"], calibration.default()["allocator"]
    for row, link in zip(rows, (450e9, 50e9)):
        assert float(row["comm_s"]) == pytest.approx(int(row["wire_bytes"]) / (link * k["link_efficiency"]), rel=1e-9)
        assert int(row["reserved_bytes"]) == int(int(row["peak_bytes"]) * a["reserved_over_allocated"])
    plain = CliRunner().invoke(main, ["sweep", "--params", "1e9", "--dp", "8"]).output.splitlines()[0]
    assert "comm_s" not in plain and "reserved_bytes" not in plain


def test_a_row_may_name_its_model_by_a_config_json_beside_it(tmp_path):
    """`hf_config`: a config.json's path, relative to the CSV's folder; a shipped model's is that model."""
    import shutil
    shutil.copy(os.path.join(ROOT, "docs", "examples", "llama-3-8b-config.json"), tmp_path / "config.json")
    rows = write_rows(tmp_path / "rows.csv", [{"hf_config": "config.json", "nproc": 8, "stage": 3, "seq_len": 4096,
                                                "measured_step_s": 2.0}])
    (row,), _ = measured.read([rows], gpu("h200"))
    assert row.model.num_params == 8_030_261_248 and row.timed and row.setup.dp == 8


def test_report_reads_the_validators_rows():
    """A committed results file as it is: 23 rows of one H200, each predicted at its own host speed."""
    r = CliRunner().invoke(main, ["report", os.path.join(ROOT, "data", "h200-t7-retime-a.csv")])
    assert r.exit_code == 0, r.output
    assert "step time: 21 of 23 rows within 15%" in r.output and "peak allocated: 23 of 23 rows within 3%" in r.output
