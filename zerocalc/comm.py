"""Communication per optimizer step, collective by collective, as DeepSpeed 0.19.8 sends it.

`bytes` is the message size DeepSpeed's comms logger records (`deepspeed.comm.log_summary`): the whole
input for all_reduce and reduce_scatter_tensor, the per-rank shard for all_gather_into_tensor.
`wire_bytes` is what one rank sends on a ring: all-reduce 2(N−1)/N·L, reduce-scatter (N−1)/N·L,
all-gather (N−1)·L (L the logged size). k = gradient-accumulation steps.

Where this differs from the ZeRO paper (arXiv:1910.02054, §7): stages 1/2 all-reduce the gradients
(`use_multi_rank_bucket_allreduce=True` in `average_tensor`) instead of reduce-scattering them, so a
step sends 3(N−1)/N·Ψ on the wire, not 2Ψ; stage 2 reduces every micro-step; stage 3 re-gathers in
backward only what the reuse and prefetch rules released (`zerocalc.stage3_trace`), so 2Ψ, not 3Ψ,
for models that stay gathered.
"""
from dataclasses import dataclass
from functools import lru_cache
from math import ceil

from zerocalc.model import ModelSpec
from zerocalc import stage3_trace
from zerocalc.partition import partition, persistent_mask
from zerocalc.states import wide_stage3_elements
from zerocalc.training import Setup, Stage

# Stage 0 all-reduces gradients in buckets of this many elements, whatever reduce_bucket_size says
# (`MEMORY_OPT_ALLREDUCE_SIZE`, `runtime/constants.py`).
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


@lru_cache(maxsize=256)   # per model: `plan` asks for it at every stage-0 candidate
def stage0_allreduce_buckets(param_numels: tuple[int, ...]) -> tuple[int, ...]:
    """Elements in each of stage 0's gradient all-reduce buckets, in reduction order. The engine's
    `allreduce_no_retain` adds gradients in `module.parameters()` order and reduces the bucket once it
    holds more than MEMORY_OPT_ALLREDUCE_SIZE elements, so a bucket overshoots by up to its last tensor:
    the H200 comms logs of five stage-0 models of 1.1-3.0B (`data/h200-*.csv`, measured_comm_detail)
    show exactly these sizes (e.g. 2.8B seed-gpt
    h2560: 375,347,200 to 1,049,021,440 bytes, bf16, in six calls)."""
    return tuple(sum(bucket) for bucket in stage0_allreduce_bucket_tensors(param_numels))


@lru_cache(maxsize=256)   # per model: the peak of every stage-0 candidate of `plan` reads it too
def stage0_allreduce_bucket_tensors(param_numels: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each of `stage0_allreduce_buckets`' buckets as its gradients' elements. A bucket of one tensor
    (a parameter over MEMORY_OPT_ALLREDUCE_SIZE elements alone, or a last one left over) is reduced
    in place: `allreduce_bucket` flattens it with `_flatten_dense_tensors`, which returns a single
    tensor as a view (the H200 history of Gemma-2-2B at stage 0, `data/snapshots/hf-diag/`: its
    590M-element embedding's bucket allocates nothing, the two others one flat copy each)."""
    buckets, bucket, filled = [], [], 0
    for n in param_numels:
        bucket.append(n)
        filled += n
        if filled > MEMORY_OPT_ALLREDUCE_SIZE:
            buckets.append(tuple(bucket))
            bucket, filled = [], 0
    return tuple(buckets + ([tuple(bucket)] if bucket else []))


@dataclass(frozen=True)
class Collective:
    op: str            # all_reduce | all_gather_into_tensor | reduce_scatter_tensor
    phase: str         # backward, step, forward, ... (where in the step it runs)
    calls: int
    elements: int      # summed over calls
    bytes: int         # logged bytes, summed over calls
    wire_bytes: int    # ring bytes one rank sends, summed over calls

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _wire(op: str, logged_bytes: int, n: int) -> int:
    if n == 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * logged_bytes // n
    if op == "reduce_scatter_tensor":
        return (n - 1) * logged_bytes // n
    return (n - 1) * logged_bytes


def _coll(op, phase, calls, elements, elem_bytes, n) -> Collective:
    return Collective(op, phase, calls, elements, elements * elem_bytes, _wire(op, elements * elem_bytes, n))


def bucket_calls(model: ModelSpec, setup: Setup) -> int:
    """The gradient reductions of one backward at stages 1-3. DeepSpeed adds each gradient to the bucket
    as backward finishes it (`ModelSpec.gradient_order`), reducing the bucket first where the gradient
    would take it past reduce_bucket_size elements (`reduce_independent_p_g_buckets_and_remove_grads` in
    stage3.py and stage_1_and_2.py), and what is left at the end of backward. A tensor larger than the
    bucket goes alone: HF's "auto" bucket (h², smaller than most of a layer's matrices) reduces a layer
    tensor by tensor."""
    return model.buckets_filled(setup.activation_checkpointing, setup.reduce_bucket_size)


def collectives(model: ModelSpec, setup: Setup) -> tuple[Collective, ...]:
    """Gradients are reduced for the trained tensors only (`ModelSpec.trainable_numels`: frozen ones get
    no gradient; the engine's `_get_gradients_for_reduction` skips them at stage 0, stages 1-3 hook
    only the optimizer's), while stage 3 still gathers every parameter, frozen ones included."""
    n, k, c, b = setup.dp, setup.gas, setup.comm_bytes, setup.param_bytes
    trained = model.trainable_numels
    part = partition(model.param_numels, setup)
    tpart = part if trained is model.param_numels else partition(trained, setup)   # all train: the same
    p = tpart.num_params
    small = []
    if setup.stage == Stage.DISABLED:
        # One all-reduce of every gradient at the accumulation boundary; fp32 also all-reduces the
        # clipping norm (4 B, `clip_grad_norm_`).
        grads = _coll("all_reduce", "backward", len(stage0_allreduce_buckets(trained)), p, c, n)
        if not setup.mixed_precision:
            small.append(_coll("all_reduce", "step", 1, 1, 4, n))
        return (grads, *small)
    if setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS):
        # Gradients all-reduced in reduce_bucket_size buckets: once per step at stage 1 (and in
        # BF16_Optimizer), every micro-step at stage 2. Then each rank's updated slice is all-gathered.
        times = k if setup.stage == Stage.GRADIENTS and not setup.bf16_optimizer else 1
        grads = _coll("all_reduce", "backward", times * bucket_calls(model, setup), times * p, c, n)
        # At N = 1 DeepSpeed skips the all-gather: the partition is the whole flat buffer.
        gather = _coll("all_gather_into_tensor", "step", 1, tpart.flat_shard, b, n) if n > 1 else None
        if not setup.bf16_optimizer:
            # fp32 gradient norm (4 B, `get_grad_norm_direct`); fp16/bf16 also the overflow flag (1 B, `has_overflow`).
            small = [_coll("all_reduce", "step", 1, 1, 4, n)]
            if setup.mixed_precision:
                small.append(_coll("all_reduce", "step", 1, 1, 1, n))
        return tuple(c for c in (grads, gather, *small) if c is not None)
    # Stage 3. All-gathers of the non-persistent shards as the trace replay fetches them (every one in
    # forward, again what the reuse and prefetch rules released). Gradients: reduce-scatter of the
    # trained tensors' padded N·S3_t per micro-step. Step: the fp64 norm per sub-group of the trained
    # tensors (8 B), fp16's overflow flag, and an all-gather of the persistent parameters' shards
    # (frozen ones too: `persistent_parameters` holds every one).
    it = stage3_trace.simulate(model, setup)
    # PEFT's fp32 adapters under zero.Init are gathered in fp32 (`states.wide_stage3_elements`)
    widen = wide_stage3_elements(model, setup) != (0, 0)
    out = []
    for phase in ("forward", "backward"):
        calls, elements = it.all_gathers(phase)
        if elements:
            gather = _coll("all_gather_into_tensor", phase, k * calls, k * elements, b, n)
            wide = getattr(it, phase + "_wide_elements") if widen and not it.copies else 0
            out.append(_widened(gather, k * wide * (4 - b), n) if wide else gather)
    out.append(_coll("reduce_scatter_tensor", "backward", k * bucket_calls(model, setup),
                     k * n * tpart.stage3_shard, c, n))
    # The gradient norm per sub-group: fp64 (8 B) on the device, fp32 (4 B) when the optimizer is offloaded.
    norm_bytes = 4 if setup.offload_optimizer != "none" else 8
    out.append(_coll("all_reduce", "step", tpart.num_sub_groups, tpart.num_sub_groups, norm_bytes, n))
    if setup.dtype == "fp16":
        out.append(_coll("all_reduce", "step", 1, 1, 1, n))
    if part.persistent_shard and n > 1:
        # one call per persistent tensor (`_allgather_params_coalesced` loops over them)
        gather = _coll("all_gather_into_tensor", "step", part.persistent_tensors, part.persistent_shard, b, n)
        wide = _wide_persistent_shard(model, setup) if widen else 0
        out.append(_widened(gather, wide * (4 - b), n) if wide else gather)
    return tuple(out)


def _widened(c: Collective, extra_bytes: int, n: int) -> Collective:
    """The collective with `extra_bytes` more logged (fp32 tensors among 16-bit ones)."""
    return Collective(c.op, c.phase, c.calls, c.elements, c.bytes + extra_bytes, _wire(c.op, c.bytes + extra_bytes, n))


def _wide_persistent_shard(model: ModelSpec, setup: Setup) -> int:
    mask = persistent_mask(model.param_numels, setup)
    return sum(ceil(x / setup.dp) for x, m in zip(model.wide_numels(), mask) if m)


def total_bytes(colls: tuple[Collective, ...]) -> int:
    return sum(c.bytes for c in colls)


def total_wire_bytes(colls: tuple[Collective, ...]) -> int:
    return sum(c.wire_bytes for c in colls)
