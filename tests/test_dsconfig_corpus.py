"""Published ds_configs, as users copy them: tests/data/ds-configs/<project>/, each file byte for byte as
its project publishes it (sources.json names the repository, path and commit). Each goes through the CLI
as `zerocalc estimate --model llama-3.1-8b --dp 8 --ds-config F` (with --micro-batch 4 where the file
leaves it to Trainer): exit 0, or 2 with one line naming the key; the keys warned about are the ones
listed here, read off the files; a few files' answers are worked out by hand; `plan` runs on a few.
Then DeepSpeed 0.19.8's own `DeepSpeedConfig` reads each file at 8 ranks, after HF Trainer's fill of
"auto": it refuses what zerocalc refuses, naming the same key, and reads every value zerocalc reads."""
import glob
import json
import os
import re

import pytest
from click.testing import CliRunner

from zerocalc import dskeys, dsconfig
from zerocalc.cli import main

pytest.importorskip("hjson")   # DeepSpeed's reader: one file holds a template's bare placeholders

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds-configs")
FILES = sorted(os.path.relpath(p, CORPUS) for p in glob.glob(os.path.join(CORPUS, "*", "*.json")))
ESTIMATE = ["estimate", "--model", "llama-3.1-8b", "--dp", "8"]
MICRO = 4            # --micro-batch, for a file that leaves train_micro_batch_size_per_gpu to Trainer
H = 4096             # llama-3.1-8b's hidden size, which Trainer's "auto" bucket sizes follow
PSI = 8_030_261_248  # llama-3.1-8b's parameters

# What is refused, read off each file: (what zerocalc's one line says, what DeepSpeed's error says). A
# batch refusal is at 8 ranks: train_batch_size must be micro-batch × accumulation × 8.
BATCH = "is not divisible by / equal to"
EXTRA = "Extra inputs are not permitted"
REFUSED = {
    # DeepSpeed 0.19.8's CompileConfig has no "disable" or "backend" (torch.compile is switched on elsewhere)
    **{f"axolotl/zero{s}_torch_compile.json": ("compile.disable = false: DeepSpeed 0.19.8 has no such key",
                                               f"CompileConfig\ndisable\n  {EXTRA}") for s in (1, 2)},
    # fp16's loss-scaling keys copied into the bf16 block, which has none of them
    "llama-factory/ds_z3_alst_config.json": ("bf16.auto_cast = false: DeepSpeed 0.19.8 has no such key",
                                             f"DeepSpeedBF16Config\nauto_cast\n  {EXTRA}"),
    # "bfp16" is no dtype (and the bfloat16 block's loss_scale no key: DeepSpeed stops at the first)
    "megatron-deepspeed/ds_zero2_config_bf16.json": ('communication_data_type = "bfp16": DeepSpeed takes fp16, bf16',
                                                     "Invalid communication_data_type.*Got: bfp16"),
    # the top-level curriculum_learning block left DeepSpeed (data_efficiency took it over)
    "bigscience-megatron-deepspeed/ds_config_cl.json": ("curriculum_learning: removed in DeepSpeed 0.19.8",
                                                        "Legacy top-level 'curriculum_learning' has been removed"),
    # min_loss_scale is an int field: 1e-10 has a fractional part
    "kullm/ds_zero2_no_offload.json": ("fp16.min_loss_scale = 1e-10: must be a whole number",
                                       "min_loss_scale\n  Input should be a valid integer, got a number with a "
                                       "fractional part"),
    # an old version of Trainer's test config: reduce_bucket_size must be > 0
    "hf-transformers/ds_config_zero3-61c7ec9.json": ("zero_optimization.reduce_bucket_size = 0: must be greater than 0",
                                                     r"reduce_bucket_size\n  Input should be greater than 0"),
    # a template: Hjson reads the bare placeholder ZERO_STAGE, as the string "ZERO_STAGE,"
    "megatron-deepspeed/ds_config_gpt_TEMPLATE.json": ('zero_optimization.stage = "ZERO_STAGE,": ZeRO stages are',
                                                       "stage\n  Input should be 0, 1, 2, 3"),
    # train_batch_size 1 and nothing else: micro-batch 1 // 8 = 0
    "accelerate/ds_config_zero3_model_only.json": (f"train_batch_size = 1 {BATCH}", "Micro batch size per gpu: 0"),
    # 4 // 1 // 8 = 0 accumulation steps
    "megatron-deepspeed/examples-ds_config.json": (f"train_batch_size = 4 {BATCH}", "Gradient accumulation steps: 0"),
    # 16 != 16 × 1 × 8
    "megatron-deepspeed/ds_config.json": (f"train_batch_size = 16 {BATCH}", "16 != 16 \\* 1 \\* 8"),
    # 1 != 1 × 1 × 8 (DeepSpeed: × 4, the ranks left to data parallelism by sequence_parallel_size 2)
    "deepspeed-examples/autosp_config.json": (f"train_batch_size = 1 {BATCH}", "1 != 1 \\* 1 \\* 4"),
}

# The keys each file sets that zerocalc names in a warning, read off the files (all others: none).
# allgather_bucket_size (set in 16 of them, 2e8 in 11) is not among them: it changes nothing in 0.19.8 (dskeys).
LF = {"comms_config", "monitor_config"}             # LLaMA-Factory's own blocks: DeepSpeed ignores them
WARNED = {
    "hf-transformers/ds_config_zero2_bf16.json": {"bfloat16.enabled"},
    "hf-transformers/ds_config_zero3_bf16.json": {"bfloat16.enabled"},   # Trainer fills bf16.enabled only
    # "auto" under the bare names: Trainer fills only stage3_prefetch_bucket_size and
    # stage3_param_persistence_threshold, so DeepSpeed takes its defaults
    "axolotl/zero3_bf16.json": {"zero_optimization.prefetch_bucket_size", "zero_optimization.param_persistence_threshold"},
    **{f"llama-factory/{f}.json": LF for f in ("ds_z0_config", "ds_z2_config", "ds_z2_offload_config", "ds_z3_config",
                                                "ds_z3_offload_config")},
    "llama-factory/ds_z2_autotp_config.json": {"_comment", "tensor_parallel.autotp_size"},
    "llama-factory/ds_z3_fp8_config.json": {"fp8", "zero_optimization.offload_optimizer.pin_memory"},
    "llama-factory/ds_z3_partial_offload_config.json": {"zero_optimization.offload_optimizer.pin_memory"},
    "deepspeed-examples/tensor_parallel-ds_config.json": {"tensor_parallel.autotp_size"},
    "deepspeed-examples/zf_config.json": {"zero_optimization.zenflow"},
    "deepspeed-examples/ds_autoep_zero1_qwen3_5_moe.json": {"expert_parallel.enabled"},
    "deepspeed-examples/ds_zero3_leaf_qwen3_5.json": {"zero_optimization.leaf_module.classes"},
    "deepspeed-examples/autosp_config.json": {"compile.deepcompile", "sequence_parallel_size"},   # then refused
}


def load(name):
    return dsconfig.load(os.path.join(CORPUS, name))


def leaves_micro_batch_to_trainer(name):
    return load(name).get("train_micro_batch_size_per_gpu") == "auto"


def estimate(name, *args):
    result = CliRunner().invoke(main, ESTIMATE + ["--ds-config", os.path.join(CORPUS, name), *args])
    assert result.exit_code in (0, 2), f"{name}: {result.exception!r}"   # never a traceback
    return result


def run(name, *args):
    """The estimate as a user runs it: --micro-batch only where the file leaves it to Trainer."""
    return estimate(name, *(["--micro-batch", str(MICRO)] if leaves_micro_batch_to_trainer(name) else []), *args)


def warned(stderr):
    """The keys named in `warning:` lines."""
    return {m.group(1) for m in re.finditer(r"^warning: (?:unknown key )?([\w.]+)", stderr, re.M)}


def test_every_file_is_named_in_sources():
    with open(os.path.join(CORPUS, "sources.json")) as f:
        sources = json.load(f)
    assert set(sources) == set(FILES) and 40 <= len(FILES) <= 80
    for name, src in sources.items():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", src["repo"]) and re.fullmatch(r"[0-9a-f]{40}", src["commit"]), name
        assert os.path.basename(src["path"]).removesuffix(".json") in name, name
    assert set(REFUSED) | set(WARNED) <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_estimate_accepts_or_names_the_key(name):
    result = run(name)
    if name in REFUSED:
        assert result.exit_code == 2
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith(f"Error: {os.path.join(CORPUS, name)}: ") and REFUSED[name][0] in error, error
    else:
        assert result.exit_code == 0, result.output
        assert "Error" not in result.stderr
    assert warned(result.stderr) == WARNED.get(name, set())


@pytest.mark.parametrize("name", [f for f in FILES if f not in REFUSED])
def test_no_key_goes_unclassified_and_unsaid(name):
    """Every key of a file zerocalc answers for is in its table of DeepSpeed's keys, or named as
    unknown: no key is dropped without a word."""
    stderr = run(name).stderr
    for path, _ in dskeys.leaves(load(name)):
        assert dskeys.lookup(path) is not None or f"warning: unknown key {path} ignored" in stderr, path


TRAINER = [f for f in FILES if f not in REFUSED and '"auto"' in open(os.path.join(CORPUS, f)).read()]


@pytest.mark.parametrize("name", TRAINER)
def test_trainers_auto_values_as_documented(name):
    """docs/inputs.md, HF Trainer: the micro-batch comes from --micro-batch, accumulation is Trainer's
    default of 1 (said), fp16 and bf16 both "auto" are bf16 (said), stage 3 is built under zero.Init."""
    cfg = load(name)
    if leaves_micro_batch_to_trainer(name):
        refused = estimate(name)
        assert refused.exit_code == 2 and 'leaves micro-batch at "auto": give --micro-batch' in refused.stderr
    result = run(name, "--format", "json")
    inputs = json.loads(result.stdout)["inputs"]
    assert inputs["micro_batch"] == (MICRO if leaves_micro_batch_to_trainer(name) else
                                     cfg["train_micro_batch_size_per_gpu"])
    if cfg.get("gradient_accumulation_steps") == "auto":
        assert inputs["gas"] == 1 and 'gradient_accumulation_steps "auto" taken as HF Trainer fills it' in result.stderr
    if all(cfg.get(b, {}).get("enabled") == "auto" for b in ("fp16", "bf16")):
        assert inputs["dtype"] == "bf16"
        assert 'fp16.enabled and bf16.enabled are "auto"' in run(name).stdout
    if (cfg.get("zero_optimization") or {}).get("stage") == 3:
        assert inputs["zero_init"] and "zero.Init: on (default for a ds_config with HF Trainer" in run(name).stdout


# Worked out by reading the file (run as `run` runs it, llama-3.1-8b at 8 ranks):
BY_HAND = {
    # Trainer's fill: reduce_bucket_size = h² = 4096² = 16,777,216; stage3_prefetch_bucket_size =
    # int(0.9 · 4096²) = 15,099,494; stage3_param_persistence_threshold = 10 · 4096 = 40,960;
    # fp16 and bf16 both "auto": bf16; micro-batch from --micro-batch; accumulation Trainer's 1
    "llama-factory/ds_z3_offload_config.json": dict(
        stage=3, offload_optimizer="cpu", offload_param="cpu", reduce_bucket_size=16_777_216,
        prefetch_bucket_size=15_099_494, param_persistence_threshold=40_960, max_live_parameters=10**9,
        max_reuse_distance=10**9, sub_group_size=10**9, overlap_comm=False, contiguous_gradients=True, dtype="bf16",
        micro_batch=MICRO, gas=1, zero_init=True),
    # the bare spellings left "auto": DeepSpeed's 5e7 and 1e5; reduce_bucket_size is Trainer's h²;
    # sub_group_size 0 is one parameter a sub-group, as 1 is
    "axolotl/zero3_bf16.json": dict(
        stage=3, reduce_bucket_size=16_777_216, prefetch_bucket_size=50_000_000, param_persistence_threshold=100_000,
        sub_group_size=1, max_live_parameters=0, max_reuse_distance=0, dtype="bf16"),
    "axolotl/zero3_bf16_cpuoffload_params.json": dict(
        stage=3, offload_optimizer="none", offload_param="cpu", prefetch_bucket_size=15_099_494, dtype="bf16"),
    # every size written out; reduce_bucket_size left out: DeepSpeed's 5e8; fp16 "auto" alone: fp16
    "fastchat/deepspeed_config_s3.json": dict(
        stage=3, offload_optimizer="cpu", offload_param="cpu", reduce_bucket_size=500_000_000,
        prefetch_bucket_size=500_000_000, param_persistence_threshold=1_000_000, max_live_parameters=10**9,
        max_reuse_distance=10**9, sub_group_size=10**12, overlap_comm=True, dtype="fp16", micro_batch=MICRO, gas=1),
    # no fp16 or bf16 block: fp32
    "fastchat/deepspeed_config_s2.json": dict(stage=2, offload_optimizer="cpu", dtype="fp32", overlap_comm=True),
    # fp16 and bf16 both off (its fp8 block is no DeepSpeed key); the sizes written out for a 3584-wide model
    "llama-factory/ds_z3_fp8_config.json": dict(
        stage=3, offload_optimizer="cpu", dtype="fp32", reduce_bucket_size=12_845_056, prefetch_bucket_size=11_560_550,
        param_persistence_threshold=35_840, micro_batch=MICRO, gas=1),
    # "device": "none" written out: no offload
    "qwen/ds_config_zero2.json": dict(stage=2, offload_optimizer="none", reduce_bucket_size=200_000_000),
    # 16 = micro 1 × accumulation 2 × 8; stage 1's overlap_comm defaults to false
    "bigscience-megatron-deepspeed/tests-ds_config.json": dict(
        stage=1, dtype="fp16", micro_batch=1, gas=2, overlap_comm=False, reduce_bucket_size=500_000_000,
        zero_init=False),
    # 64 = 2 × 4 × 8
    "bigscience-megatron-deepspeed/ds_config.json": dict(stage=0, dtype="bf16", micro_batch=2, gas=4),
    # 256 = 32 × 1 × 8
    "megatron-deepspeed/ds_config_gbs256_mbs32_log1_zero1.json": dict(stage=1, dtype="fp16", micro_batch=32, gas=1),
    # 16 = 1 × 2 × 8; stage 3 with nothing else set: DeepSpeed's defaults, overlap_comm on at stage 3
    "megatron-deepspeed/ds_config_gbs16_mbs1_log1_zero3.json": dict(
        stage=3, dtype="fp16", micro_batch=1, gas=2, reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000,
        param_persistence_threshold=100_000, overlap_comm=True, zero_init=False),
    # train_batch_size 32 with accumulation 1: the micro-batch 32 // 8 = 4
    "deepspeed-examples/zf_config.json": dict(stage=2, offload_optimizer="cpu", dtype="bf16", micro_batch=4, gas=1),
    # "bfloat16": {"enabled": "auto"}: Trainer fills bf16.enabled only, so DeepSpeed runs fp32
    "hf-transformers/ds_config_zero2_bf16.json": dict(stage=2, offload_optimizer="cpu", reduce_bucket_size=200_000_000,
                                                      dtype="fp32"),
}


@pytest.mark.parametrize("name", BY_HAND)
def test_values_by_hand(name):
    out = json.loads(run(name, "--format", "json").stdout)
    got = {**out["inputs"], **{k: out["estimates"][0][k] for k in ("stage", "offload_optimizer", "offload_param")}}
    assert {k: got[k] for k in BY_HAND[name]} == BY_HAND[name]


def test_stage_1_states_by_hand():
    """bigscience's stage 1 in fp16 with Adam (the ZeRO paper's K = 12 split): the fp32 master copy
    4Ψ and the two moments 8Ψ partitioned over N_d = 8."""
    e = json.loads(run("bigscience-megatron-deepspeed/tests-ds_config.json", "--format", "json").stdout)["estimates"][0]
    assert e["master_weights_bytes"] == 4 * PSI // 8 == 4_015_130_624
    assert e["moments_bytes"] == 8 * PSI // 8 == 8_030_261_248


# plan keeps the file's stage, offload and batch keys; at stage 0 nothing fits on 80 GB: each rank holds
# 2Ψ + 2Ψ + 12Ψ = 16 · 8.03e9 = 128.5 GB of model states.
PLANS = {
    "llama-factory/ds_z0_config.json": "stage 0, offload none/none and its buckets kept",
    "bigscience-megatron-deepspeed/ds_config.json": "stage 0, offload none/none, micro-batch 2, global batch 64 and "
                                                    "its buckets kept",
    "bigscience-megatron-deepspeed/tests-ds_config.json": "stage 1, offload none/none, micro-batch 1, global batch 16",
    "llava/zero2.json": "stage 2, offload none/none and its buckets kept",
    "fastchat/deepspeed_config_s2.json": "stage 2, offload cpu/none and its buckets kept",
    "lmflow/ds_config_zero3.json": "stage 3, offload cpu/none and its buckets kept",
    "hf-transformers/ds_config_zero3.json": "stage 3, offload cpu/cpu and its buckets kept",
    "axolotl/zero3_bf16_cpuoffload_params.json": "stage 3, offload none/cpu and its buckets kept",
}


@pytest.mark.parametrize("name", PLANS)
def test_plan_keeps_what_the_file_sets(name):
    fixed = isinstance(load(name).get("train_batch_size"), int)
    result = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "2048",
                                       "--ds-config", os.path.join(CORPUS, name)]
                                + ([] if fixed else ["--global-batch", "64"]))
    assert f"From {os.path.join(CORPUS, name)}: {PLANS[name]}" in result.stdout
    if "stage 0" in PLANS[name]:
        assert result.exit_code == 1 and "Nothing fits" in result.stdout
    else:
        assert result.exit_code == 0 and "Nothing fits" not in result.stdout


# ---- against DeepSpeed 0.19.8's own reading ---------------------------------------------------------

def trainer_fill(cfg, dtype):
    """HF Trainer's fill of "auto" (transformers/integrations/deepspeed.py: `trainer_config_process`,
    `trainer_config_finalize`): only keys it names, only where "auto"; --per_device_train_batch_size
    MICRO, accumulation 1, 8 ranks, --bf16 or --fp16 as `dtype`, max_grad_norm 1.0, hidden size H."""
    def fill(path, value):
        *head, last = path.split(".")
        block = cfg
        for key in head:
            block = block.get(key) if isinstance(block, dict) else None
        if isinstance(block, dict) and block.get(last) == "auto":
            block[last] = value
    for path, value in {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                        "train_batch_size": MICRO * 8, "gradient_clipping": 1.0, "fp16.enabled": dtype == "fp16",
                        "bf16.enabled": dtype == "bf16", "zero_optimization.reduce_bucket_size": H * H}.items():
        fill(path, value)
    for key, value in {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}.items():
        fill(f"optimizer.params.{key}", value)
    for key, value in {"warmup_min_lr": 0, "warmup_max_lr": 5e-5, "warmup_num_steps": 0, "total_num_steps": 100}.items():
        fill(f"scheduler.params.{key}", value)
    if (cfg.get("zero_optimization") or {}).get("stage") == 3:
        fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * H * H))
        fill("zero_optimization.stage3_param_persistence_threshold", 10 * H)
    return cfg


def trainer_dtype(cfg):
    """The flag a Trainer user gives, as docs/inputs.md takes it: --bf16 for a config with a bf16 block
    ("bf16" or the old "bfloat16") that is "auto" or on, else --fp16 where fp16 is "auto"."""
    if any(cfg.get(b, {}).get("enabled") in ("auto", True) for b in ("bf16", "bfloat16")):
        return "bf16"
    return "fp16" if cfg.get("fp16", {}).get("enabled") == "auto" else None


@pytest.fixture(scope="module")
def deepspeed_at_8_ranks():
    """DeepSpeedConfig as one of 8 ranks: no process group, so `dist` answers rank 0 of 8."""
    config = pytest.importorskip("deepspeed.runtime.config")
    patch = pytest.MonkeyPatch()
    patch.setattr(config.dist, "get_rank", lambda *a, **k: 0)
    patch.setattr(config.dist, "get_world_size", lambda *a, **k: 8)
    yield config.DeepSpeedConfig
    patch.undo()


def deepspeeds_reading(DeepSpeedConfig, name):
    """(DeepSpeed's values, None), or (None, its error) where it refuses the file."""
    cfg = load(name)
    try:
        c = DeepSpeedConfig(trainer_fill(cfg, trainer_dtype(cfg)) if '"auto"' in json.dumps(cfg) else cfg)
    except Exception as err:   # noqa: BLE001  (pydantic's ValidationError, AssertionError, DeepSpeedConfigError)
        return None, str(err)
    z = c.zero_config
    return {"stage": int(z.stage), **{k: str(getattr(getattr(z, k), "device", "none")) for k in (
                "offload_optimizer", "offload_param")},
            **{k: getattr(z, k) for k in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
                                          "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                                          "overlap_comm", "contiguous_gradients")},
            "sub_group_size": max(z.sub_group_size, 1),   # 0 and 1 alike: one parameter a sub-group
            "dtype": "fp16" if c.float16_config.enabled else "bf16" if c.bfloat16_config.enabled else "fp32",
            "micro_batch": c.train_micro_batch_size_per_gpu, "gas": c.gradient_accumulation_steps}, None


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_deepspeed_reads_it_alike(name, deepspeed_at_8_ranks):
    theirs, why = deepspeeds_reading(deepspeed_at_8_ranks, name)
    if name in REFUSED:
        assert theirs is None and re.search(REFUSED[name][1], why), why
        return
    assert theirs is not None, why
    out = json.loads(run(name, "--format", "json").stdout)
    ours = {**out["inputs"], **{k: out["estimates"][0][k] for k in ("stage", "offload_optimizer", "offload_param")}}
    assert {k: ours[k] for k in theirs} == theirs
