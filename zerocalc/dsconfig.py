"""Read a real DeepSpeed ds_config.json into Setup fields.

Keys follow DeepSpeed 0.19.8's config (`runtime/config.py`, `runtime/zero/config.py`). Hugging Face
Trainer's "auto" values are resolved the way its DeepSpeed integration does
(`transformers/integrations/deepspeed.py`: reduce_bucket_size = h², stage3_prefetch_bucket_size =
0.9·h², stage3_param_persistence_threshold = 10·h) when the hidden size is known; batch sizes left at
"auto" must come from the command line. Unknown keys produce warnings, never errors.
"""
from dataclasses import dataclass, field

from zerocalc.training import DTYPE_BYTES

_ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "max_reuse_distance": "max_reuse_distance",
    "sub_group_size": "sub_group_size",
}
# Keys DeepSpeed reads that change neither memory nor communication in this model (or that 0.19.8
# ignores: allgather_bucket_size and allgather_partitions, see the facts file).
_ZERO_IGNORED = {"allgather_partitions", "allgather_bucket_size", "reduce_scatter", "round_robin_gradients",
                 "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                 "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
                 "use_multi_rank_bucket_allreduce", "zero_hpz_partition_size", "zero_quantized_weights",
                 "zero_quantized_gradients", "memory_efficient_linear", "cpu_offload", "legacy_stage1"}
_TOP_IGNORED = {"gradient_clipping", "steps_per_print", "wall_clock_breakdown", "scheduler", "zero_allow_untested_optimizer",
                "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "tensorboard", "wandb",
                "csv_monitor", "comms_logger", "flops_profiler", "activation_checkpointing", "checkpoint",
                "dump_state", "zero_force_ds_cpu_optimizer", "memory_breakdown", "amp", "seed", "logging"}
_INT_FIELDS = {"stage", "reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold",
               "model_persistence_threshold", "max_reuse_distance", "sub_group_size"}
_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "onebitadam": "adam", "fusedadam": "adam"}


@dataclass(frozen=True)
class DsConfig:
    fields: dict                                    # Setup field -> value
    train_batch_size: int | None = None
    warnings: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()                     # "auto" values the command line must supply
    extra: dict = field(default_factory=dict)


def _number(key, value, ints=True):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"ds_config: {key} must be a number, got {value!r}")
    if ints and value != int(value):
        raise ValueError(f"ds_config: {key} must be a whole number, got {value!r}")
    return int(value) if ints else value


def _bool(key, value):
    if not isinstance(value, bool):
        raise ValueError(f"ds_config: {key} must be true or false, got {value!r}")
    return value


def _hf_auto(key: str, hidden_size: int | None):
    if hidden_size is None:
        return None
    return {"reduce_bucket_size": hidden_size * hidden_size,
            "prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "param_persistence_threshold": 10 * hidden_size}.get(key)


def _read_zero(zero: dict, hidden_size, out, warnings, needs):
    if not isinstance(zero, dict):
        raise ValueError("ds_config: zero_optimization must be an object")
    for key, value in zero.items():
        if key in ("offload_optimizer", "offload_param"):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"ds_config: zero_optimization.{key} must be an object with a \"device\"")
            device = value.get("device", "none")
            if device not in ("none", "cpu", "nvme"):
                raise ValueError(f"ds_config: zero_optimization.{key}.device must be none, cpu or nvme, got {device!r}")
            out[key] = device
        elif key in _ZERO_KEYS:
            name = _ZERO_KEYS[key]
            if value == "auto":
                resolved = _hf_auto(name, hidden_size)
                if resolved is None:
                    warnings.append(f"zero_optimization.{key} is \"auto\" and no hidden size is known: "
                                    "DeepSpeed's default is used (give --model or --hidden-size to resolve it)")
                else:
                    out[name] = resolved
            elif name in _INT_FIELDS:
                out[name] = _number(f"zero_optimization.{key}", value)
            else:
                out[name] = _bool(f"zero_optimization.{key}", value)
        elif key not in _ZERO_IGNORED:
            warnings.append(f"unknown key zero_optimization.{key} ignored")


def parse(cfg: dict, hidden_size: int | None = None) -> DsConfig:
    """DsConfig from a parsed ds_config.json. Raises ValueError for wrong types."""
    if not isinstance(cfg, dict):
        raise ValueError("ds_config must be a JSON object")
    out, warnings, needs, tbs = {}, [], [], None
    for key, value in cfg.items():
        if key == "zero_optimization":
            _read_zero(value, hidden_size, out, warnings, needs)
        elif key in ("fp16", "bf16", "bfloat16"):
            if isinstance(value, dict) and value.get("enabled") not in (False, None):
                if value.get("enabled") == "auto":
                    warnings.append(f"{key}.enabled is \"auto\": taken as enabled")
                out["dtype"] = "fp16" if key == "fp16" else "bf16"
        elif key == "train_micro_batch_size_per_gpu":
            if value == "auto":
                needs.append("micro-batch")
            else:
                out["micro_batch"] = _number(key, value)
        elif key == "gradient_accumulation_steps":
            if value == "auto":
                needs.append("gas")
            else:
                out["gas"] = _number(key, value)
        elif key == "train_batch_size":
            if value != "auto":
                tbs = _number(key, value)
        elif key == "optimizer":
            if not isinstance(value, dict) or not isinstance(value.get("type"), str):
                raise ValueError("ds_config: optimizer must be an object with a \"type\"")
            name = value["type"].lower()
            momentum = (value.get("params") or {}).get("momentum", 0)
            if name == "sgd":
                out["optimizer"] = "sgd-momentum" if momentum else "sgd"
            elif name in _OPTIMIZERS:
                out["optimizer"] = _OPTIMIZERS[name]
            else:
                warnings.append(f"optimizer {value['type']!r} is not modelled; Adam's 8 bytes/param are assumed")
        elif key == "communication_data_type":
            if value not in DTYPE_BYTES:
                raise ValueError(f"ds_config: communication_data_type must be one of fp32, fp16, bf16, got {value!r}")
            out["communication_data_type"] = value
        elif key == "data_types":
            if not isinstance(value, dict):
                raise ValueError("ds_config: data_types must be an object")
            acc = value.get("grad_accum_dtype")
            if acc is not None:
                if acc not in DTYPE_BYTES:
                    raise ValueError(f"ds_config: data_types.grad_accum_dtype must be fp32, fp16 or bf16, got {acc!r}")
                out["grad_accum_dtype"] = acc
        elif key not in _TOP_IGNORED:
            warnings.append(f"unknown key {key} ignored")
    return DsConfig(out, tbs, tuple(warnings), tuple(needs))


def resolve_batch(train_batch_size: int | None, micro_batch: int | None, gas: int | None, dp: int) -> tuple[int, int]:
    """(micro_batch, gas) consistent with DeepSpeed's rule train_batch_size = micro · gas · dp.
    Raises ValueError when the numbers do not divide or disagree."""
    if train_batch_size is None:
        return micro_batch or 1, gas or 1
    if micro_batch is not None and gas is not None:
        if micro_batch * gas * dp != train_batch_size:
            raise ValueError(f"train_batch_size {train_batch_size} != micro-batch {micro_batch} × gas {gas} × dp {dp}")
        return micro_batch, gas
    if micro_batch is not None:
        if train_batch_size % (micro_batch * dp):
            raise ValueError(f"train_batch_size {train_batch_size} is not divisible by micro-batch {micro_batch} × dp {dp}")
        return micro_batch, train_batch_size // (micro_batch * dp)
    gas = gas or 1
    if train_batch_size % (gas * dp):
        raise ValueError(f"train_batch_size {train_batch_size} is not divisible by gas {gas} × dp {dp}")
    return train_batch_size // (gas * dp), gas
