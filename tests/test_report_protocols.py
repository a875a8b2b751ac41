"""The report's bookkeeping of timing protocols and repeats, on rows built by hand."""
import json
import math

import pytest

pd = pytest.importorskip("pandas")

from validate.report import step_range, timed_whole_steps  # noqa: E402
from validate.rows import make_row  # noqa: E402
from validate.jobs import make_job  # noqa: E402
from zerocalc.arch import Architecture  # noqa: E402


def test_only_rows_with_whole_step_times_are_timed_as_training_runs():
    df = pd.DataFrame({"measured_step_times_s": ["[0.1, 0.3, 0.2]", "[]", None, float("nan")]})
    assert list(timed_whole_steps(df)) == [True, False, False, False]
    assert list(timed_whole_steps(pd.DataFrame({"x": [1]}))) == [False]   # files written before the column


def test_step_range_is_the_fastest_and_slowest_timed_step():
    r = step_range(pd.DataFrame({"measured_step_times_s": ["[0.12, 0.10, 0.15]", ""]}))
    assert r["fastest"].iloc[0] == 0.10 and r["slowest"].iloc[0] == 0.15
    assert r["fastest"].isna().iloc[1]


def _result(probe):
    rank = {"outcome": "ok", "rank": 0, "losses": [2.0, 1.0], "comm": {}, "param_tensors": 1, "sharded_param_tensors": 0,
            "state": {"total_bytes": 10, "scalar_bytes": 0, "by_device": {"cuda": 10}, "by_path": {}},
            "step_s": 0.2, "step_times_s": [0.2, 0.25], "probe": probe,
            "memory": {"phases": {"init": {"peak_allocated": 5, "peak_reserved": 6, "end_allocated": 4},
                                  "first_step": {"peak_allocated": 8, "peak_reserved": 9, "end_allocated": 7}},
                       "phase_seconds": {"forward": 0.05, "backward": 0.1, "step": 0.04},
                       "device_used_bytes": 3, "reserved_now": 1, "peak_allocated": 8, "peak_reserved": 9,
                       "alloc_retries": 0, "base_allocated": 0}}
    return {"key": "k", "world_size": 1, "ranks": [rank], "env": {"gpu": "NVIDIA H200"}}


def test_machine_probe_lands_in_its_columns_in_microseconds_and_tflops():
    job = make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 1, stage=0, seq_len=8)
    row = make_row(job, _result({"launch_s": 7.5e-6, "matmul_flops_per_s": 7.9e14}), "cuda", "cmd")
    assert row["measured_launch_us"] == 7.5 and row["measured_matmul_tflops"] == 790.0
    assert json.loads(row["measured_step_times_s"]) == [0.2, 0.25]
    assert row["measured_init_reserved_bytes"] == 6 and row["measured_first_step_reserved_bytes"] == 9
    assert row["measured_first_step_peak_bytes"] == 8 and "measured_forward_reserved_bytes" not in row
    row = make_row(job, _result({}), "cuda", "cmd")   # off CUDA the probe is empty: no columns
    assert "measured_launch_us" not in row


def test_where_each_timed_steps_host_time_went_lands_in_a_column_per_counter():
    job = make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 1, stage=0, seq_len=8)
    result = _result({})
    result["ranks"][0].update(step_host_s=[0.15, 0.2], step_counters=[
        {"runq_s": 0.001, "steal_s": 0.02, "gc_s": 0.0, "sm_mhz": 1980},
        {"runq_s": 0.004, "steal_s": 0.0, "gc_s": 0.003, "sm_mhz": None}])
    result["env"]["cpus"] = "8 of 16"
    row = make_row(job, result, "cuda", "cmd")
    assert json.loads(row["measured_step_host_s"]) == [0.15, 0.2]
    assert json.loads(row["measured_step_runq_s"]) == [0.001, 0.004]
    assert json.loads(row["measured_step_steal_s"]) == [0.02, 0.0]
    assert json.loads(row["measured_step_gc_s"]) == [0.0, 0.003]
    assert "measured_step_sm_mhz" not in row          # one step without a clock reading: none written
    assert row["cpus"] == "8 of 16"


def test_a_rows_host_speed_is_the_median_of_its_per_step_probes_and_only_those():
    from validate.rows import at_row_host, measured_host_launch_s
    row = {"measured_step_issue_us": "[8.0, 12.0, 9.0]", "measured_launch_us": 20.0}
    assert measured_host_launch_s(row) == pytest.approx(9e-6)
    # the single probe before the timed steps is not used: the host's speed moves between it and them
    assert measured_host_launch_s({"measured_launch_us": 20.0}) is None
    assert measured_host_launch_s({"measured_step_issue_us": float("nan")}) is None
    cal = {"time": {"host_launch_s_fitted": 9e-6}}
    assert at_row_host(cal, row)["time"] == {"host_launch_s_fitted": 9e-6, "host_launch_s": pytest.approx(9e-6)}
    assert at_row_host(cal, {}) is cal


def test_reserved_growth_names_the_last_phase_that_grew_the_cache():
    from validate.report import RESERVED_ORDER, reserved_growth
    MiB = 2**20
    grows = {  # reserved at the end of each phase, MiB, in RESERVED_ORDER
        "set in the first forward": [100, 900, 900, 900, 900, 900, 900],
        "set in the first step": [100, 900, 901, 1200, 1200, 1200, 1200],   # +1 MiB is one small segment: not growth
        "grew in a measured backward": [100, 900, 900, 900, 900, 950, 950],
    }
    df = pd.DataFrame([{f"measured_{p}_reserved_bytes": v * MiB for p, v in zip(RESERVED_ORDER, vals)}
                       for vals in grows.values()])
    blank, line = reserved_growth(df)
    assert line == ("Reserved peak set by (last phase that grew the cache), 3 rows: first_forward 1, first_step 1, "
                    "backward 1; grown after the warm-up step: 1")
    assert reserved_growth(df.drop(columns="measured_init_reserved_bytes")) == []


def test_a_configuration_timed_in_several_jobs_is_judged_by_the_median_of_its_jobs():
    from validate.report import by_configuration
    arch = Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False)
    jobs = [make_job(arch, 1, stage=0, seq_len=8, repeat=i) for i in range(3)] + [make_job(arch, 1, stage=2, seq_len=8)]
    assert len({j["key"] for j in jobs}) == 4                     # a repeat is its own row...
    rows = pd.DataFrame([make_row(j, _result({}), "cuda", "cmd") for j in jobs])
    rows["measured_step_s"] = [0.30, 0.10, 0.20, 0.50]
    rows["now_step_s"] = [0.21, 0.21, 0.21, 0.40]
    confs = by_configuration(rows).sort_values("stage").reset_index(drop=True)
    assert list(confs["jobs"]) == [3, 1]                          # ...of one configuration
    assert list(confs["measured_step_s"]) == [0.20, 0.50]         # the median of 0.30, 0.10, 0.20
    assert list(confs["now_step_s"]) == [0.21, 0.40]


def test_a_true_flag_read_back_from_a_set_of_files_keeps_its_value(tmp_path):
    """overlap_comm is empty in the older files and true in a new one: pandas reads the concatenated
    column as 1.0 and NaN, which must give True and DeepSpeed's default (None), not False."""
    from validate.report import load
    from validate.rows import job_from_row
    arch = dict(family="seed-gpt", vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                ffn_hidden_size=256, tie_embeddings=False, max_positions=64)
    base = dict(key="k", backend="cpu", nproc=2, stage=1, optimizer="adamw", outcome="ok", measured_state_bytes=1,
                measured_comm_bytes=0, **arch)
    pd.DataFrame([{**base, "overlap_comm": ""}]).to_csv(tmp_path / "old.csv", index=False)
    pd.DataFrame([{**base, "key": "k2", "overlap_comm": True}]).to_csv(tmp_path / "new.csv", index=False)
    rows = load([str(tmp_path / "old.csv"), str(tmp_path / "new.csv")])
    assert rows["overlap_comm"].tolist()[1] == 1.0                 # what pandas makes of it
    old, new = (job_from_row(r.to_dict()) for _, r in rows.iterrows())
    assert old["overlap_comm"] is None and new["overlap_comm"] is True


def test_how_many_repeated_jobs_one_prediction_per_configuration_can_reach():
    """Jobs of 100, 110 and 160 ms: within 15% of a value v means 85 <= v <= 115, 93.5 <= v <= 126.5
    and 136 <= v <= 184; no v is in all three, two overlap (93.5-115): the best is 2 of 3. The model's
    105 ms is within 15% of 100 and 110 (+5%, -4.5%), not of 160 (-34%): 2. A configuration timed once
    is left out."""
    from validate.report import reachable_rows
    arch = Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False)
    jobs = [make_job(arch, 1, stage=0, seq_len=8, repeat=i) for i in range(3)] + [make_job(arch, 1, stage=2, seq_len=8)]
    rows = pd.DataFrame([make_row(j, _result({}), "cuda", "cmd") for j in jobs])
    rows["measured_step_s"] = [0.100, 0.110, 0.160, 0.500]
    rows["now_step_s"] = [0.105, 0.105, 0.105, 0.100]
    assert reachable_rows(rows) == (3, 2, 2)
    rows["measured_step_s"] = [0.100, 0.110, 0.120, 0.500]      # 102-115 covers all three
    assert reachable_rows(rows) == (3, 3, 3)


def test_each_steps_host_speed_is_the_slower_ranks():
    """Two ranks probed 8 and 12 us before the first step, 10 and 9 before the second: the row keeps
    12 and 10 (each step waits for the slower host in its collectives); their Python probes likewise. A rank without probes (off
    CUDA) leaves the column out rather than half filled."""
    job = make_job(Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False), 2, stage=1, seq_len=8)
    result = _result({})
    second = {**result["ranks"][0], "rank": 1}
    result["ranks"][0]["host_issue_s"], second["host_issue_s"] = [8e-6, 10e-6], [12e-6, 9e-6]
    result["ranks"][0]["host_python_s"], second["host_python_s"] = [0.25e-6, 0.5e-6], [0.75e-6, 0.125e-6]
    result["ranks"].append(second)
    row = make_row(job, result, "cuda", "cmd")
    assert json.loads(row["measured_step_issue_us"]) == [12.0, 10.0]
    assert json.loads(row["measured_step_python_us"]) == [0.75, 0.5]        # the Python probe: the same rule
    assert "main thread" not in row["cpus"]
    result["ranks"][0]["main_cpu"] = second["main_cpu"] = 15                 # VALIDATE_PIN_CPUS=main
    result["env"] = {"cpus": "16 of 16"}
    assert make_row(job, result, "cuda", "cmd")["cpus"] == "16 of 16, main thread alone on CPU 15"
    assert json.loads(row["measured_step_issue_by_rank_us"]) == [[8.0, 10.0], [12.0, 9.0]]   # each rank's, kept
    second["host_issue_s"] = None
    assert "measured_step_issue_us" not in make_row(job, result, "cuda", "cmd")


def test_every_job_of_a_configuration_falls_on_the_same_side_of_the_held_out_split():
    """The split is by what ran, not by the key: repeats (other keys), and the same job run with the
    other allocator, share a side; across 400 configurations about a quarter are held out (a binomial
    100 +- 8.7: the bounds are 3 standard deviations)."""
    from validate.fit import held_out
    arch = Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False)
    shapes = [(n, s, q, b) for n in (1, 2, 4, 8, 16) for s in range(4) for q in (8, 16, 32, 64, 128) for b in (1, 2, 4, 8)]
    rows = [make_row(make_job(arch, n, stage=s, seq_len=q, micro_batch=b), _result({}), "cuda", "cmd")
            for n, s, q, b in shapes]
    for (n, s, q, b), row in list(zip(shapes, rows))[:20]:
        again = make_row(make_job(arch, n, stage=s, seq_len=q, micro_batch=b, repeat=3), _result({}), "cuda", "cmd")
        assert again["key"] != row["key"]
        assert held_out(again) == held_out(row) == held_out({**row, "expandable_segments": True})
    assert 74 <= sum(held_out(r) for r in rows) <= 126


def test_the_calibrations_accuracy_counts_configurations_by_the_median_of_their_jobs():
    """Configuration a: three jobs measured 0.8, 0.9 and 2.0 s, each predicted 1.0: the median job is
    0.9, 11% off, within 15% (their mean, 1.23, would be 19% off). Configuration b: one job, 1.5 s,
    predicted 2.0: 33% off. So 1 of 2."""
    from validate.fit import configurations_within
    assert configurations_within(["a", "a", "a", "b"], [1.0, 1.0, 1.0, 2.0], [0.8, 0.9, 2.0, 1.5]) == (2, 1)
    assert configurations_within(["a", "a", "a", "b"], [1.0, 1.0, 1.0, 1.6], [0.8, 0.9, 2.0, 1.5]) == (2, 2)


def test_a_constant_a_fold_fitted_to_zero_has_no_spread():
    from validate.fit import _spread
    assert _spread([2.0, 4.0, 3.0]) == " 2.00"           # 4 / 2
    assert _spread([0.0, 0.09]) == "    -"               # a share fitted to 0 in one fold: no ratio


def test_a_perfect_models_count_per_configuration_by_hand():
    """Two configurations of two jobs each, 100 and 200 ms: each job is ln(2)/2 = 0.347 from its
    configuration's mean log time, sqrt(2 / 1) times that in the pool: ±0.490. A median of two draws
    is +0.490 (both +), -0.490 (both -) or 0 (one of each): the perfect model is within 15% only in the
    last case, half the time. So each configuration is within with p = 1/2: the count is 0, 1 or 2 with
    probability 1/4, 1/2, 1/4; expected 1, P(all) = 1/4, 5th percentile 0, 95th 2. A configuration of
    one job adds nothing to the pool but is counted (one draw: never 0, p = 0)."""
    from validate.report import by_configuration, jobs_log_deviation, perfect_model_floor
    arch = Architecture("seed-gpt", 64, 32, 2, 4, 4, 128, False)
    jobs = [make_job(arch, 1, stage=s, seq_len=8, repeat=i) for s in (0, 2) for i in range(2)]
    rows = pd.DataFrame([make_row(j, _result({}), "cuda", "cmd") for j in jobs])
    rows["measured_step_s"] = [0.100, 0.200, 0.100, 0.200]
    rows["now_step_s"] = 0.15
    pool = jobs_log_deviation(rows)
    assert sorted(pool) == pytest.approx([-math.log(2) / math.sqrt(2)] * 2 + [math.log(2) / math.sqrt(2)] * 2)
    f = perfect_model_floor(by_configuration(rows), pool, draws=100_000)
    assert f["within_by_jobs"][2] == pytest.approx(0.5, abs=0.006)     # 4 standard errors of 100,000 draws
    assert f["expected"] == pytest.approx(1.0, abs=0.012)
    assert f["all"] == pytest.approx(0.25, abs=0.006)
    assert (f["p05"], f["p95"]) == (0, 2)
    one = make_row(make_job(arch, 1, stage=1, seq_len=8), _result({}), "cuda", "cmd")
    rows = pd.concat([rows, pd.DataFrame([{**one, "measured_step_s": 0.3, "now_step_s": 0.3}])], ignore_index=True)
    assert len(jobs_log_deviation(rows)) == 4
    f = perfect_model_floor(by_configuration(rows), jobs_log_deviation(rows), draws=100_000)
    assert f["within_by_jobs"][1] == 0.0 and f["expected"] == pytest.approx(1.0, abs=0.012) and f["all"] == 0.0
