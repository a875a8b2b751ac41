"""LoRA (PEFT 0.21) and frozen modules under real DeepSpeed 0.19.8 on two CPU ranks (gloo, DeepSpeed's
own launcher): validate/matrices/cpu-lora.json's seven jobs, directly and through HF Trainer, stages 0-3,
zero.Init, optimizer offload, gradient accumulation, DoRA, PEFT's `bias="all"`. Every persistent tensor
and every logged collective equals zerocalc's prediction to the byte; and what zerocalc builds from the
config alone (`adapters` on the traced profile, what `estimate --hf-config --lora-rank` reads) is the
tensor list the run recorded. About 45 s on two cores."""
import json
import shutil

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("peft")
if shutil.which("deepspeed") is None:
    pytest.skip("DeepSpeed's launcher is not on PATH", allow_module_level=True)

from test_against_deepspeed import run_validate  # noqa: E402  (the same launch: bytes-only steps, every row ok)

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


def assert_exact(df):
    """State and communication bytes, as predicted at run time and now, equal to the measured."""
    from validate.report import repredict
    now = repredict(df)
    for pred, meas in (("predicted_state_bytes", "measured_state_bytes"), ("predicted_comm_bytes", "measured_comm_bytes"),
                       ("now_state_bytes", "measured_state_bytes"), ("now_comm_bytes", "measured_comm_bytes")):
        bad = now[now[pred] != now[meas]]
        assert bad.empty, bad[["key", pred, meas]].to_string()


def test_lora_and_frozen_jobs_exact(tmp_path):
    from validate import hf_models
    from validate.rows import job_from_row
    from zerocalc import adapters
    from zerocalc.hf import trace
    df = run_validate(tmp_path, "--nproc", "2", "--matrix", "validate/matrices/cpu-lora.json")
    assert len(df) == 7 and set(df["stage"]) == {0, 1, 2, 3} and set(df["path"]) == {"engine", "trainer"}
    assert_exact(df)
    for _, row in df.iterrows():
        job = job_from_row(row.to_dict())
        traced = trace.trace(job["hf"]["config"], "tiny-qwen2", activations=False, steps=False)
        ours = adapters.spec(traced, hf_models.lora_of(job), tuple(job.get("freeze") or ()),
                             wrapper=job["path"] == "engine")
        recorded = job["hf_spec"]
        assert list(ours.param_numels) == recorded["param_numels"], row["key"]
        assert list(ours.trainable) == recorded["trainable"], row["key"]
        assert list(ours.wide or [False] * len(ours.param_numels)) == recorded.get("fp32", [False] * len(
            ours.param_numels)), row["key"]
    # LoRA trains a small part: the tiny Qwen2's 138,304 parameters stay, frozen
    lora = df[df["lora"].fillna("").str.startswith("{")]
    assert len(lora) == 5 and all(json.loads(s)["r"] in (4, 8) for s in lora["lora"])


def test_stage3_lora_fake_world_exact(tmp_path):
    """Stage 3 at N = 8 (rank 0 of a fake world) with prefetch, reuse and live limits near a layer's size,
    so that what DeepSpeed releases and gathers again matters: validate/matrices/cpu-lora-s3-fake.json.
    Every row's state and communication, from the calls the run recorded, to the byte (a LoRA run with
    checkpointing gathers each frozen base weight again after its layer's recomputation; the wrappers
    and dropouts PEFT adds are prefetch steps; lora.Linear fetches lora_A's weight). zerocalc's own
    prediction from the config (`adapters` on the traced profile) is exact too, but for LoRA without
    checkpointing: its calls' grad flags treat sibling calls as one chain (k_proj's input as if it came
    from q_proj's adapter), so it puts layer 0's k/v base layers in backward, where DeepSpeed's hook
    never fires (their inputs and weights need no grad)."""
    from validate.report import repredict_hf
    df = run_validate(tmp_path, "--nproc", "8", "--fake-world", "--matrix", "validate/matrices/cpu-lora-s3-fake.json")
    assert len(df) == 6 and set(df["activation_checkpointing"]) == {True, False}
    assert_exact(df)
    now = repredict_hf(df)
    lora = now["lora"].fillna("").str.startswith("{")
    modelled = now[~lora | now["activation_checkpointing"]]
    assert len(modelled) == 4
    assert (modelled["pred_comm_bytes"] == modelled["measured_comm_bytes"]).all(), \
        modelled[["key", "pred_comm_bytes", "measured_comm_bytes"]].to_string()
    # with LoRA, checkpointing adds all-gathers: each layer's frozen weights are gathered again in backward
    by = {(r["lora"], r["activation_checkpointing"]): r["measured_comm_bytes"] for _, r in df[lora].iterrows()}
    assert len(by) == 4 and all(by[(lo, True)] > by[(lo, False)] for lo, _ in by)
