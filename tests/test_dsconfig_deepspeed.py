"""zerocalc's reading of a ds_config held to DeepSpeed 0.19.8's own: `DeepSpeedConfig` built from the
same dict (no distributed launch: `dist.get_rank()` fails, so DeepSpeed takes world size 1 and
rank 0, which `zerocalc.dsconfig.resolve_batch` is given as dp = 1). Hypothesis generates configs
from hostile and ordinary values of every key zerocalc reads; the two must agree on accept/refuse
and, when both accept, on every value zerocalc models. The schema tables of `zerocalc.dsconfig` are
also checked against DeepSpeed's pydantic models field by field.

Slow: importing DeepSpeed takes 5-15 s on two cores; the examples themselves take ~1 ms each."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerocalc import dsconfig
from zerocalc.training import Setup

pytestmark = pytest.mark.slow
deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
zero_config = pytest.importorskip("deepspeed.runtime.zero.config")

def mix(valid, hostile, share=0.15):
    """Mostly values DeepSpeed takes (so that most configs are accepted and their values compared),
    a hostile one about `share` of the time."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(hostile)) if share >= 0.5 else \
        st.integers(0, 99).flatmap(lambda r: st.sampled_from(hostile if r < share * 100 else valid))


BOOL_OK = [True, False, "yes", "no", "false", "True", "on", "OFF", "0", "1", 0, 1, 1.0, 0.0, "t", "N"]
BOOL_BAD = [2, 0.5, "maybe", " true", "", [], {}, "auto"]
INT_OK = [0, 1, 7, 500_000_000, 5e8, "500", " 42 ", "1_000", "3.0", True, False, 2**63, 2**70, "auto"]
INT_BAD = [-1, 1.5, "5e8", 1e19, 9.3e18, float("inf"), float("nan"), -5.0, [], {"a": 1}, "Infinity", None]
STAGE_OK = [0, 1, 2, 3, "3", "3.0", " 2 ", "03", True, False, 3.0]
STAGE_BAD = [4, -1, 3.5, "two", "", [3], float("nan"), None]
DEV_OK = ["none", "cpu", "nvme", "auto"]   # "auto" is dropped in a nested block too: "none"
DEV_BAD = ["CPU", "gpu", 1, None, ""]
BATCH_OK = [1, 2, 4, 8, 2.0, True]
# 2.5 is left out: DeepSpeedConfig takes a micro-batch of 2.5 sequences (its batch rule only multiplies),
# zerocalc refuses it (a batch is whole sequences; DeepSpeed's own DataLoader refuses it later).
BATCH_BAD = [0, -1, "4", 3, None, [2]]

ZERO_BOOLS = ["overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
              "cpu_offload", "compute_grad_norm"]
ZERO_INTS = ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
             "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
             "stage3_model_persistence_threshold", "sub_group_size", "zero_hpz_partition_size"]


def offload(ratio=False):
    keys = {"device": mix(DEV_OK, DEV_BAD), "pin_memory": mix(BOOL_OK, BOOL_BAD),
            "buffer_count": mix([0, 4, "8", "auto"], [-1, "x"]), "typo": RARE}
    if ratio:
        keys["ratio"] = mix([0.0, 0.5, 1.0, "0.5", True], [1.5, -0.1, "x"])
    block = st.fixed_dictionaries({}, optional=keys).map(dropped)
    return st.one_of(st.none(), block, block, st.just("cpu"))


RARE = st.sampled_from([None] * 18 + [1, "auto"])    # an unknown or removed key, one time in 10 ("auto": dropped)


def dropped(d: dict) -> dict:
    """The RARE keys that came out None are left out."""
    return {k: v for k, v in d.items() if not (k in ("frobnicate", "mics_shard_size", "typo", "amp") and v is None)}


zero = st.one_of(st.just(True), st.just(False), st.just("stage 3"), st.fixed_dictionaries({}, optional={
    "stage": mix(STAGE_OK, STAGE_BAD),
    **{k: mix(BOOL_OK + [None], BOOL_BAD, 0.05) for k in ZERO_BOOLS},
    **{k: mix(INT_OK, INT_BAD, 0.05) for k in ZERO_INTS},
    "offload_optimizer": offload(ratio=True), "offload_param": offload(),
    "frobnicate": RARE, "mics_shard_size": RARE,
}).map(dropped))
precision = st.fixed_dictionaries({}, optional={
    "enabled": mix(BOOL_OK, BOOL_BAD), "loss_scale": mix([0, 128, "64"], [-1, "x", True, float("inf")]),
    "loss_scale_window": mix([1000, 10], [0, True, -2]), "fp16_master_weights_and_grads": st.booleans(),
    "typo": RARE}).map(dropped)
bf16 = st.fixed_dictionaries({}, optional={
    "enabled": mix(BOOL_OK, BOOL_BAD), "bf16_master_weights_and_grads": st.booleans(),
    "bf16_optimizer_states": st.booleans(), "typo": RARE}).map(dropped)
optimizer = mix([{"type": "AdamW", "params": {"lr": 1e-4}}, {"params": {"lr": 1}}, {"type": "Lamb"},
                 {"type": "SGD", "params": {"momentum": 0.9}}, {"type": "sgd"}],
                [{"type": "AdamW", "params": "lr=1e-4"}, {"type": 5}, "adam", {"type": "AdamW", "params": [1]}], 0.3)
configs = st.fixed_dictionaries({"train_micro_batch_size_per_gpu": mix(BATCH_OK, BATCH_BAD)}, optional={
    "zero_optimization": zero, "fp16": st.one_of(precision, precision, st.none(), st.just(True)), "bf16": bf16,
    "bfloat16": bf16, "train_batch_size": mix(BATCH_OK, BATCH_BAD, 0.3),
    "gradient_accumulation_steps": mix(BATCH_OK, BATCH_BAD, 0.3), "optimizer": optimizer,
    "communication_data_type": mix(["fp16", "FP16", "bf16", "fp32", None], ["fp8", 5]),
    "data_types": mix([{"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "bf16"}, {}], ["fp32"]),
    "steps_per_print": st.just(10), "amp": RARE,
    # blocks of other pydantic models: unknown keys refused, "auto" dropped (values are DeepSpeed's to check)
    "compile": mix([{"deepcompile": False}, {"passes": None, "disable": "auto"}, {}],
                   [{"disable": False, "backend": "inductor"}, None, "auto"], 0.3),
    "tensorboard": mix([{"enabled": False, "output_path": "tb"}, "auto"], [{"enabled": False, "typo": 1}, None], 0.3),
    "timers": mix([{"throughput": {"enabled": True}}, {"other": 1}], [{"throughput": {"enabled": True, "x": 1}}], 0.3),
}).map(dropped)


def deepspeed_reading(cfg):
    """DeepSpeed's verdict and values, or None where it refuses (any exception is a refusal)."""
    try:
        c = deepspeed_config.DeepSpeedConfig(dict(cfg))
    except Exception:
        return None
    z = c.zero_config
    dtype = "fp16" if c.float16_config.enabled else "bf16" if c.bfloat16_config.enabled else "fp32"
    comm = {None: None, "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}[
        None if c.communication_data_type is None else str(c.communication_data_type)]
    return {"stage": int(z.stage), "overlap_comm": z.overlap_comm, "contiguous_gradients": z.contiguous_gradients,
            "reduce_bucket_size": z.reduce_bucket_size, "prefetch_bucket_size": z.prefetch_bucket_size,
            "max_live_parameters": z.max_live_parameters, "max_reuse_distance": z.max_reuse_distance,
            "param_persistence_threshold": z.param_persistence_threshold,
            "model_persistence_threshold": z.model_persistence_threshold,
            # 0 and 1 both give each parameter its own sub-group; zerocalc keeps 1
            "sub_group_size": max(z.sub_group_size, 1),
            "offload_optimizer": z.offload_optimizer.device if z.offload_optimizer else "none",
            "offload_param": z.offload_param.device if z.offload_param else "none",
            "dtype": dtype, "communication_data_type": comm,
            "micro_batch": c.train_micro_batch_size_per_gpu, "gas": c.gradient_accumulation_steps}


def zerocalc_reading(cfg):
    try:
        ds = dsconfig.parse(cfg)
        micro, gas = dsconfig.resolve_batch(ds.train_batch_size, ds.micro_batch, ds.gas, 1, from_config=True)
    except dsconfig.DsConfigError as err:
        assert str(err) and "\n" not in str(err)        # one line, says something
        return None
    f, d = ds.fields, Setup()
    get = lambda k: f.get(k, getattr(d, k))  # noqa: E731  (a field the ds_config leaves out: DeepSpeed's default)
    overlap = f.get("overlap_comm")
    return {"stage": f["stage"], "overlap_comm": f["stage"] == 3 if overlap is None else overlap,
            **{k: get(k) for k in ("contiguous_gradients", "reduce_bucket_size", "prefetch_bucket_size",
                                   "max_live_parameters", "max_reuse_distance", "param_persistence_threshold",
                                   "model_persistence_threshold", "sub_group_size", "offload_optimizer",
                                   "offload_param")},
            "dtype": f.get("dtype", "fp32"), "communication_data_type": f.get("communication_data_type"),
            "micro_batch": micro, "gas": gas}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_verdict_and_values_match_deepspeed(cfg):
    if any(isinstance(v, dict) and v.get("enabled") == "auto" for v in cfg.values()):
        return   # "auto" precision is Trainer's to fill, not DeepSpeed's (tested in test_hostile_inputs)
    theirs, ours = deepspeed_reading(cfg), zerocalc_reading(cfg)
    assert (ours is None) == (theirs is None), f"DeepSpeed {'refuses' if theirs is None else 'accepts'}: {cfg}"
    if ours is not None:
        assert ours == theirs, cfg


@pytest.mark.parametrize("cfg", [
    {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "3", "overlap_comm": "yes"}},
    {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": "false"}, "bf16": {"enabled": "on"}},
    {"train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2,
                                                                                    "reduce_bucket_size": 5e8}},
    {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "sub_group_size": 0,
                                                                "stage3_max_live_parameters": 2**70}},
    # "auto" is dropped before the duplicate check: the other spelling's value is taken
    {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0, "prefetch_bucket_size": 0,
                                                                "stage3_prefetch_bucket_size": "auto"}},
    {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 7,
                                                                "max_live_parameters": "auto"}},
])
def test_accepted_examples_read_alike(cfg):
    """A few accepted configs by hand (the property test may not draw them)."""
    assert deepspeed_reading(cfg) is not None
    assert zerocalc_reading(cfg) == deepspeed_reading(cfg)


def _kind(field):
    """zerocalc's schema kind for a pydantic field of DeepSpeed's models."""
    ann, meta = field.annotation, {type(m).__name__: m for m in field.metadata}
    text = str(ann)
    if ann is bool:
        return "bool"
    if text == "typing.Optional[bool]":
        return "optbool"
    if ann is int:
        if "Gt" in meta:
            return ("int", meta["Gt"].gt, True)
        return ("int", meta["Ge"].ge if "Ge" in meta else None, False)
    if ann is float:
        return ("float", meta["Ge"].ge, meta["Le"].le)
    return text


def test_the_schemas_are_deepspeeds():
    """Every field, alias, type and bound of DeepSpeedZeroConfig and the offload models, as zerocalc
    lists them; a DeepSpeed upgrade that adds or changes one fails here."""
    from deepspeed.runtime.zero import offload_config
    from deepspeed.runtime import precision_config
    z = zero_config.DeepSpeedZeroConfig.model_fields
    assert set(z) == set(dsconfig.ZERO_FIELDS)
    assert {f.alias: n for n, f in z.items() if f.alias} == dsconfig.ZERO_ALIASES
    special = {"stage": "stage", "offload_param": "offload_param", "offload_optimizer": "offload_optimizer",
               "zenflow": "dict", "leaf_module": "dict"}
    for name, f in z.items():
        assert dsconfig.ZERO_FIELDS[name] == special.get(name, _kind(f)), name
    for model, ours in ((offload_config.DeepSpeedZeroOffloadParamConfig, dsconfig.OFFLOAD_PARAM_FIELDS),
                        (offload_config.DeepSpeedZeroOffloadOptimizerConfig, dsconfig.OFFLOAD_OPTIMIZER_FIELDS)):
        assert set(model.model_fields) == set(ours)
        for name, f in model.model_fields.items():
            assert ours[name] == {"device": "device", "nvme_path": "path"}.get(name, _kind(f)), name
    assert set(precision_config.DeepSpeedFP16Config.model_fields) == set(dsconfig.FP16_FIELDS)
    assert set(precision_config.DeepSpeedBF16Config.model_fields) == set(dsconfig.BF16_FIELDS)
    removed = deepspeed_config._REMOVED_TOP_LEVEL_CONFIG_KEYS
    assert set(removed) == set(dsconfig.REMOVED_TOP)
    assert set(deepspeed_config._REMOVED_ZERO_CONFIG_KEYS) == set(dsconfig.REMOVED_ZERO)
