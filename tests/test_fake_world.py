"""The committed fake-world and emulated-card H200 rows against the current zerocalc (data/README.md):
rank 0 of a world of N in one process (`validate run --fake-world`) and smaller cards emulated with a
capped caching allocator (`allocator_capacity_bytes`). The GPU jobs never run here; their data do."""
import pytest

pytest.importorskip("pandas")

import dataclasses  # noqa: E402
import os  # noqa: E402

import pandas as pd  # noqa: E402

from validate.docs import committed_paths  # noqa: E402
from validate.report import committed_rows, load  # noqa: E402
from validate.rows import CONFIG_COLUMNS  # noqa: E402
from zerocalc.training import Stage  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow   # re-predicts every fake-world row (70B and 405B ones among them)


@pytest.fixture(scope="module")
def fake():
    return committed_rows(committed_paths("fake"))


def _err(pred, meas):
    return pred.astype(float) / meas.astype(float) - 1


def test_a_fake_rank_0_of_two_is_the_real_rank_0():
    """The same ten N = 2 configurations (h200-t2-n2-a: the case study's GPT at stages 0-3 in bf16 and fp16,
    the 1.1B Llama) run by real ranks and as rank 0 of a fake world of 2 on the same kind of GPU: state and
    communication bytes identical, peak allocated within 0.01%, reserved within 0.2% (the one 0.14% apart
    is the first job of its process in the real run and a later one in the fake run)."""
    real = load(["data/h200-t2-n2-a.csv"])
    fake = load(["data/h200-fake-t2-n2-a.csv"])
    real, fake = real[real["outcome"] == "ok"], fake[fake["outcome"] == "ok"]
    assert (fake["world"] == "fake").all() and "world" not in real
    on = [c for c in CONFIG_COLUMNS if c != "key" and c in real and c in fake]
    both = real.astype({c: str for c in on}).merge(fake.astype({c: str for c in on}), on=on, suffixes=("_r", "_f"))
    assert len(both) == 10
    for col in ("measured_state_bytes", "measured_comm_bytes", "measured_comm_by_op", "measured_state_detail"):
        assert (both[col + "_r"] == both[col + "_f"]).all(), col
    alloc = _err(both["measured_peak_allocated_bytes_f"], both["measured_peak_allocated_bytes_r"]).abs()
    reserved = _err(both["measured_peak_reserved_bytes_f"], both["measured_peak_reserved_bytes_r"]).abs()
    assert alloc.max() < 1e-4 and reserved.max() < 0.002


def _at_scale(rows):
    """The fake-world rows at N >= 8 (the capped runs are the card files', judged below)."""
    return rows[rows["nproc"].astype(int) >= 8]


def test_rows_at_scale_state_and_communication_exact(fake):
    rows = _at_scale(fake)
    assert (rows["now_state_bytes"] == rows["measured_state_bytes"].astype("int64")).all()
    assert (rows["now_comm_bytes"] == rows["measured_comm_bytes"].astype("int64")).all()
    assert set(rows["nproc"].astype(int)) >= {8, 16, 64, 256, 1024}
    assert rows["num_params"].astype(float).max() > 60e9


# Open (docs/scale.md): jobs whose runs reserved different amounts, one under-predicted by more than 8%.
# The replay frees a released gathered parameter when the host releases it; the GPU returns its block once
# the kernels using it are done, and where the host has run ahead by then the next gather takes a new
# segment (the 405B's allocator history, data/snapshots/fake-405b/, shows the frees; which step grows
# reserved is the run's timing). Llama-2-70B at N = 256 (1 x 4096): 19.87 and 20.80 GiB beside other jobs
# on the GPU, 20.23 alone (-4.6%, -8.9%, -6.3%); Llama-3.1-405B's shape at N = 1,024 (1 x 1024): 27.01 and
# 28.63 GiB, -6.0% and -11.4%. Each key: the worst under-prediction allowed.
OPEN_RESERVED = {"hf-llama-h8192-l80-s3-bf16-n256fake-b1x4096-gas1-3600880dbc": 0.10,
                 "hf-llama-h16384-l126-s3-bf16-n1024fake-b1x1024-gas1-d2de94cfaa": 0.12}


def test_rows_at_scale_peaks_within_3_and_8_percent(fake):
    """Fake-world rows at N >= 8: peak allocated within 3% on every row; reserved within 8% on every
    row but one run of each `OPEN_RESERVED` job (under-predicted, within its bound; its other runs within 8%)."""
    rows = _at_scale(fake)
    alloc = _err(rows["now_peak_allocated_bytes"], rows["measured_peak_allocated_bytes"]).abs()
    reserved = _err(rows["now_peak_reserved_bytes"], rows["measured_peak_reserved_bytes"])
    open_ = rows["key"].isin(OPEN_RESERVED)
    assert len(rows) >= 123 and (alloc <= 0.03).all(), rows.loc[alloc > 0.03, "key"].tolist()
    assert (reserved[~open_].abs() <= 0.08).all(), rows.loc[~open_ & (reserved.abs() > 0.08), "key"].tolist()
    for key, bound in OPEN_RESERVED.items():
        runs = reserved[rows["key"] == key]
        assert len(runs) >= 2 and ((runs < 0) & (runs >= -bound)).all() and (runs.abs() > 0.08).sum() == 1, key


def test_each_open_job_alone_on_the_gpu_is_within_8_percent():
    """Every job with a run outside 8% reserved (`OPEN_RESERVED`, test_committed_data.py's `OPEN_HF_STAGE3`)
    ran those runs beside other jobs on the GPU; run alone, each reserved within 8% of zerocalc: the 70B
    at N = 256 20.23 GiB, the 405B at N = 1,024 27.01, Mixtral-8x7B at N = 256 17.72 (the H200's three
    launches; under its other key, zero_weights off, 17.72 on an H100, 19.47 beside other jobs)."""
    pytest.importorskip("torch")
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row
    from zerocalc.estimate import estimate
    alone = load([os.path.join(ROOT, "data", f) for f in (
        "h200-fake-alone-n256.csv", "h100-fake-alone-405b-n1024.csv", "h200-hf-fake6-mixtral-8x7b-alone-n256.csv",
        "h100-hf-fake-mixtral-8x7b-random-alone-n256.csv")])
    keys = set(OPEN_RESERVED) | {"auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-11914a3414",
                                 "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-7cd9959c72"}
    assert set(alone["key"]) == keys and (alone["outcome"] == "ok").all()
    for key, runs in alone.groupby("key"):
        job = job_from_row(runs.iloc[0].to_dict())
        spec, setup = to_zerocalc(job)
        e = estimate(hf_models.traced_spec(job) if job.get("hf") else spec, setup)
        err = e.peak_reserved_bytes / runs["measured_peak_reserved_bytes"].astype(float) - 1
        assert (err.abs() <= 0.08).all(), (key, err.tolist())


def _reserved_on_time_and_late(spec, setup) -> tuple[int, int]:
    """Rank 0's reserved peak replayed with the all-gather stream's frees on time and 4 allocations late
    (`fits.late_frees`, the first late timing `fits` replays), three steps, a fresh process."""
    from zerocalc import fits, sequence
    pieces = list(sequence.step_pieces(spec, setup, rank=0))
    return tuple(sequence.replay_steps(iter(fits.late_frees(pieces, d) if d else pieces)).peak_reserved_bytes
                 for d in (0, 4))


def test_stage3_reserved_at_scale_lies_between_on_time_and_late_frees():
    """Every stage-3 row at N >= 8 (the fake-world files and the HF configs' fake-world rows, the open runs
    among them): measured reserved within 8% of the band between the replay with the all-gather
    stream's frees on time and the one with them 4 allocations late (either can be the larger: late
    frees pack some jobs tighter). Which the run gets is its timing: the open runs (`OPEN_RESERVED`,
    test_committed_data.py's `OPEN_HF_STAGE3`) sit near the late replay (-3.6% to +0.3%), their twins
    near the on-time one (Mixtral's 17.72 GiB runs: -6.2% on time, +9.5% and +14.5% late)."""
    pytest.importorskip("torch")
    import glob
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row
    hf_fake = sorted(glob.glob(os.path.join(ROOT, "data", "h200-hf-fake*.csv")))
    rows = load(committed_paths("fake") + hf_fake)
    rows = rows[(rows["outcome"] == "ok") & (rows["stage"].astype(int) == 3) & (rows["nproc"].astype(int) >= 8)]
    assert len(rows) >= 96
    band = {}
    for _, r in rows.iterrows():
        if r["key"] not in band:
            job = job_from_row(r.to_dict())
            spec, setup = to_zerocalc(job)
            band[r["key"]] = _reserved_on_time_and_late(hf_models.traced_spec(job) if "hf" in job else spec, setup)
        on_time, late = band[r["key"]]
        measured = float(r["measured_peak_reserved_bytes"])
        assert min(on_time, late) * 0.92 <= measured <= max(on_time, late) * 1.08, (r["key"], on_time, measured, late)


def test_estimate_explains_reserved_with_late_frees():
    """`estimate --explain` quotes stage 3's reserved at N > 1 with the all-gather stream's frees four
    allocations late beside the on-time column. Mixtral-8x7B at N = 256 (1 x 4096, checkpointed) reserved
    17.72 GiB in two runs and 19.47-20.13 GiB in three; of the two runs with histories
    (data/h200-hf-fake5-mixtral-8x7b-*.csv), the column is within 8% of the 17.72 GiB one, the late figure
    within 8% of the 20.13 GiB one. Stage 2, or one rank, has none."""
    pytest.importorskip("torch")
    from click.testing import CliRunner
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row
    from zerocalc.cli import main
    from zerocalc.estimate import estimate
    rows = load([os.path.join(ROOT, "data", f) for f in ("h200-hf-fake5-mixtral-8x7b-hist-n256.csv",
                                                         "h200-hf-fake5-mixtral-8x7b-warmup-n256.csv")])
    job = job_from_row(rows.iloc[0].to_dict())
    e = estimate(hf_models.traced_spec(job), to_zerocalc(job)[1])
    low, high = sorted(rows["measured_peak_reserved_bytes"].astype(float))
    assert (low, high) == (19027460096, 21611151360)      # 17.72 and 20.13 GiB
    assert abs(e.peak_reserved_bytes / low - 1) <= 0.08 and abs(e.peak_reserved_late_bytes / high - 1) <= 0.08
    assert estimate(e.model, dataclasses.replace(e.setup, stage=Stage.GRADIENTS)).peak_reserved_late_bytes is None
    assert estimate(e.model, dataclasses.replace(e.setup, dp=1)).peak_reserved_late_bytes is None
    args = ["estimate", "--model", "mixtral-8x7b", "--dp", "256", "--stage", "3", "--micro-batch", "1", "--seq-len",
            "4096", "--activation-checkpointing", "--zero-init"]
    explained = CliRunner().invoke(main, args + ["--explain"]).output
    assert "allocations late" in explained and "allocations late" not in CliRunner().invoke(main, args).output


def test_the_verdict_on_an_emulated_card_is_the_allocator_s():
    """Cards of 24, 40, 48, 80 and 94 GB emulated on the H200 and (24-80 GB) the H100 (the caching
    allocator capped at the card less the CUDA context), each configuration chosen within 2-10% of
    zerocalc's boundary for its card before it ran (validate/matrices/h200-cards-chosen.json, all 40 run;
    four run again, three of them with their allocator's history: h200-cards-repeat-n64, -again-*; thirteen
    of h200-cards-chosen-2.json, 1B-70B shapes at N = 8-256, GAS 1 and 2, on the H100; three of
    h200-cards-chosen-3.json, published HF configs judged on their trace, all eleven on the H100, two of
    them twice; h100-cards-chosen-4.json, fifteen Hub config.json files new to the cards, one three times,
    once under transformers 5.25; h100-late-predicted.json, seven runs of four stage-3 jobs capped between
    zerocalc's reserved and their own unpressured one; h100-cards-chosen-5.json, thirteen Hub config.json files
    more under transformers 5.25, the fourteenth, BLOOM-3B, refused by the validator): none that zerocalc says
    fits ran out; twenty-two of them ran with the allocator's retries. A job near its card is replayed over
    `fits.CARD_STEPS` steps at every stage: DeepSeek-V2-Lite at stage 1 on the 80 GB card ran out in step 3
    under transformers 5.17 (twice) and in step 4 under 5.25; over three steps its replay had run.
    A fake world runs one rank, and its row is judged on that rank's replay (`report.card_verdicts`; the
    busiest ranks of two configurations ran too, h100-cards-ranks-*: tests/test_fake_ranks.py). Where
    every timing of stage 3's late frees (`zerocalc.fits.GATHER_FREE_DELAYS`) and both placements of the
    segments made after a retry (`zerocalc.allocator.PLACEMENTS`) agree, the verdict fits / NO (GPU) is
    whether the job raised OutOfMemoryError (92 of 92). Where they disagree the verdict is NO: eight such
    8B stage-3 configurations ran out in nine runs and ran in six, three of them both ways in their runs;
    the 8B shape at stage 1 as rank 5 of 8 (runs only where the new segments go into the freed ranges)
    ran out in its three runs; of the capped jobs GPT-OSS at 34 GiB and Llama-2-70B at N = 256 at 17.5
    ran (21 and 26 retries), Mixtral-8x7B at N = 256 at 16 ran out beside them and ran alone, as did it at
    17 GiB and the 70B at 16.5."""
    from validate.report import card_verdicts
    rows = load(committed_paths("cards"))
    verdicts = card_verdicts(rows)
    assert len(verdicts) >= 113 and set(verdicts["card_gib"]) >= {24, 40, 48, 80, 94}
    assert len(load([p for p in committed_paths("cards") if "/h100-cards-" in p])) >= 25
    assert rows["hf_config"].fillna("").astype(str).str.len().gt(0).sum() >= 12    # published configs
    assert verdicts["predicted_fits"].sum() >= 10 and (~verdicts["predicted_fits"]).sum() >= 10
    retried = pd.to_numeric(verdicts["retries"], errors="coerce").fillna(0) > 0
    assert (retried & verdicts["predicted_fits"]).sum() >= 22
    assert (verdicts["fits_source"] == "allocator").all()
    ran_out = verdicts["outcome"] == "oom"
    assert not (verdicts["predicted_fits"] & ran_out).any(), verdicts[verdicts["predicted_fits"] & ran_out].to_string()
    decided = verdicts[~verdicts["timing_dependent"]]
    assert len(decided) >= 92 and decided["agrees"].all(), decided[~decided["agrees"]].to_string()
    either = verdicts[verdicts["timing_dependent"]]
    assert not either["predicted_fits"].any() and set(either["outcome"]) == {"ok", "oom"}
    assert (either.groupby("key")["outcome"].nunique() == 2).sum() >= 3     # the same job, both outcomes
