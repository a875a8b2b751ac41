"""The committed H200 rows of PEFT LoRA, DoRA and frozen-module jobs (data/lora/, data/README.md) against
the current zerocalc: re-predicted from the model each run recorded (`validate.report.repredict_hf`). The
GPU jobs never run here; their data do."""
import glob

import pytest

pytest.importorskip("pandas")

from validate.report import load, repredict_hf  # noqa: E402

# The three stage-3 LoRA rows at N > 1 (rank 0 of 8) ran before the validator recorded PEFT's calls, which
# stage 3's fetches depend on (`validate.hf_models.SpecRecorder`): their recorded models cannot give their
# all-gathers; the model zerocalc builds from the config alone does (docs/lora.md).
OPEN_COMM = {"auto-qwen2-lora16-h1536-l28-s3-bf16-n8fake-b2x2048-gas1-83c0d1332d",
             "auto-qwen2-lora16-h1536-l28-s3-bf16-n8fake-b2x2048-gas1-f135d2e3ca",
             "auto-qwen2-lora16-h1536-l28-s3-bf16-n8fake-b2x2048-gas1-c72f961a86"}


@pytest.fixture(scope="module")
def rows():
    return repredict_hf(load(sorted(glob.glob("data/lora/*.csv"))))


def test_lora_rows_state_exact_and_comm_exact_but_stage_3_at_scale(rows):
    """34 rows (32 LoRA, DoRA or frozen): every persistent tensor's bytes equal the prediction; every
    logged collective too, but for the three `OPEN_COMM` rows."""
    assert len(rows) >= 34 and rows["key"].str.contains("lora|frozen").sum() >= 32
    assert (rows["now_state_bytes"] == rows["measured_state_bytes"].astype("int64")).all()
    exact = rows["now_comm_bytes"] == rows["measured_comm_bytes"].astype("int64")
    assert set(rows.loc[~exact, "key"]) <= OPEN_COMM
    # from the config: exact with checkpointing, +0.1% without (PEFT's sibling calls taken as one chain)
    s3 = rows[rows["key"].isin(OPEN_COMM) & ~exact]   # the rows run before the calls were recorded
    from_config = s3["pred_comm_bytes"].astype(float) / s3["measured_comm_bytes"].astype(float) - 1
    ckpt = s3["activation_checkpointing"].astype(str) == "True"
    assert len(s3) == 3 and (from_config[ckpt] == 0).all() and (from_config[~ckpt].abs() <= 0.002).all()


def test_stage_3_lora_rows_run_again_are_exact_from_their_recorded_models():
    """Two of the `OPEN_COMM` configurations run again (h200-lora-s3-again-n8.csv), the validator now
    recording PEFT's module calls: their recorded models give the all-gathers to the byte (1,019,213,192 B
    and 914,345,352 B measured), as the model built from the config does."""
    again = repredict_hf(load(["data/lora/h200-lora-s3-again-n8.csv"]))
    assert len(again) >= 2 and set(again["key"]) <= OPEN_COMM | {
        "auto-qwen2-lora64-h1536-l28-s3-bf16-n8fake-b2x2048-gas1-7069d38e23"}
    measured = again["measured_comm_bytes"].astype("int64")
    assert (again["now_comm_bytes"] == measured).all() and (again["pred_comm_bytes"] == measured).all()


def test_lora_rows_peaks_simulated_within_3_and_8_percent(rows):
    """Every row, LoRA, DoRA, frozen or full, dense or MoE, checkpointed or not, at every stage: its
    allocation stream recorded from PEFT's model (`zerocalc.hf.adapted`) and replayed through the
    allocator beside DeepSpeed's side (a later job of a validator process after the jobs before it):
    peak allocated within 3% and reserved within 8% of the measured. Before the stream, reserved was
    the calibrated ratio (19 of the 38 adapted rows within 8%, -12.1% to +17.7%) and the checkpointed
    2-layer Mixtral's allocated the phases' sum (-11.2% at stage 2, -5.4% at stage 3)."""
    pytest.importorskip("peft")
    alloc = (rows["now_peak_allocated_bytes"] / rows["measured_peak_allocated_bytes"].astype(float) - 1).abs()
    resv = (rows["now_peak_reserved_bytes"] / rows["measured_peak_reserved_bytes"].astype(float) - 1).abs()
    assert (alloc <= 0.03).all(), rows.loc[alloc > 0.03, "key"].tolist()
    assert (resv <= 0.08).all(), rows.loc[resv > 0.08, "key"].tolist()
    adapted = rows["key"].str.contains("lora|frozen")
    assert adapted.sum() >= 38 and (~rows.loc[adapted, "activation_checkpointing"].astype(str).eq("True")).sum() >= 14
    mixtral = rows["key"].str.startswith("auto-mixtral")
    assert mixtral.sum() == 4 and (alloc[mixtral] <= 0.001).all()     # checkpointed or not, stage 0, 2 or 3
    # all but three to the tenth of a percent (reserved: OLMoE +3.2%, Mixtral at stage 3 +0.7%, Qwen3 through
    # Trainer at stage 2 with checkpointing +0.3%)
    assert ((alloc <= 0.001) & (resv <= 0.001)).sum() >= len(rows) - 3


def test_each_lora_row_is_simulated(rows):
    """The reserved peak of every adapted row comes from the allocator simulation, none from the ratio."""
    pytest.importorskip("peft")
    from validate import hf_models
    from validate.report import job_from_row, to_zerocalc
    from zerocalc.estimate import estimate
    for _, r in rows.iterrows():
        job = job_from_row(r.to_dict())
        assert estimate(hf_models.traced_spec(job), to_zerocalc(job)[1]).reserved_source == "simulated", r["key"]
