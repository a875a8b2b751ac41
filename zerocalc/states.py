"""Per-rank bytes of model states as DeepSpeed 0.19.8 really holds them.

Two views of each component: `*_bytes` is what stays resident after `step()` (what the validator
reads off the engine's own tensors and must match to the byte), and `largest_*` is the component at
its largest within a step (what `per_rank_bytes` reports, gradients included although DeepSpeed
frees them after the step). Notation: P params, N ranks, b = param dtype bytes, c = communication
dtype bytes, g = gradient-accumulation dtype bytes, K = optimizer state bytes per parameter (Adam 8),
Pp, S, S3 as in `zerocalc.partition`. Source: `../shared/reference/deepspeed-zero-facts.md`, checked
by `tests/test_against_deepspeed.py` on real 2-rank CPU jobs.
"""
from dataclasses import dataclass

from zerocalc.model import ModelSpec
from zerocalc.partition import max_grads_in_partition, partition, persistent_mask
from zerocalc.training import Setup, Stage

MASTER_BYTES = 4   # fp32 master weights


@dataclass(frozen=True)
class StateBytes:
    params_bytes: int            # low-precision (or fp32) parameters held on this rank
    master_bytes: int            # fp32 master copy (0 at stage 0 fp32, where the params are the master)
    moments_bytes: int           # optimizer state: Adam exp_avg + exp_avg_sq
    grads_bytes: int             # gradient storage that persists across steps
    buffers_bytes: int           # communication buffers kept between steps, module buffers
    largest_grads_bytes: int     # gradients at their largest during a step
    cpu_bytes: int               # the part of the above that offload keeps in host memory

    @property
    def optimizer_states_bytes(self) -> int:
        return self.master_bytes + self.moments_bytes

    @property
    def total_bytes(self) -> int:
        """Device and host together, after the step."""
        return self.params_bytes + self.master_bytes + self.moments_bytes + self.grads_bytes + self.buffers_bytes

    @property
    def resident_bytes(self) -> int:
        """On the device, after the step: what `validate` compares exactly on GPUs."""
        return self.total_bytes - self.cpu_bytes


def _module_buffers_bytes(model: ModelSpec, setup: Setup) -> int:
    # Llama's rotary `inv_freq` buffers stay fp32 under bf16 training (measured on 2-rank CPU jobs;
    # the engine's `_cast_module_mixed_precision` leaves them as they are), except when the model is
    # built under zero.Init at stage 3: its tensor constructors make floating-point tensors in the
    # training dtype (`zero_wrapper_for_fp_tensor_constructor`, `partition_parameters.py`; measured on
    # H200: a 254M Llama's two 32-element buffers held 128 bytes, not 256, data/h200-host-d.csv).
    return sum(module_buffers_bytes(model, setup))


def module_buffers_bytes(model: ModelSpec, setup: Setup) -> list[int]:
    """Each module buffer's bytes on the device: from its dtypes where the model was traced
    (`ModelSpec.buffer_bytes`: a bool causal mask is 1 byte an element; under zero.Init a
    floating-point buffer takes the training dtype where DeepSpeed's tensor constructors made it,
    and keeps fp32 where the model's code cast it after them, as a YaRN rotary `inv_freq` or a
    `_keep_in_fp32_modules_strict` buffer); else by `buffer_element_bytes`."""
    if model.buffer_bytes is None:
        return [n * buffer_element_bytes(setup) for n in model.buffer_numels]
    zero3 = setup.zero_init and setup.stage == Stage.PARAMETERS
    return [n * ((under or setup.param_bytes) if zero3 else built)
            for n, (built, under) in zip(model.buffer_numels, model.buffer_bytes)]


def buffer_element_bytes(setup: Setup) -> int:
    """Bytes of a module buffer's element as `_module_buffers_bytes` counts it (the rule above)."""
    return setup.param_bytes if setup.zero_init and setup.stage == Stage.PARAMETERS else 4


def wide_stage3_elements(model: ModelSpec, setup: Setup) -> tuple[int, int]:
    """(partition elements, whole persistent elements) of the tensors a stage-3 rank holds in fp32
    although training is 16-bit: PEFT makes its adapters in fp32 (`get_peft_model`'s
    `autocast_adapter_dtype=True`), and the engine casts parameters to the training dtype only for a
    model not built under zero.Init (`_cast_module_mixed_precision`, `runtime/engine.py`), so after a
    zero.Init build the adapters are partitioned, kept whole and gathered in fp32 (measured on 2-rank
    CPU jobs, validate/matrices/cpu-lora.json). Their gradients are reduced in the communication dtype
    and their master is fp32 as any other's. (0, 0) elsewhere."""
    if not (setup.stage == Stage.PARAMETERS and setup.zero_init and setup.mixed_precision and model.wide):
        return 0, 0
    wide = model.wide_numels()
    mask = persistent_mask(model.param_numels, setup)
    shards = sum(-(-x // setup.dp) for x in wide)
    whole = sum(setup.dp * -(-x // setup.dp) for x, m in zip(wide, mask) if m) if setup.dp > 1 else 0
    if setup.dp == 1 and setup.offload_param != "none":
        whole = sum(-(-x // setup.dp) for x, m in zip(wide, mask) if m)
    return shards, whole


def model_states(model: ModelSpec, setup: Setup) -> StateBytes:
    """Frozen parameters (`ModelSpec.trainable`; LoRA's base weights) are held but never optimized:
    DeepSpeed builds its optimizer state from the optimizer's param groups, `requires_grad` ones only.
    Below, P_t and the `t` partition are the trained tensors', P_f = P − P_t the frozen ones'."""
    numels, trained = model.param_numels, model.trainable_numels
    part = partition(numels, setup)
    tpart = part if trained is numels else partition(trained, setup)   # all train: the same tensors
    p_t, b, k = tpart.num_params, setup.param_bytes, setup.optimizer.state_bytes_per_param
    p_f = part.num_params - p_t
    buffers = _module_buffers_bytes(model, setup)
    if setup.stage == Stage.DISABLED:
        # fp32: the bare optimizer steps the module's own parameters, no master copy.
        # fp16/bf16: FP16_Optimizer keeps a flat fp32 master of the trained P_t (`fp32_groups_flat`, of
        # the `is_optimized_parameter` ones, `fp16/fused_optimizer.py`); every parameter stays b·P.
        master = MASTER_BYTES * p_t if setup.mixed_precision else 0
        return StateBytes(b * part.num_params, master, k * p_t, 0, buffers, setup.grad_accum_bytes * p_t, 0)
    if setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS):
        # Only the trained tensors are flattened and partitioned; frozen ones stay whole on every rank
        # in the module, b·P_f (LoRA: the whole base model on every rank at stages 1/2).
        s, g_in = tpart.flat_shard, max_grads_in_partition(trained, setup)
        flat = b * tpart.padded_flat + b * p_f
        if setup.bf16_optimizer:
            # BF16_Optimizer: a persistent full fp32 gradient buffer of Pp (`non_expert_gradients`).
            return StateBytes(flat, MASTER_BYTES * s, k * s, 4 * tpart.padded_flat, buffers,
                              4 * tpart.padded_flat, 0)
        # `bit16_groups_flat` b·Pp, `single_partition_of_fp32_groups` 4S (cloned even in fp32), Adam K·S
        # created at the first step. No gradient storage outlives the step.
        # Largest gradients: stage 1 reduces only after the whole backward, so the full autograd
        # gradients b·P exist beside `grads_in_partition` b·G_in; stage 2 keeps b·G_in (twice under GAS:
        # the accumulator and the new micro-step's).
        grads_in_partition = b * g_in
        largest = b * p_t + grads_in_partition if setup.stage == Stage.OPTIMIZER_STATES else \
            grads_in_partition * (2 if setup.gas > 1 else 1)
        if setup.offload_optimizer == "none":
            return StateBytes(flat, MASTER_BYTES * s, k * s, 0, buffers, largest, 0)
        # Optimizer offload (measured on 2-rank CPU jobs): master and moments on the host, fp32 gradient
        # partitions there too (`offload_gradient_dict`, 4S), a host copy of the low-precision shard for
        # the upload (b·S), and a gradient staging buffer of the largest tensor on each side.
        # Stage 2 under GAS > 1 also accumulates the shard's gradients on the host (`accumulated_grads_in_cpu`, b·S).
        staging = b * model.largest_trainable_numel
        accumulate = b * s if setup.stage == Stage.GRADIENTS and setup.gas > 1 else 0
        host = MASTER_BYTES * s + k * s + 4 * s + b * s + staging + accumulate
        return StateBytes(flat, MASTER_BYTES * s, k * s, 4 * s + accumulate,
                          buffers + b * s + 2 * staging, largest, host)
    # Stage 3: partitions ⌈nᵢ/N⌉ of every parameter, frozen ones included (the trained ones defragmented
    # into `lp_param_buffer`, the frozen keep their own `ds_tensor`: b·S3 either way), a separate fp32
    # master 4·S3_t (a copy even in fp32), Adam K·S3_t, `grad_partitions_flat_buffer` g·S3_t, the ipg
    # bucket c·RBS allocated at init and kept (with contiguous_gradients), and persistent parameters
    # whole, b·Σ_pers nᵢ (frozen or not: `mark_persistent_parameters` walks the module). At
    # N = 1 a partition is the whole parameter and serves as it, unless parameters are offloaded: then
    # the persistent ones are also kept whole on the device (measured on H200: 1,286,144 bytes for the
    # 1.4B GPT's biases and norms, b·Σ_pers nᵢ).
    s3, s3_t = part.stage3_shard, tpart.stage3_shard
    whole = part.persistent_shard if setup.dp == 1 and setup.offload_param != "none" else part.persistent
    params = b * (s3 + whole)
    wide_shard, wide_whole = wide_stage3_elements(model, setup)
    params += (MASTER_BYTES - b) * (wide_shard + wide_whole)
    grads = setup.grad_accum_bytes * s3_t
    ipg = setup.comm_bytes * setup.reduce_bucket_size if setup.contiguous_gradients else 0
    # Offload: the same tensors (their total measured on 2-rank CPU jobs), on the host: master, moments
    # and `grad_partitions_flat_buffer` (created on `self.device`, the CPU under optimizer offload;
    # measured on H200: the device keeps only the ipg bucket and persistent parameters), and with
    # parameter offload the low-precision partitions too (`fp16_partitioned_groups_flat`).
    host = (MASTER_BYTES + k) * s3_t + grads if setup.offload_optimizer != "none" else 0
    host += b * s3 if setup.offload_param != "none" else 0
    return StateBytes(params, MASTER_BYTES * s3_t, k * s3_t, grads, ipg + buffers, grads, host)
