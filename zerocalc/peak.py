"""The peak: what is alive together on the busiest rank in each phase of a training step.

Each phase is the model states resident on the device (`zerocalc.states`), the gradients alive then,
the buffers DeepSpeed 0.19.8 allocates then (`../shared/reference/deepspeed-zero-facts.md`,
"Transients that set the peak") and, when an architecture and batch shape are known, activations
(`zerocalc.activations`). `peak_bytes` predicts `torch.cuda.max_memory_allocated()`.
"""
from dataclasses import dataclass

from zerocalc import activations
from zerocalc import stage3_trace
from zerocalc.comm import MEMORY_OPT_ALLREDUCE_SIZE
from zerocalc.model import ModelSpec
from zerocalc.partition import max_grads_in_partition, partition
from zerocalc.states import StateBytes
from zerocalc.training import Setup, Stage


@dataclass(frozen=True)
class Phase:
    name: str                # init | forward | backward | step
    states_bytes: int        # model states resident on the device
    grads_bytes: int         # gradients (and copies of them) alive at the phase's worst moment
    buffers_bytes: int       # DeepSpeed's buffers then: buckets, flatten copies, gathered parameters, casts
    activation_bytes: int    # activations, logits and loss then; 0 when unknown
    why: str

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.grads_bytes + self.buffers_bytes + self.activation_bytes


def _stage0(model, setup, st, act):
    p, b = sum(model.param_numels), setup.param_bytes
    resident, grads = st.resident_bytes, setup.grad_accum_bytes * p
    # The gradient all-reduce flattens each bucket (MEMORY_OPT_ALLREDUCE_SIZE elements) into a copy.
    flatten = b * min(p, MEMORY_OPT_ALLREDUCE_SIZE)
    # FP16_Optimizer's step: an fp32 copy of each gradient, then a flat fp32 copy of all of them.
    step_copies = 8 * p if setup.mixed_precision else 0
    # FP16_Optimizer makes Adam state at init with a dummy step; the bare fp32 optimizer at the first step.
    init_states = resident if setup.mixed_precision else resident - st.moments_bytes
    return (
        Phase("init", init_states, 0, 0, 0, "parameters and optimizer states"),
        Phase("forward", resident, 0, 0, act.forward_peak_bytes, "activations on top of model states"),
        Phase("backward", resident, grads, flatten, act.backward_peak_bytes,
              "full gradients + the all-reduce flatten copy"),
        Phase("step", resident, grads + step_copies, 0, 0,
              "gradients + per-parameter fp32 copies + a flat fp32 copy (FP16_Optimizer)"
              if setup.mixed_precision else "gradients"),
    )


def _stage12(model, setup, st, act):
    part = partition(model.param_numels, setup)
    p, b, c = part.num_params, setup.param_bytes, setup.comm_bytes
    resident = st.resident_bytes
    g_in = max_grads_in_partition(model.param_numels, setup)
    bucket = min(setup.reduce_bucket_size, p)
    ipg = c * bucket * (2 if setup.overlap and setup.stage == Stage.GRADIENTS else 1) \
        if setup.contiguous_gradients else 0
    in_partition = b * g_in * (2 if setup.gas > 1 and setup.stage == Stage.GRADIENTS else 1)
    if setup.stage == Stage.OPTIMIZER_STATES:
        bwd_grads, why = b * p + in_partition, "full autograd gradients (reduced at the boundary) + partition gradients"
    else:
        bwd_grads, why = b * bucket + in_partition, "one bucket of autograd gradients + partition gradients"
    cast = 4 * part.flat_shard if setup.mixed_precision else 0
    # Step: partition gradients, their flat copy b·S, its fp32 cast 4S, and the fp64 norm of one slice.
    step_buffers = b * part.flat_shard + cast + 8 * min(max(model.param_numels), part.flat_shard)
    return (
        Phase("init", resident - st.moments_bytes, 0, b * p, 0,
              "module parameters beside the flat buffer they are copied into (Adam state comes at the first step)"),
        Phase("forward", resident, 0, 0, act.forward_peak_bytes, "activations on top of model states"),
        Phase("backward", resident, bwd_grads, ipg + c * bucket, act.backward_peak_bytes,
              why + " + ipg bucket(s) + flatten copy"),
        Phase("step", resident, b * g_in, step_buffers, 0, "partition gradients + flatten + fp32 cast + fp64 norm"),
    )


def _stage3(model, setup, st, act):
    part = partition(model.param_numels, setup)
    p, b, c = part.num_params, setup.param_bytes, setup.comm_bytes
    resident = st.resident_bytes
    it = stage3_trace.simulate(model, setup)
    kept = b * it.kept_after_forward_elements
    # A coalesced fetch allocates a flat buffer and a per-parameter copy: ≈ 2·b·(numel fetched at once).
    fetch = 2 * b * min(setup.prefetch_bucket_size or max(model.param_numels), part.gathered_shard * setup.dp)
    largest_module = model.largest_module_numel
    reduce_scatter = c * min(setup.reduce_bucket_size, setup.dp * part.stage3_shard)
    sub = min(setup.sub_group_size, part.stage3_shard)
    return (
        # Built outside deepspeed.zero.Init (as the case study does), the engine moves the whole cast
        # module to the device before partitioning it; under zero.Init parameters are born partitioned.
        Phase("init", resident - st.moments_bytes, 0, 0 if setup.zero_init else b * p, 0,
              "partitions only (zero.Init)" if setup.zero_init else
              "the whole module on the device before partitioning (Adam state comes at the first step)"),
        Phase("forward", resident, 0, kept + fetch, act.forward_peak_bytes,
              "parameters kept gathered for backward (reuse rule) + the coalesced fetch"),
        Phase("backward", resident, b * largest_module, kept + reduce_scatter, act.backward_peak_bytes,
              "gathered parameters + one module's gradients + the reduce-scatter buffer"),
        Phase("step", resident, 0, b * sub + 4 * sub, 0, "per sub-group flatten + fp32 cast"),
    )


def phases(model: ModelSpec, setup: Setup, st: StateBytes) -> tuple[Phase, ...]:
    act = activations.breakdown(model, setup) or activations.NONE
    if setup.stage == Stage.DISABLED:
        return _stage0(model, setup, st, act)
    if setup.stage == Stage.PARAMETERS:
        return _stage3(model, setup, st, act)
    return _stage12(model, setup, st, act)


def peak(ph: tuple[Phase, ...]) -> Phase:
    return max(ph, key=lambda x: x.total_bytes)
