"""The peak: what is alive together on the busiest rank in each phase of a training step.

Each phase is the model states resident on the device (`zerocalc.states`), the gradients alive then,
the buffers DeepSpeed 0.19.8 allocates then (`../shared/reference/deepspeed-zero-facts.md`,
"Transients that set the peak", corrected where the H200 runs disagreed) and, when an architecture
and batch shape are known, activations (`zerocalc.activations`). A phase's number is its worst
moment; `peak_bytes` (the largest) predicts `torch.cuda.max_memory_allocated()`.
"""
from dataclasses import dataclass

from zerocalc import activations, stage3_trace
from zerocalc.comm import stage0_allreduce_bucket_tensors
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
    # The moments of the phase its worst was chosen from (backward's three), each a Phase: gradients and
    # buffers at their largest need not be at the phase's worst moment. () where it has one moment.
    moments: tuple = ()

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.grads_bytes + self.buffers_bytes + self.activation_bytes


def _worst(*candidates: Phase) -> Phase:
    """The candidate moment with the most bytes, which keeps all of them (`Phase.moments`)."""
    w = max(candidates, key=lambda ph: ph.total_bytes)   # not dataclasses.replace: plan makes hundreds
    return Phase(w.name, w.states_bytes, w.grads_bytes, w.buffers_bytes, w.activation_bytes, w.why, candidates)


def _forward(resident, gathered, act, why="activations and the loss on top of model states", accumulated=(0, 0)):
    """accumulated: (gradient bytes, buffer bytes) a later micro-step carries from the earlier ones
    under gradient accumulation ((0, 0) with one micro-step per step)."""
    grads, buffers = accumulated
    if grads or buffers:
        why += " + the gradients accumulated by the earlier micro-steps"
    return Phase("forward", resident, grads, gathered + buffers, act.forward_peak_bytes, why)


def _accumulated(model, setup) -> tuple[int, int]:
    """What a later micro-step's forward and backward start with under gradient accumulation (GAS > 1;
    H200 allocator histories `data/snapshots/t4-gas/`): stage 0 the bit16 gradients of every
    parameter; stage 1 those and the ipg bucket, which ZeRO-1 releases only at the boundary; stage 2
    the first micro-step's partition gradients, the accumulator. Stage 3: not measured, (0, 0)."""
    if setup.gas == 1 or setup.offload_optimizer != "none":
        return 0, 0
    if setup.stage == Stage.DISABLED:
        return setup.grad_accum_bytes * model.num_trainable, 0
    b = setup.param_bytes
    if setup.stage == Stage.OPTIMIZER_STATES:
        bucket = setup.comm_bytes * setup.reduce_bucket_size if setup.contiguous_gradients else 0
        return b * model.num_trainable, bucket
    if setup.stage == Stage.GRADIENTS:
        return b * max_grads_in_partition(model.trainable_numels, setup), 0
    return 0, 0


def _backward(resident, gathered, act, first_grads, first_buffers, end_grads, end_buffers, end_why,
              accumulated=(0, 0)):
    """Backward's worst moment of three (H200 allocator histories, `data/snapshots/`):
    - the loss's backward: everything kept and the loss path's fp32 gradients;
    - the last layer's backward: the loss path is gone, the layers' activations (and with
      checkpointing the layer rebuilt) are alive beside the first gradient (the head's) and what
      its hook allocated (`first_grads`, `first_buffers`);
    - its end: gradients and DeepSpeed's reduction buffers."""
    acc_grads, acc_buffers = accumulated
    loss = Phase("backward", resident, acc_grads, gathered + acc_buffers, act.loss_backward_peak_bytes,
                 "activations + the loss path's fp32 gradients at the start of backward"
                 + (" + the gradients accumulated by the earlier micro-steps" if acc_grads else ""))
    # ZeRO-1's accumulated buffer is the bucket the first hook would make: counted once.
    first = Phase("backward", resident, first_grads + acc_grads, gathered + max(first_buffers, acc_buffers),
                  act.first_layer_backward_bytes, "activations + the first gradient and what its hook allocates")
    end = Phase("backward", resident, end_grads, end_buffers, 0, end_why)
    return _worst(loss, first, end)


def _stage0(model, setup, st, act):
    # gradients, their buckets and the optimizer's copies: of the trained tensors only (P_t)
    p, b = model.num_trainable, setup.param_bytes
    resident, grads = st.resident_bytes, setup.grad_accum_bytes * p
    # At the end of backward the gradient all-reduce flattens one bucket at a time into a copy
    # (`allreduce_bucket`; a bucket of one tensor is a view of it), and casts it to
    # communication_data_type where that differs: the largest such transient.
    cast = setup.comm_bytes if setup.comm_bytes != b else 0
    flatten = max((b if len(tensors) > 1 else 0) * sum(tensors) + cast * sum(tensors)
                  for tensors in stage0_allreduce_bucket_tensors(model.trainable_numels))
    # FP16_Optimizer's step: an fp32 copy of each gradient, then a flat fp32 copy of all of them.
    step_copies = 8 * p if setup.mixed_precision else 0
    # FP16_Optimizer makes Adam state at init with a dummy step on fp32 zero gradients (4P, measured);
    # the bare fp32 optimizer makes it at the first step.
    init = Phase("init", resident, 4 * p, 0, 0, "parameters, fp32 master, Adam state and the dummy step's "
                 "fp32 gradients") if setup.mixed_precision else \
        Phase("init", resident - st.moments_bytes, 0, 0, 0, "parameters")
    acc = _accumulated(model, setup)
    return (
        init,
        _forward(resident, 0, act, accumulated=acc),
        _backward(resident, 0, act, b * model.head_trainable_numel, 0, grads, flatten,
                  "full gradients + the all-reduce bucket's flatten copy", acc),
        Phase("step", resident, grads + step_copies, 0, 0,
              "gradients + per-parameter fp32 copies + a flat fp32 copy (FP16_Optimizer)"
              if setup.mixed_precision else "gradients"),
    )


def _stage12(model, setup, st, act):
    # the flat group, its gradients and buckets: the trained tensors' (frozen ones stay in the module)
    part = partition(model.trainable_numels, setup)
    p, b, c, n = part.num_params, setup.param_bytes, setup.comm_bytes, setup.dp
    s = part.flat_shard
    resident = st.resident_bytes
    g_in = max_grads_in_partition(model.trainable_numels, setup)
    r = setup.reduce_bucket_size
    offload = setup.offload_optimizer != "none"
    # Under optimizer offload the reduced gradients go straight to the host's fp32 partition
    # (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`): no partition gradients on the device.
    in_partition = 0 if offload else b * g_in * (2 if setup.gas > 1 and setup.stage == Stage.GRADIENTS else 1)
    if setup.contiguous_gradients:
        # `setup_buckets` allocates the ipg buffer at the first gradient hook of every backward:
        # reduce_bucket_size elements (two with overlap_comm), whatever P is (measured: 954 MiB for a
        # 134M-parameter model at the default 5e8), freed after the step. Gradients are copied into
        # it and their autograd storage freed; a full buffer is reduced and the rank's part copied
        # into the partition gradients (b·G_in, allocated at the first reduction).
        ipg = c * r * (2 if setup.overlap else 1)
        if setup.stage == Stage.OPTIMIZER_STATES:
            # ZeRO-1 moves gradients into the buffer only at the end of backward, parameter by
            # parameter: before that all b·P autograd gradients; at the first reduction all but a
            # buffer's worth of them, beside the partition gradients.
            end_grads = b * max(p, max(p - r, 0) + (0 if offload else g_in))
            why = "autograd gradients not yet moved into the buffer (+ partition gradients)"
        else:
            end_grads, why = in_partition + b * model.largest_trainable_numel, "partition gradients + one autograd gradient"
        end_buffers, why = ipg, why + " + ipg buffer"
    else:
        # Without contiguous gradients each reduction flattens its bucket into a copy.
        ipg, bucket = 0, min(r, p)
        end_grads = (b * p if setup.stage == Stage.OPTIMIZER_STATES else b * bucket) + in_partition
        end_buffers, why = c * bucket, "autograd gradients + partition gradients + the bucket's flatten copy"
    cast = 4 * s if setup.mixed_precision else 0
    # Init (measured): module parameters b·P beside the flat copy b·Pp and the fp32 shard 4S; at N = 1
    # the shard is first cloned in the low precision (b·S more).
    init_extra = b * p + (b * s if n == 1 else 0)
    if offload:
        # Measured on H200 (N = 1 and 2, to 0.01%): init is the flat buffer beside the module's
        # parameters (the fp32 shard and the gradient staging buffer are on the host or come later);
        # the step runs on the host and writes the updated shard back in place.
        init = Phase("init", resident - b * model.largest_trainable_numel, 0, b * p, 0,
                     "module parameters beside the flat buffer (master, Adam state and fp32 gradients on the host)")
        step = Phase("step", resident, 0, 0, 0, "the flat parameters only: the optimizer steps on the host")
    else:
        init = Phase("init", resident - st.moments_bytes, 0, init_extra, 0,
                     "module parameters beside the flat buffer they are copied into (Adam state comes at the first step)")
        # Step: partition gradients, their flat copy b·S and its fp32 cast 4S (measured to the 0.1%).
        step = Phase("step", resident, b * g_in, b * s + cast, 0, "partition gradients + flatten + fp32 cast")
    acc = _accumulated(model, setup)
    return (
        init,
        _forward(resident, 0, act, accumulated=acc),
        _backward(resident, 0, act, b * model.head_trainable_numel, ipg, end_grads, end_buffers, why, acc),
        step,
    )


def _stage3(model, setup, st, act):
    part = partition(model.trainable_numels, setup)   # reduce-scatter and sub-groups: the trained tensors'
    b, c = setup.param_bytes, setup.comm_bytes
    resident = st.resident_bytes
    it = stage3_trace.simulate(model, setup)
    kept = b * (it.kept_after_forward_elements + stage3_trace.held_after_forward_elements(model, setup))
    # A coalesced fetch allocates a flat buffer and a per-parameter copy: ≈ 2·b·(numel fetched at once).
    # The big early prefetch comes while activations are small; at the end of forward, where the peak
    # is, a fetch is at most one module (measured at prefetch 5e7 and 5e8).
    fetch = 2 * b * min(setup.prefetch_bucket_size or model.largest_param_numel, model.largest_module_numel) \
        if setup.dp > 1 else 0
    reduce_scatter = c * min(setup.reduce_bucket_size, setup.dp * part.stage3_shard)
    sub = part.largest_sub_group
    # Init (measured on H200 at N = 1 and 2): the engine partitions parameter by parameter; it never
    # holds the whole module (the case study's "whole model first" does not happen). One tensor is
    # whole at a time, twice over when gathered from N > 1 ranks.
    init_extra = 0 if setup.zero_init else b * model.largest_param_numel * min(setup.dp, 2)
    init = Phase("init", resident - (0 if setup.offload_optimizer != "none" else st.moments_bytes), 0, init_extra, 0,
                 "partitions, fp32 master and gradient buffers (Adam state comes at the first step)")
    if setup.offload_param != "none" and not setup.zero_init:
        # Measured on H200 (N = 1 and 2): with parameter offload the module is on the device whole,
        # b·P, before its partitions move to the host.
        init = _worst(init, Phase("init", 0, 0, b * model.num_params, 0,
                                  "the whole module on the device before its partitions move to the host"))
    # Per sub-group: flatten b·sub + fp32 cast 4·sub (the largest sub-group; measured to 0.1% with
    # one and two sub-groups, 4% low with three), unless the optimizer steps on the host.
    step = Phase("step", resident, 0, 0, 0, "model states only: the optimizer steps on the host") \
        if setup.offload_optimizer != "none" else \
        Phase("step", resident, 0, (b + 4) * sub, 0, "per sub-group flatten + fp32 cast")
    return (
        init,
        _forward(resident, kept + fetch, act,
                 "activations + parameters kept gathered for backward (reuse rule, saved views) + the coalesced fetch"),
        _backward(resident, kept, act, b * model.head_trainable_numel, 0, b * model.largest_module_trainable_numel,
                  kept + reduce_scatter,
                  "gathered parameters + one module's gradients + the reduce-scatter buffer"),
        step,
    )


def phases(model: ModelSpec, setup: Setup, st: StateBytes, cal: dict | None = None) -> tuple[Phase, ...]:
    act = activations.breakdown(model, setup, cal) or activations.NONE
    if setup.stage == Stage.DISABLED:
        return _stage0(model, setup, st, act)
    if setup.stage == Stage.PARAMETERS:
        return _stage3(model, setup, st, act)
    return _stage12(model, setup, st, act)


def peak(ph: tuple[Phase, ...]) -> Phase:
    return max(ph, key=lambda x: x.total_bytes)
