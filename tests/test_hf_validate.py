"""The validator trains any HF config.json (validate/hf_models.py): directly and through HF Trainer with
the HF docs' "auto" ds_configs (validate/hf_configs/ds/). Expected values are worked out by hand below."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("the validate extra (torch, transformers) is not installed", allow_module_level=True)

from validate import hf_models  # noqa: E402
from validate.jobs import make_hf_job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Qwen2 (a family zerocalc has no transcription of) small enough for a CPU launch: hidden 64, 2 layers,
# 4 heads of 16, 2 KV heads, FFN 128, vocabulary 1000, tied embeddings.
TINY_QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 64, "tie_word_embeddings": True}
# Its parameters by hand: embedding 1000·64 = 64,000 (the head is tied to it); per layer q 64·64 + 64
# (Qwen2's q/k/v have biases) = 4,160, k and v 64·32 + 32 = 2,080 each, o 64·64 = 4,096, gate/up/down
# 3·64·128 = 24,576, two RMSNorms 2·64 = 128: 37,120; final norm 64.
P = 64_000 + 2 * 37_120 + 64                                   # 138,304
ROTARY_BUFFER_BYTES = 2 * (16 // 2) * 4                        # inv_freq and original_inv_freq, head_dim/2 fp32 each


def test_trainer_auto_values_as_hf_fills_them():
    # transformers' trainer_config_finalize: reduce_bucket_size h², stage3_prefetch_bucket_size int(0.9·h²),
    # stage3_param_persistence_threshold 10·h; what the docs' file fixes stays (stage 2: 2e8).
    z3 = hf_models.resolve_auto(hf_models.load_ds_config("zero3-auto"), 64)
    assert (z3["stage"], z3["reduce_bucket_size"], z3["prefetch_bucket_size"], z3["param_persistence_threshold"]) == \
        (3, 4096, 3686, 640)
    assert z3["zero_init"] and z3["offload_optimizer"] == z3["offload_param"] == "none" and z3["overlap_comm"]
    z2 = hf_models.resolve_auto(hf_models.load_ds_config("zero2-auto-offload"), 64)
    assert (z2["stage"], z2["reduce_bucket_size"], z2["offload_optimizer"]) == (2, 200_000_000, "cpu")
    z3o = hf_models.resolve_auto(hf_models.load_ds_config("zero3-auto-offload"), 2048)
    assert (z3o["offload_param"], z3o["reduce_bucket_size"], z3o["param_persistence_threshold"]) == ("cpu", 2048**2, 20480)


def test_a_job_records_the_config_it_builds():
    job = make_hf_job({"config": "mixtral-8x7b", "overrides": {"num_hidden_layers": 2, "num_local_experts": 4}}, 1,
                      stage=3)
    assert job["hf"]["config"]["num_hidden_layers"] == 2 and job["hf"]["config"]["num_local_experts"] == 4
    assert job["hf"]["config"]["hidden_size"] == 4096                       # the rest as published
    assert (job["hf"]["num_experts"], job["hf"]["experts_per_token"]) == (4, 2)
    assert job["arch"]["family"] == "auto-mixtral" and job["arch"]["num_kv_heads"] == 8
    assert job["zero_init"] and job["path"] == "engine"
    trainer = make_hf_job({"config": "qwen2.5-0.5b"}, 1, path="trainer", ds_config="zero3-auto")
    assert trainer["stage"] == 3 and trainer["reduce_bucket_size"] == 896**2 and "trainer" in trainer["key"]
    with pytest.raises(ValueError, match="disagree"):
        make_hf_job({"config": "qwen2.5-0.5b"}, 1, path="trainer", ds_config="zero3-auto", stage=2)
    with pytest.raises(ValueError, match="no HF config"):
        make_hf_job({"config": "no-such-model"}, 1)


@pytest.mark.slow   # builds three models (meta device): ~3 s of imports
def test_moe_blocks_are_the_stage3_leaves():
    import torch
    from transformers import AutoModelForCausalLM
    found = {}
    for cfg in ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
                {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "shared_expert_intermediate_size": 64},
                {"model_type": "qwen2"}):
        small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 100, **cfg}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_models.make_config(small))
        found[cfg["model_type"]] = [c.__name__ for c in hf_models.moe_block_classes(model)]
    assert found == {"mixtral": ["MixtralSparseMoeBlock"], "qwen2_moe": ["Qwen2MoeSparseMoeBlock"], "qwen2": []}


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="DeepSpeed's launcher is not on PATH")
def test_direct_and_trainer_paths_on_cpu(tmp_path):
    """One CPU launch (one rank) of the tiny Qwen2 at stage 3: directly (zero.Init through
    HfDeepSpeedConfig) and through HF Trainer with the docs' zero3 "auto" config. By hand, at N = 1 stage 3
    holds bf16 parameters 2P, fp32 master 4P, Adam 8P, bf16 gradient partitions 2P = 16P, plus the
    reduce bucket of 2 bytes x reduce_bucket_size (5e8 by default; the Trainer's "auto" h² = 4096) and
    the rotary buffers; one step reduce-scatters the bf16 gradients (2P) and all-reduces the fp64 norm."""
    pytest.importorskip("accelerate")
    matrix = tmp_path / "m.json"
    common = {"seq_len": [16], "micro_batch": [2], "timed_steps": [1]}
    matrix.write_text(json.dumps({"nproc": 1, "hf_models": [{"config": TINY_QWEN2}], "hf_axes": [
        {"stage": [3], **common}, {"path": ["trainer"], "ds_config": ["zero3-auto"], **common}]}))
    out = tmp_path / "rows.csv"
    proc = subprocess.run([sys.executable, "-m", "validate", "run", "--backend", "cpu", "--nproc", "1", "--matrix",
                           str(matrix), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pandas as pd
    df = pd.read_csv(out).set_index("path")
    assert (df["outcome"] == "ok").all(), df["error"].to_string()
    assert (df["num_params"] == P).all() and (df["hf_model_type"] == "qwen2").all()
    assert json.loads(df.loc["engine", "hf_config"]) == TINY_QWEN2
    assert df.loc["engine", "measured_state_bytes"] == 16 * P + 2 * 500_000_000 + ROTARY_BUFFER_BYTES
    assert df.loc["trainer", "measured_state_bytes"] == 16 * P + 2 * 64**2 + ROTARY_BUFFER_BYTES
    assert (df["measured_comm_bytes"] == 2 * P + 8).all()
    assert (df["measured_state_bytes"] == df["predicted_state_bytes"]).all()     # zerocalc, from the tensors
    assert (df["measured_comm_bytes"] == df["predicted_comm_bytes"]).all()
    assert df["predicted_peak_allocated_bytes"].isna().all()                     # no activation model: left empty
    assert (df["sharded_param_tensors"] == df["param_tensors"]).all()            # born partitioned both ways
    resolved = json.loads(df.loc["trainer", "hf_resolved_ds_config"])["zero_optimization"]
    assert (resolved["reduce_bucket_size"], resolved["stage3_prefetch_bucket_size"],
            resolved["stage3_param_persistence_threshold"]) == (4096, 3686, 640)   # as resolve_auto said
    assert json.loads(df.loc["engine", "z3_leaf_modules"]) == []
    from validate.report import report
    text, exact = report([str(out)])
    assert exact and "State and communication exact from the recorded tensors: 2 of 2 rows" in text


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="DeepSpeed's launcher is not on PATH")
def test_a_trainer_job_profiles_one_more_step_untimed(tmp_path):
    """With VALIDATE_PROFILE_DIR, the Trainer path runs one step more than its warm-up, comm-logged,
    phased and timed ones, profiles it on rank 0 (the host's operators on a CPU) and keeps it out of the
    timed steps, as the direct path does."""
    pytest.importorskip("accelerate")
    from validate.worker import PHASE_STEPS, WARMUP_STEPS
    matrix, out, prof = tmp_path / "m.json", tmp_path / "rows.csv", tmp_path / "prof"
    matrix.write_text(json.dumps({"nproc": 1, "hf_models": [{"config": TINY_QWEN2}], "hf_axes": [
        {"path": ["trainer"], "ds_config": ["zero3-auto"], "seq_len": [16], "micro_batch": [2], "timed_steps": [2]}]}))
    proc = subprocess.run([sys.executable, "-m", "validate", "run", "--backend", "cpu", "--nproc", "1", "--matrix",
                           str(matrix), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VALIDATE_PROFILE_DIR": str(prof)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pandas as pd
    row = pd.read_csv(out).iloc[0]
    assert row["outcome"] == "ok", row["error"]
    assert len(json.loads(row["losses"])) == WARMUP_STEPS + 1 + PHASE_STEPS + 2 + 1
    # the timed steps' clock (a GPU's step times too, which a CPU rank does not record)
    assert len(json.loads(row["measured_trainer_host_s"])["whole"]) == 2
    with open(prof / (row["key"] + ".txt")) as f:
        assert "== by self_cpu_time_total" in f.read()


# Rows whose run recorded its calls before the recorder kept which are dropouts at p > 0 and which are
# stage-3 leaves (`zerocalc.probe.record`): from those calls GPT-2 XL checkpointed is 5,120,000 B a step
# short and Mixtral at N = 256 12,451,840 B over; from the traced configs both are exact
# (test_committed_data.py; data/README.md, "GPT-2 with its dropout"). By (file, key): Mixtral's job recorded
# again since (h200-hf-fake5-mixtral-*.csv) is exact from its own calls.
OPEN_COMM = {("h200-hf-gpt2-xl-fake-n4.csv", "auto-gpt2-h1600-l48-s3-bf16-n4fake-b1x1024-gas1-5d2f3f51ce"),
             ("h200-hf-fake4-mixtral-8x7b-n256.csv", "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-11914a3414"),
             ("h200-hf-fake4-mixtral-8x7b-n256.csv", "auto-mixtral-h4096-l32-s3-bf16-n256fake-b2x2048-gas2-1f6a7f1acf"),
             ("h200-hf-fake4-mixtral-8x7b-random-n256.csv",
              "auto-mixtral-h4096-l32-s3-bf16-n256fake-b1x4096-gas1-7cd9959c72")}


def test_committed_hf_rows():
    """The H200 rows of HF configs (data/README.md, "HF configs"): what they cover, and state and
    communication equal to zerocalc's prediction from the tensors each run recorded, on every row."""
    import glob
    pd = pytest.importorskip("pandas")
    from zerocalc.estimate import estimate
    from validate.jobs import to_zerocalc
    from validate.report import load
    from validate.rows import job_from_row, predicted_state_bytes
    paths = sorted(glob.glob(os.path.join(ROOT, "data", "h200-hf-*.csv")))
    df = load(paths)
    assert (df["outcome"] == "ok").all() and len(df) >= 50
    assert df["hf_model_type"].nunique() >= 8
    trainer = df[df["path"] == "trainer"]
    assert len(trainer) >= 6 and set(trainer["stage"]) == {2, 3}
    big = df[(df["num_params"] >= 7e9) & (df["stage"] == 3)]
    # "mixtral": Mixtral-8x22B's config given inline, named by its model_type (h200-hf-fake5-mixtral-8x22b-n512.csv)
    assert set(big["path"]) == {"engine", "trainer"} and set(big["hf_name"]) == {"qwen2.5-7b", "mixtral-8x7b", "mixtral"}
    assert set(df["stage"]) == {0, 1, 2, 3} and set(df["activation_checkpointing"]) == {True, False}
    assert (df["deepspeed"] == "0.19.8").all() and df["gpu"].str.contains("H200").all()
    for _, r in df.iterrows():
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        e = estimate(spec, setup)
        assert predicted_state_bytes(e, "cuda") == r["measured_state_bytes"], r["key"]
        if (os.path.basename(r["source"]), r["key"]) in OPEN_COMM:
            assert e.comm_bytes != r["measured_comm_bytes"], f"{r['key']} now exact: drop it from OPEN_COMM"
        else:
            assert e.comm_bytes == r["measured_comm_bytes"], r["key"]
        assert pd.isna(r["predicted_peak_allocated_bytes"])      # written before zerocalc traced configs


def test_a_config_file_or_model_directory(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_QWEN2))
    assert hf_models.load_config(str(model_dir)) == ("my-model", TINY_QWEN2)
    assert hf_models.load_config(str(model_dir / "config.json"), {"num_hidden_layers": 1})[1]["num_hidden_layers"] == 1


def test_run_refuses_a_config_it_cannot_build(tmp_path):
    """Bad input: exit 2 and one line naming the file, no traceback, nothing launched."""
    from click.testing import CliRunner
    from validate.cli import main
    bad = tmp_path / "config.json"
    for text in ('{"model_type": "no-such-type", "hidden_size": 8}', "{not json"):
        bad.write_text(text)
        res = CliRunner().invoke(main, ["run", "--backend", "cpu", "--hf-config", str(bad), "--out",
                                        str(tmp_path / "rows.csv")])
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output and str(bad) in res.output
        assert not (tmp_path / "rows.csv").exists()


def test_hf_step_section_of_configurations_timed_once():
    """A file where no configuration was timed in two jobs has no scatter between jobs to judge a
    perfect model by: the section gives each configuration's error and leaves that line out (it
    raised on an empty sample)."""
    pytest.importorskip("pandas")
    from validate.report import configuration, hf_step_section, load, timed_whole_steps
    df = load([os.path.join(ROOT, "data", "h200-hf-time-b.csv")])
    df = df[timed_whole_steps(df)]
    once = df[~df.apply(lambda r: configuration(r.to_dict()), axis=1).duplicated()]
    assert 1 < len(once) < len(df)
    lines = hf_step_section(once)
    assert sum(line.startswith("Step time, traced:") for line in lines) == 1
    assert "per job mean |err|" in lines[-1] and f"over {len(once)} jobs" in lines[-1]
    assert not any("perfect model" in line for line in lines)
    assert any("perfect model" in line for line in hf_step_section(df))
