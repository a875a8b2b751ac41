"""How it is trained: ZeRO stage, data-parallel size, dtypes, buckets, offload and batch shape.

Defaults are DeepSpeed 0.19.8's (`runtime/zero/config.py`, `runtime/constants.py`); a reader can
compare each field with the ds_config.json key named beside it.
"""
from dataclasses import dataclass, field
from enum import IntEnum


class Stage(IntEnum):
    """ZeRO stages, ordered so that `stage >= Stage.GRADIENTS` reads as 'gradients are sharded'."""
    DISABLED = 0
    OPTIMIZER_STATES = 1
    GRADIENTS = 2
    PARAMETERS = 3


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Optimizer:
    """`state_bytes_per_param`: K of the ZeRO paper minus the fp32 master copy (held by DeepSpeed's
    wrapper, not the optimizer). Adam/AdamW: exp_avg + exp_avg_sq in fp32 = 8."""
    name: str
    state_bytes_per_param: int


OPTIMIZERS = {
    "adam": Optimizer("Adam", 8),
    "adamw": Optimizer("AdamW", 8),
    "sgd": Optimizer("SGD", 0),
    "sgd-momentum": Optimizer("SGD", 4),   # momentum_buffer, fp32
}

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ATTENTION = ("eager", "sdpa", "flash")


@dataclass(frozen=True)
class Setup:
    stage: Stage = Stage.GRADIENTS
    dp: int = 1                                  # data-parallel ranks N (world size without TP/PP)
    dtype: str = "bf16"                          # fp16.enabled / bf16.enabled, else fp32
    optimizer: Optimizer = OPTIMIZERS["adamw"]
    gas: int = 1                                 # gradient_accumulation_steps
    grad_accum_dtype: str | None = None          # data_types.grad_accum_dtype (None: the model dtype)
    communication_data_type: str | None = None   # communication_data_type (None: the model dtype)
    reduce_bucket_size: int = 500_000_000        # zero_optimization.reduce_bucket_size, elements
    overlap_comm: bool | None = None             # None: DeepSpeed's default (True only at stage 3)
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = 50_000_000       # stage3_prefetch_bucket_size, elements
    max_live_parameters: int = 1_000_000_000     # stage3_max_live_parameters
    param_persistence_threshold: int = 100_000   # stage3_param_persistence_threshold, elements
    model_persistence_threshold: int = 2**63 - 1  # stage3_model_persistence_threshold
    max_reuse_distance: int = 1_000_000_000      # stage3_max_reuse_distance
    sub_group_size: int = 1_000_000_000          # sub_group_size
    offload_optimizer: str = "none"              # offload_optimizer.device
    offload_param: str = "none"                  # offload_param.device (stage 3 only)
    micro_batch: int = 1                         # train_micro_batch_size_per_gpu
    seq_len: int | None = None
    activation_checkpointing: bool = False
    zero_init: bool = False                      # model built under deepspeed.zero.Init (stage 3)
    attention: str = "sdpa"
    expandable_segments: bool = False            # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch's
                                                 # caching allocator, not DeepSpeed): changes reserved only
    hf_trainer: bool = False                     # trained through HF Trainer, its loop around the engine
                                                 # (a ds_config with "auto" values): changes the step time only
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def comm_bytes(self) -> int:
        return DTYPE_BYTES[self.communication_data_type or self.dtype]

    @property
    def grad_accum_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_accum_dtype or self.dtype]

    @property
    def overlap(self) -> bool:
        return self.stage == Stage.PARAMETERS if self.overlap_comm is None else self.overlap_comm

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @property
    def bf16_optimizer(self) -> bool:
        return runs_bf16_optimizer(self.stage, self.dtype, self.grad_accum_dtype, self.offload_optimizer)


def runs_bf16_optimizer(stage: int, dtype: str, grad_accum_dtype: str | None, offload_optimizer: str) -> bool:
    """Whether DeepSpeed 0.19.8 wraps the optimizer in BF16_Optimizer rather than ZeRO's stage-1 one:
    stage 1, bf16, fp32 gradient accumulation, and the optimizer not offloaded to the CPU
    (`runtime/engine.py`, `_do_optimizer_sanity_check`: `... and not self.zero_cpu_offload()`, true of
    offload device "cpu" only, so "nvme" keeps BF16_Optimizer). Every other ZeRO stage 1-3 setup runs ZeRO's
    optimizer. Measured on 2-rank CPU jobs: tests/test_dskeys_measured.py."""
    return stage == Stage.OPTIMIZER_STATES and dtype == "bf16" and grad_accum_dtype == "fp32" \
        and offload_optimizer != "cpu"


def validate_setup(s: Setup) -> None:
    """Raise ValueError with a message that says what to fix."""
    if s.stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {s.stage}")
    if s.dp < 1:
        raise ValueError(f"data-parallel size must be at least 1, got {s.dp}")
    for name in ("dtype", "grad_accum_dtype", "communication_data_type"):
        value = getattr(s, name)
        if value is not None and value not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {value!r}")
    for name in ("gas", "micro_batch", "reduce_bucket_size", "sub_group_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be a positive integer, got {getattr(s, name)}")
    if s.seq_len is not None and s.seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {s.seq_len}")
    for name in ("offload_optimizer", "offload_param"):
        if getattr(s, name) not in OFFLOAD_DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(OFFLOAD_DEVICES)}, got {getattr(s, name)!r}")
    if s.offload_param != "none" and s.stage != Stage.PARAMETERS:
        raise ValueError("offload_param needs ZeRO stage 3 (DeepSpeed only offloads parameters at stage 3)")
    if s.offload_optimizer != "none" and s.stage == Stage.DISABLED:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if s.attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {s.attention!r}")
