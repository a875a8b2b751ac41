"""Read a ds_config the way DeepSpeed 0.19.8 reads it, into Setup fields.

DeepSpeed loads the file with `hjson` and a duplicate-key check, validates `zero_optimization`,
`fp16` and `bf16` with pydantic models in lax mode (`extra="forbid"`, "auto" values dropped) and the
batch keys by `_batch_assertion`. This module follows each of those rules without importing pydantic
or DeepSpeed: `tests/test_dsconfig_deepspeed.py` holds its verdict and resolved values to
`DeepSpeedConfig`'s. Hugging Face Trainer's "auto" values are resolved as its DeepSpeed integration
does when the hidden size is known; batch sizes left at "auto" must come from the command line.
Where each rule lives in DeepSpeed's and transformers' source: docs/inputs.md, "ds_config".

Every error names the key and the value: `zero_optimization.stage = 4: ZeRO stages are 0, 1, 2, 3`;
the caller prefixes the file.
"""
import json
import math
import re
from dataclasses import dataclass, field

from zerocalc import dskeys
from zerocalc.inputs import DsConfigError, read_text
from zerocalc.training import runs_bf16_optimizer


def _show(value) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(key: str, value, why: str):
    raise DsConfigError(f"{key} = {_show(value)}: {why}")


# ---- pydantic's lax coercions (pydantic 2, as DeepSpeed 0.19.8's models use them) ----------------

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def coerce_bool(key: str, value) -> bool:
    """pydantic's lax bool: true/false, 0/1 (int or float), and the strings yes/no, on/off, t/f,
    y/n, true/false, 1/0 in any case (no surrounding spaces)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    _fail(key, value, "must be true or false")


_INT_TEXT = re.compile(r"^[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?$")
_I64 = 2**63


def coerce_int(key: str, value, minimum: int | None = None, exclusive: bool = False) -> int:
    """pydantic's lax int: an integer (true/false count as 1/0), a float with no fractional part
    below 2^63 in size, or a string of digits (spaces around, underscores between digits and a
    '.0' tail allowed); then DeepSpeed's bound (ge or gt) on the field."""
    if isinstance(value, bool):
        out = int(value)
    elif isinstance(value, int):
        out = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            _fail(key, value, "must be a finite whole number")
        if value != int(value):
            _fail(key, value, "must be a whole number")
        if abs(value) >= _I64:
            _fail(key, value, "is too large (DeepSpeed reads at most 2^63 from a number with a decimal point)")
        out = int(value)
    elif isinstance(value, str) and _INT_TEXT.match(value.strip()) and len(value.strip()) <= 4300:
        out = int(value.strip().split(".")[0])
    else:
        _fail(key, value, "must be a whole number")
    if minimum is not None and (out <= minimum if exclusive else out < minimum):
        _fail(key, value, f"must be {'greater than' if exclusive else 'at least'} {minimum}")
    return out


def coerce_float(key: str, value, low: float | None = None, high: float | None = None) -> float:
    """pydantic's lax float (numbers, true/false, numeric strings), then the field's bounds."""
    if isinstance(value, (bool, int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip().replace("_", ""))
        except ValueError:
            _fail(key, value, "must be a number")
    else:
        _fail(key, value, "must be a number")
    if (low is not None and not out >= low) or (high is not None and not out <= high):
        _fail(key, value, f"must be between {low} and {high}")
    return out


def coerce_stage(key: str, value) -> int:
    """ZeroStageEnum (an int enum): 0-3 as a number, true/false, or a string of digits."""
    if isinstance(value, str) and re.match(r"^[+-]?[0-9]+(?:\.0+)?$", value.strip()):
        value = int(value.strip().split(".")[0])
    if isinstance(value, (bool, int)) or (isinstance(value, float) and value.is_integer()):
        if int(value) in (0, 1, 2, 3):
            return int(value)
    _fail(key, value, "ZeRO stages are 0, 1, 2, 3")


def _device(key: str, value) -> str:
    if value in ("none", "cpu", "nvme"):
        return value
    _fail(key, value, "the offload device is \"none\", \"cpu\" or \"nvme\"")


def _path(key: str, value):
    if value is not None and not isinstance(value, str):
        _fail(key, value, "must be a path (a string)")


# ---- the schemas: DeepSpeed 0.19.8's field names, aliases, types and bounds ---------------------
# kind: "bool", "optbool" (null allowed), ("int", minimum, exclusive), ("float", low, high), "stage",
# "device", "path", "dict" (validated by DeepSpeed beyond this model; taken as given).
_GE0, _GT0, _ANYINT = ("int", 0, False), ("int", 0, True), ("int", None, False)
ZERO_FIELDS = {
    "stage": "stage", "contiguous_gradients": "bool", "reduce_scatter": "bool", "reduce_bucket_size": _GT0,
    "use_multi_rank_bucket_allreduce": "bool", "allgather_partitions": "bool", "allgather_bucket_size": _GE0,
    "overlap_comm": "optbool", "compute_grad_norm": "bool", "load_from_fp32_weights": "bool",
    "elastic_checkpoint": "bool", "offload_param": "offload_param", "offload_optimizer": "offload_optimizer",
    "zenflow": "dict", "sub_group_size": _GE0, "cpu_offload_param": "optbool", "cpu_offload_use_pin_memory": "optbool",
    "cpu_offload": "optbool", "prefetch_bucket_size": _GE0, "param_persistence_threshold": _GE0,
    "model_persistence_threshold": _GE0, "max_live_parameters": _GE0, "max_reuse_distance": _GE0,
    "gather_16bit_weights_on_model_save": "bool", "module_granularity_threshold": _ANYINT,
    "use_all_reduce_for_fetch_params": "bool", "allgather_sequential": "bool",
    "stage3_gather_fp16_weights_on_model_save": "bool", "ignore_unused_parameters": "bool", "legacy_stage1": "bool",
    "round_robin_gradients": "bool", "parameter_alignment": "bool", "zero_hpz_partition_size": _GE0,
    "zero_quantized_weights": "bool", "zero_quantized_nontrainable_weights": "bool",
    "zero_quantized_gradients": "bool", "memory_efficient_linear": "bool", "pipeline_loading_checkpoint": "bool",
    "override_module_apply": "bool", "log_trace_cache_warnings": "bool", "enable_sanity_checks": "bool",
    "save_muon_momentum_buffer_in_memory": "bool", "leaf_module": "dict",
}
# The stage-3 fields are written with a "stage3_" prefix (pydantic aliases); the bare name works too.
ZERO_ALIASES = {f"stage3_{k}": k for k in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}
OFFLOAD_PARAM_FIELDS = {"device": "device", "nvme_path": "path", "buffer_count": _GE0, "buffer_size": _GE0,
                        "max_in_cpu": _GE0, "pin_memory": "bool"}
OFFLOAD_OPTIMIZER_FIELDS = {"device": "device", "nvme_path": "path", "buffer_count": _GE0, "pin_memory": "bool",
                            "pipeline_read": "bool", "pipeline_write": "bool", "fast_init": "bool",
                            "ratio": ("float", 0.0, 1.0), "super_offload": "bool",
                            "cpuadam_cores_perc": ("float", 0.0, 1.0)}
FP16_FIELDS = {"enabled": "bool", "auto_cast": "bool", "loss_scale": "loss_scale", "initial_scale_power": _ANYINT,
               "loss_scale_window": "strict_int", "hysteresis": _ANYINT, "consecutive_hysteresis": "bool",
               "min_loss_scale": "strict_int", "fp16_master_weights_and_grads": "bool"}
BF16_FIELDS = {"enabled": "bool", "immediate_grad_update": "bool", "check_grad_overflow": "bool",
               "bf16_master_weights_and_grads": "bool", "bf16_optimizer_states": "bool"}
# The other blocks DeepSpeed validates with a pydantic model (`extra="forbid"`): their field names and
# aliases. A key not listed is refused, as DeepSpeed refuses it; the values are its to check (none is modelled).
STRICT_BLOCKS = {
    "compile": ("deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
                "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory",
                "debug_log", "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
                "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes"),
    "comms_logger": ("enabled", "prof_all", "prof_ops", "verbose", "debug"),
    "tensorboard": ("enabled", "output_path", "job_name"), "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
              "experiment_key", "online", "mode"),
    "hybrid_engine": ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
                      "tp_gather_partition_size", "enable_cuda_graph"),
    "tensor_parallel": ("dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head", "vocab_parallel_ce_backend",
                        "tensor_parallel", "tp", "injection_policy_tuple", "partition_config", "preset_model",
                        "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject"),
    "timers.throughput": ("enabled", "synchronized"),
    "weight_quantization": ("enabled", "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant"),
}
# Setup fields zerocalc models, by DeepSpeed field name.
_MODELLED = {"stage": "stage", "reduce_bucket_size": "reduce_bucket_size", "overlap_comm": "overlap_comm",
             "contiguous_gradients": "contiguous_gradients", "prefetch_bucket_size": "prefetch_bucket_size",
             "max_live_parameters": "max_live_parameters",
             "param_persistence_threshold": "param_persistence_threshold",
             "model_persistence_threshold": "model_persistence_threshold",
             "max_reuse_distance": "max_reuse_distance", "sub_group_size": "sub_group_size"}
# Keys DeepSpeed 0.19.8 refuses outright (`runtime/config.py`, `_reject_removed_config_keys`): the table's.
REMOVED_TOP = tuple(k for k, (c, d, _) in dskeys.KEYS.items() if c == "refused" and "." not in k)
REMOVED_ZERO = tuple(k.split(".", 1)[1] for k, (c, d, _) in dskeys.KEYS.items()
                     if c == "refused" and d is None and k.startswith("zero_optimization."))


def _strict_int(key, value):
    # fp16.loss_scale_window / min_loss_scale: a validator refuses bools and non-finite floats first.
    if isinstance(value, bool):
        _fail(key, value, "must be an integer, not true/false")
    return coerce_int(key, value)


def _loss_scale(key, value):
    if isinstance(value, bool):
        _fail(key, value, "must be a number, not true/false")
    out = coerce_float(key, value)
    if not math.isfinite(out) or out < 0:
        _fail(key, value, "must be a finite number >= 0 (0 is dynamic loss scaling)")
    return out


def _coerce(kind, key: str, value):
    if kind == "bool":
        return coerce_bool(key, value)
    if kind == "optbool":
        return None if value is None else coerce_bool(key, value)
    if kind == "stage":
        return coerce_stage(key, value)
    if kind == "device":
        return _device(key, value)
    if kind == "path":
        return _path(key, value)
    if kind in ("dict", "offload_param", "offload_optimizer"):   # the offload blocks: see read_zero
        if value is not None and not isinstance(value, dict):
            _fail(key, value, "must be an object {...}")
        return value
    if kind == "any":
        return value
    if kind == "strict_int":
        return _strict_int(key, value)
    if kind == "loss_scale":
        return _loss_scale(key, value)
    if kind[0] == "int":
        return coerce_int(key, value, kind[1], kind[2])
    if kind[0] == "float":
        return coerce_float(key, value, kind[1], kind[2])
    raise AssertionError(kind)


def _model(block: dict, schema: dict, prefix: str, aliases: dict | None = None) -> dict:
    """One pydantic model's validation: unknown keys refused (extra="forbid"), a field given under
    both its name and its alias refused, "auto" dropped (the default is used), each value coerced."""
    if not isinstance(block, dict):
        _fail(prefix, block, "must be an object {...}")
    out, seen = {}, {}
    for key, value in block.items():
        if value == "auto":   # dropped before pydantic sees the block: never unknown, never a duplicate
            continue
        name = (aliases or {}).get(key, key)
        if name not in schema:
            raise DsConfigError(f"{prefix}.{key} = {_show(value)}: DeepSpeed 0.19.8 has no such key (it refuses "
                                f"unknown keys here)")
        if name in seen:
            raise DsConfigError(f"{prefix}.{key}: given twice, as {seen[name]} and {key}")
        seen[name] = key
        out[name] = _coerce(schema[name], f"{prefix}.{key}", value)
    return out


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeedZeroConfig's resolved values (those zerocalc models or checks)."""
    values: dict                  # DeepSpeed field name -> coerced value, as given
    stage: int
    overlap_comm: bool            # None resolved: True at stage 3 only (`overlap_comm_valid`)
    offload_optimizer: str
    offload_param: str
    auto: tuple[str, ...]         # keys left at "auto" as the file spells them, offload ones as
                                  # "offload_param.device" (DeepSpeed's default unless Trainer fills them)


def read_zero(zero) -> ZeroConfig:
    """`zero_optimization` as DeepSpeedZeroConfig validates it (`get_zero_config`)."""
    key = "zero_optimization"
    if isinstance(zero, bool):   # the deprecated form: true is stage 1
        zero = {"stage": 1} if zero else {}
    if not isinstance(zero, dict):
        _fail(key, zero, "must be an object {...}")
    for removed in REMOVED_ZERO:
        if removed in zero:
            raise DsConfigError(f"{key}.{removed}: removed in DeepSpeed 0.19.8, which refuses it")
    values = _model(zero, ZERO_FIELDS, key, ZERO_ALIASES)
    # "auto" under one name and a value under the other (prefetch_bucket_size and its stage3_ alias): the value
    auto = tuple(k for k, v in zero.items() if v == "auto" and ZERO_ALIASES.get(k, k) in ZERO_FIELDS
                 and ZERO_ALIASES.get(k, k) not in values)
    stage = values.get("stage", 0)
    offloads = {}
    for name, schema in (("offload_param", OFFLOAD_PARAM_FIELDS), ("offload_optimizer", OFFLOAD_OPTIMIZER_FIELDS)):
        block = zero.get(name)
        if block is None or name not in values:
            offloads[name] = {}
            continue
        # pydantic builds a nested model through its own __init__ (DeepSpeedConfigModel's): "auto" is dropped here too
        offloads[name] = _model(block, schema, f"{key}.{name}")
        auto += tuple(f"{name}.{k}" for k, v in block.items() if v == "auto" and k in schema)
    # deprecated booleans (`_process_deprecated_field`): cpu_offload -> offload_optimizer cpu,
    # cpu_offload_param -> offload_param cpu; asserting when the new key is given too.
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in values:
            if new in values:
                raise DsConfigError(f"{key}.{old}: deprecated, and cannot be given together with {key}.{new}")
            if values[old]:
                offloads[new] = {"device": "cpu"}
    if values.get("legacy_stage1"):
        raise DsConfigError(f"{key}.legacy_stage1 = true: the old stage 1 left DeepSpeed (0.19.8's engine stops on it)")
    if values.get("compute_grad_norm") is False and stage not in (1, 2):
        raise DsConfigError(f"{key}.compute_grad_norm = false: supported only with ZeRO stage 1 or 2")
    if offloads["offload_optimizer"].get("ratio", 1.0) < 1.0 and stage != 3:
        raise DsConfigError(f"{key}.offload_optimizer.ratio = {offloads['offload_optimizer']['ratio']}: partial "
                            "offloading needs ZeRO stage 3")
    overlap = values.get("overlap_comm")
    return ZeroConfig(values, stage, stage == 3 if overlap is None else overlap,
                      offloads["offload_optimizer"].get("device", "none"),
                      offloads["offload_param"].get("device", "none"), auto)


_MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet")


def read_strict_blocks(cfg: dict, paths=tuple(STRICT_BLOCKS)):
    """The blocks of STRICT_BLOCKS as their models take them: an object without unknown keys. The
    monitors are fields of one model (`DeepSpeedMonitorConfig`), so "auto" for a whole one is dropped."""
    for path in paths:
        names = STRICT_BLOCKS[path]
        head, _, sub = path.partition(".")
        if head not in cfg or (sub and not (isinstance(cfg[head], dict) and sub in cfg[head])):
            continue
        block = cfg[head][sub] if sub else cfg[head]
        if not (head in _MONITORS and block == "auto"):
            _model(block, dict.fromkeys(names, "any"), path)


def read_precision(cfg: dict) -> tuple[dict, dict]:
    """(fp16, bf16) blocks as DeepSpeedFP16Config / DeepSpeedBF16Config validate them, "auto"
    values kept out (the caller decides them). "bf16" wins over the old name "bfloat16"."""
    fp16 = cfg.get("fp16", {})
    bf16_key = "bf16" if cfg.get("bf16") is not None else "bfloat16"
    bf16 = cfg.get(bf16_key, {})
    fp = _model(fp16, FP16_FIELDS, "fp16")
    bf = _model(bf16, BF16_FIELDS, bf16_key)
    if fp.get("enabled") and fp.get("loss_scale", 0) == 0:
        # dynamic loss scaling: `_validate_dynamic_loss_scale_params`
        for name in ("loss_scale_window", "min_loss_scale"):
            if fp.get(name, 1) <= 0:
                _fail(f"fp16.{name}", fp[name], "must be > 0 with dynamic loss scaling (loss_scale 0)")
    return fp, bf


_DTYPES = {"fp32": "fp32", "float32": "fp32", "torch.float32": "fp32", "float": "fp32",
           "fp16": "fp16", "float16": "fp16", "torch.float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "fusedadam": "adam", "lamb": "adam"}
# The 1-bit optimizers left DeepSpeed: 0.19.8's config still reads their names, but its engine
# (`_configure_basic_optimizer`) knows none of them and looks each up in torch.optim, which has none.
REMOVED_OPTIMIZERS = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}


@dataclass(frozen=True)
class DsConfig:
    fields: dict                                    # Setup field -> value
    train_batch_size: int | None = None
    micro_batch: int | None = None
    gas: int | None = None
    warnings: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()                     # "auto" values the command line must supply
    from_trainer: bool = False                      # has "auto" values: written for HF Trainer
    dtype_auto: tuple[str, ...] = ()                # "fp16"/"bf16" blocks whose enabled is "auto"
    extra: dict = field(default_factory=dict)
    allgather_bucket_size: int | None = None        # as given: no effect, but an odd one stops ZeRO 1-2 (`check_setup`)


def _has_auto(value) -> bool:
    """Any "auto" value, at any depth (iterative: a deeply nested file must not overflow the stack)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and v == "auto":
            return True
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _batch_value(key, value):
    """The batch keys are read raw (`get_scalar_param`) and compared with integers: a whole
    positive number (true counts as 1, as Python compares it), never a string."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
        _fail(key, value, "must be a whole number of sequences")
    if value <= 0:
        _fail(key, value, "must be at least 1 (DeepSpeed asserts it is greater than 0)")
    return int(value)


# The hidden-size keys Trainer fills (`trainer_config_finalize`), spelled as it looks them up: the bare
# prefetch_bucket_size and param_persistence_threshold stay "auto", and DeepSpeed takes its defaults.
_TRAINER_FILLS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _hf_auto(key: str, hidden_size: int | None, stage: int):
    """Trainer's fill of a hidden-size key as the file spells it; the stage-3 ones only at stage 3."""
    if hidden_size is None:
        return None
    if key == "reduce_bucket_size":
        return hidden_size * hidden_size
    if stage == 3 and key == "stage3_prefetch_bucket_size":
        return int(0.9 * hidden_size * hidden_size)
    if stage == 3 and key == "stage3_param_persistence_threshold":
        return 10 * hidden_size
    return None


_DEFAULTS = {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
             "param_persistence_threshold": 100_000}


def _given(cfg: dict, zero: ZeroConfig):
    """(path as the file spells it, value) of every key in `cfg`, descending into the blocks the table
    lists keys of; zero_optimization's fields as DeepSpeed coerced them."""
    for path, value in dskeys.leaves(cfg):
        head, _, name = path.partition(".")
        if head == "zero_optimization" and "." not in name:
            value = zero.values.get(ZERO_ALIASES.get(name, name), value)
        yield path, value


def not_modelled(cfg: dict, zero: ZeroConfig) -> list[str]:
    """One warning per key of `cfg` whose effect zerocalc does not model, given a value other than
    DeepSpeed's default (dskeys.KEYS); one per key the table does not know (DeepSpeed ignores it)."""
    out = []
    for path, value in _given(cfg, zero):
        entry = dskeys.lookup(path)
        if entry is None:
            out.append(f"unknown key {path} ignored (DeepSpeed ignores it too)")
            continue
        kind, default, _ = entry
        if kind != "not_modelled" or value is None or value == "auto" or value == default:
            continue
        if path == "tensor_parallel.autotp_size" and value == 1:
            continue   # one rank: no tensor parallelism
        out.append(f"{path} = {_show(value)} is not modelled: the answer is DeepSpeed's default's")
    return out


def _communication_data_type(comm):
    if comm is not None and (not isinstance(comm, str) or comm.lower() not in ("fp32", "fp16", "bf16")):
        _fail("communication_data_type", comm, "DeepSpeed takes fp16, bf16 or fp32")
    return None if comm is None else comm.lower()


def _read_in_order(cfg: dict):
    """(communication dtype, ZeroConfig, fp16, bf16), each block validated in the order DeepSpeed's
    `_initialize_params` reads them, so that of several faults the one named is DeepSpeed's."""
    comm = _communication_data_type(cfg.get("communication_data_type"))
    zero = read_zero(cfg.get("zero_optimization", {}))
    read_strict_blocks(cfg, ("comms_logger",) + _MONITORS)
    fp, bf = read_precision(cfg)
    read_strict_blocks(cfg, ("hybrid_engine", "weight_quantization", "compile", "timers.throughput", "tensor_parallel"))
    return comm, zero, fp, bf


def _auto_sizes(zero: ZeroConfig, hidden_size: int | None) -> tuple[dict, list[str]]:
    """The zero_optimization keys left at "auto": ({field: Trainer's fill}, a warning for each other
    one that moves memory or traffic; DeepSpeed drops those and takes its defaults)."""
    filled = {ZERO_ALIASES.get(k, k): _hf_auto(k, hidden_size, zero.stage) for k in zero.auto}
    filled = {name: value for name, value in filled.items() if value is not None}   # both spellings: the filled
    warnings = []
    for key in zero.auto:
        name = ZERO_ALIASES.get(key, key)
        if name in filled:
            continue
        if name in _DEFAULTS:
            why = (f"Trainer fills only its spelling stage3_{name}" if key not in _TRAINER_FILLS else
                   "no hidden size is known (give --model or --hf-config to resolve it)" if hidden_size is None
                   else "Trainer fills it only at stage 3")
            warnings.append(f"zero_optimization.{key} is \"auto\" and {why}: DeepSpeed's default "
                            f"{_DEFAULTS[name]:,} is used")
        elif dskeys.lookup(f"zero_optimization.{key}")[0] != "no_effect":
            warnings.append(f"zero_optimization.{key} is \"auto\", which Trainer does not fill: DeepSpeed "
                            "drops it and uses its default")
    return filled, warnings


def parse(cfg, hidden_size: int | None = None) -> DsConfig:
    """DsConfig from a loaded ds_config. Raises DsConfigError naming key and value."""
    if not isinstance(cfg, dict):
        raise DsConfigError(f"a ds_config is a JSON object {{...}}, this one is a {type(cfg).__name__}")
    if not cfg:
        raise DsConfigError("the ds_config is empty")
    for removed in REMOVED_TOP:
        if removed in cfg:
            raise DsConfigError(f"{removed}: removed in DeepSpeed 0.19.8, which refuses this key")
    out, warnings, needs = {}, [], []
    comm, zero, fp, bf = _read_in_order(cfg)
    warnings += not_modelled(cfg, zero)
    out["stage"] = zero.stage
    for name, setup_name in _MODELLED.items():
        if name in zero.values and name != "stage":
            out[setup_name] = zero.values[name]
    out["overlap_comm"] = zero.values.get("overlap_comm")
    if out["overlap_comm"] is None:
        del out["overlap_comm"]
    if out.get("sub_group_size") == 0:
        out["sub_group_size"] = 1   # 0 and 1 both put each parameter in its own sub-group (`_create_fp16_sub_groups`)
    filled, said = _auto_sizes(zero, hidden_size)
    out.update(filled)
    warnings += said
    out["offload_optimizer"] = zero.offload_optimizer
    out["offload_param"] = zero.offload_param

    fp16_auto = isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") == "auto"
    bf16_auto = isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled") == "auto"
    if cfg.get("bf16") is None and isinstance(cfg.get("bfloat16"), dict) and cfg["bfloat16"].get("enabled") == "auto":
        # Trainer fills bf16.enabled only (`trainer_config_process`); DeepSpeed drops the "auto" left here
        warnings.append("bfloat16.enabled is \"auto\", which Trainer does not fill (it fills bf16.enabled): DeepSpeed "
                        "drops it and leaves bf16 off; name the block \"bf16\" for Trainer to fill it")
    # `_do_error_check`: the low-precision master options need ZeRO
    for block, name, values in (("fp16", "fp16_master_weights_and_grads", fp),
                                ("bf16", "bf16_master_weights_and_grads", bf), ("bf16", "bf16_optimizer_states", bf)):
        if values.get(name) and zero.stage == 0:
            _fail(f"{block}.{name}", True, "supported only with ZeRO stage 1, 2 or 3")
    if bf.get("bf16_optimizer_states") and not bf.get("bf16_master_weights_and_grads"):
        _fail("bf16.bf16_optimizer_states", True, "needs bf16.bf16_master_weights_and_grads")
    if fp.get("enabled") and bf.get("enabled"):
        raise DsConfigError("fp16.enabled and bf16.enabled are both true: DeepSpeed refuses both at once "
                            "(bfloat16 and fp16 modes cannot be simultaneously enabled)")
    if fp.get("enabled"):
        out["dtype"] = "fp16"
    elif bf.get("enabled"):
        out["dtype"] = "bf16"
    elif fp16_auto and not bf16_auto:
        out["dtype"] = "fp16"
    elif bf16_auto and not fp16_auto:
        out["dtype"] = "bf16"
    elif not (fp16_auto and bf16_auto):
        out["dtype"] = "fp32"
    dtype_auto = tuple(k for k, a in (("fp16", fp16_auto), ("bf16", bf16_auto)) if a)

    batch = {k: _batch_value(k, cfg.get(k)) for k in
             ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    if cfg.get("train_micro_batch_size_per_gpu") == "auto":
        needs.append("micro-batch")
    if cfg.get("gradient_accumulation_steps") == "auto":
        needs.append("gas")

    opt = cfg.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict):
            _fail("optimizer", opt, "must be an object with a \"type\"")
        kind, params = opt.get("type"), opt.get("params")
        if kind is not None and not isinstance(kind, str):
            _fail("optimizer.type", kind, "must be a name such as \"AdamW\"")
        if kind is not None and params is not None and not isinstance(params, dict):
            _fail("optimizer.params", params, "must be an object such as {\"lr\": 1e-4}")
        if kind is not None:
            name = kind.lower()
            momentum = (params or {}).get("momentum", 0)
            if name == "sgd":
                out["optimizer"] = "sgd-momentum" if momentum not in (0, None, "auto") else "sgd"
            elif name in REMOVED_OPTIMIZERS:
                _fail("optimizer.type", kind, f"DeepSpeed 0.19.8's engine has no {REMOVED_OPTIMIZERS[name]} (the "
                      "1-bit optimizers were removed; it stops with AttributeError): use \"AdamW\" or \"Lamb\"")
            elif name in _OPTIMIZERS:
                out["optimizer"] = _OPTIMIZERS[name]
            else:
                warnings.append(f"optimizer {kind!r} is not modelled; Adam's 8 bytes/param are assumed")

    if comm is not None:
        out["communication_data_type"] = comm
    types = cfg.get("data_types", {})
    if not isinstance(types, dict):
        _fail("data_types", types, "must be an object {...}")
    acc = types.get("grad_accum_dtype")
    if acc is not None:
        if acc not in _DTYPES:
            _fail("data_types.grad_accum_dtype", acc, "must be fp32, fp16 or bf16")
        out["grad_accum_dtype"] = _DTYPES[acc]

    return DsConfig(out, batch["train_batch_size"], batch["train_micro_batch_size_per_gpu"],
                    batch["gradient_accumulation_steps"], tuple(warnings), tuple(needs), _has_auto(cfg), dtype_auto,
                    allgather_bucket_size=zero.values.get("allgather_bucket_size"))


def check_setup(ds: DsConfig, stage: int, dtype: str, grad_accum_dtype: str | None, offload_optimizer: str) -> None:
    """What DeepSpeed 0.19.8 refuses only once the setup is whole (the command line may set the stage,
    dtype or offload): an odd allgather_bucket_size where the ZeRO stage 1-2 optimizer runs
    (`stage_1_and_2.py`, `__init__`: "allgather_bucket_size must be a multiple of
    nccl_start_alignment_factor, 2"; measured, tests/data/cpu-dskeys.csv). Stage 1 with bf16 and fp32
    gradient accumulation without CPU offload runs BF16_Optimizer instead, which takes any size
    (`engine.py`, `_configure_optimizer`). Raises DsConfigError."""
    size = ds.allgather_bucket_size
    if size is None or size % 2 == 0 or stage not in (1, 2):
        return
    if runs_bf16_optimizer(stage, dtype, grad_accum_dtype, offload_optimizer):
        return
    _fail("zero_optimization.allgather_bucket_size", size, f"must be even at ZeRO stage {stage} (DeepSpeed 0.19.8 "
          "asserts it is a multiple of 2, though it changes nothing): give an even number or leave it out")


def resolve_batch(train_batch_size: int | None, micro_batch: int | None, gas: int | None, dp: int,
                  from_config: bool = False) -> tuple[int, int]:
    """(micro_batch, gas) by DeepSpeed's rules (`_set_batch_related_parameters`, `_batch_assertion`):
    train_batch_size = micro · gas · dp, the missing one derived by floor division and the identity
    then asserted; with only train_batch_size, gas is 1. Raises DsConfigError when they disagree
    or, for a ds_config, when neither train_batch_size nor a micro-batch is known."""
    tbs, mb, ga = train_batch_size, micro_batch, gas
    if tbs is None:
        if mb is None and from_config:
            raise DsConfigError("neither train_batch_size nor train_micro_batch_size_per_gpu is set (DeepSpeed "
                                "refuses that): add one to the ds_config or give --micro-batch")
        return mb or 1, ga or 1
    if mb is not None and ga is not None:
        pass
    elif mb is not None:
        ga = tbs // mb // dp
    elif ga is not None:
        mb = tbs // dp // ga
    else:
        ga, mb = 1, tbs // dp
    if mb < 1 or ga < 1 or mb * ga * dp != tbs:
        given = " × ".join(f"{n} {v}" for n, v, g in (("train_micro_batch_size_per_gpu", mb, micro_batch),
                                                       ("gradient_accumulation_steps", ga, gas)) if g is not None)
        raise DsConfigError(f"train_batch_size = {tbs} is not divisible by / equal to {given + ' × ' if given else ''}"
                            f"{dp} data-parallel ranks (DeepSpeed asserts train_batch_size = micro-batch × "
                            "accumulation × ranks): make them agree")
    return mb, ga


# ---- the file ----------------------------------------------------------------------------------

def _no_duplicates(pairs):
    """DeepSpeed's `dict_raise_error_on_duplicate_keys`: a key given twice in one object is refused."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen, dups = set(), []
        for k, _ in pairs:
            if k in seen and k not in dups:
                dups.append(k)
            seen.add(k)
        raise DsConfigError(f"duplicate key {', '.join(map(repr, dups))}: DeepSpeed refuses a key given twice")
    return d


def _strip_hjson_lite(text: str) -> str:
    """Comments (#, //, /* */) and trailing commas removed outside strings: the Hjson that real
    ds_configs use, for when the hjson package is not installed."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif c == "#" or text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    text, out, i = "".join(out), [], 0
    n = len(text)
    while i < n:   # second pass: a comma followed only by blanks and a closing bracket goes
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
            continue
        if c == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":
                i += 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _refuse_constant(name):
    raise DsConfigError(f"{name} is not a number DeepSpeed reads (hjson takes it for a string)")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):   # hjson fails on it too (OverflowError)
        raise DsConfigError(f"{text} is too large a number")
    return value


def loads(text: str):
    """Parse ds_config text as DeepSpeed does: with hjson (comments, trailing commas, unquoted keys
    and strings) when it is installed (it comes with DeepSpeed), else JSON with comments and
    trailing commas; duplicate keys refused either way. Raises DsConfigError."""
    try:
        import hjson
    except ImportError:
        hjson = None
    try:
        if hjson is not None:
            return hjson.loads(text, object_pairs_hook=_no_duplicates)
        try:
            return json.loads(_strip_hjson_lite(text), object_pairs_hook=_no_duplicates,
                              parse_constant=_refuse_constant, parse_float=_finite_float)
        except json.JSONDecodeError as err:
            raise DsConfigError(f"not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
                                "for Hjson syntax beyond comments and trailing commas, pip install hjson")
    except RecursionError:
        raise DsConfigError("nested too deeply to be a ds_config")
    except DsConfigError:
        raise
    except Exception as err:   # HjsonDecodeError is a ValueError; hjson 3.1 also raises IndexError on an
        # unterminated /* comment and OverflowError on 1e400: every failure of the parser is a refusal
        msg = getattr(err, "msg", None) or str(err)
        where = f" at line {err.lineno}, column {err.colno}" if hasattr(err, "lineno") else ""
        hint = "; Infinity and NaN are not numbers in Hjson or JSON" if re.search(r"\b(Infinity|NaN)\b", text) else ""
        raise DsConfigError(f"not valid Hjson/JSON ({msg}{where}){hint}")


def load(path: str):
    """The ds_config at `path` (any error names the file)."""
    text = read_text(path, "ds_config")
    try:
        return loads(text)
    except DsConfigError as err:
        raise DsConfigError(f"{path}: {err}")
