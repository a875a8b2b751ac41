"""How DeepSpeed 0.19.8 cuts a model's parameter tensors across N data-parallel ranks.

Notation (the ZeRO paper's where it has one): Ψ = P = Σ nᵢ parameters, N = data-parallel ranks.
"""
from dataclasses import dataclass
from functools import lru_cache
from math import ceil

from zerocalc.training import Setup

# Stages 1/2 pad each flat parameter group to a multiple of 2·N elements:
# `align_dense_tensors(..., self.nccl_start_alignment_factor * dp_size)` with
# `nccl_start_alignment_factor = 2` (`runtime/zero/stage_1_and_2.py`); the last rank holds the padding.
NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class Partition:
    num_params: int            # P
    padded_flat: int           # Pp = ⌈P / 2N⌉ · 2N (stages 1/2, one parameter group)
    flat_shard: int            # S = Pp / N, each rank's slice of the flat group (stages 1/2)
    stage3_shard: int          # S3 = Σ ⌈nᵢ / N⌉, each rank's stage-3 partition (padding per tensor)
    persistent: int            # Σ N·⌈nᵢ/N⌉ over stage-3 parameters kept whole on every rank: the gathered
                               # copy is the padded all-gather output, narrowed to nᵢ (storage keeps the pad)
    persistent_shard: int      # Σ ⌈nᵢ / N⌉ over those parameters
    persistent_tensors: int    # how many they are (the step all-gathers them one call each)
    gathered_shard: int        # Σ ⌈nᵢ / N⌉ over the others: what the forward all-gather fetches per rank
    num_sub_groups: int        # stage-3 optimizer sub-groups (`_create_fp16_sub_groups`)
    largest_sub_group: int     # elements of the largest one: its flatten and fp32 cast set the step peak


def persistent_mask(numels: tuple[int, ...], setup: Setup) -> tuple[bool, ...]:
    """Stage-3 parameters that stay whole on every rank: `mark_persistent_parameters` in
    `runtime/zero/parameter_offload.py` walks parameters in order, skips one that would push the
    running total past `model_persistence_threshold`, and keeps one with ds_numel ≤
    `stage3_param_persistence_threshold` (default 1e5)."""
    mask, total = [], 0
    for n in numels:
        keep = n + total <= setup.model_persistence_threshold and n <= setup.param_persistence_threshold
        total += n if keep else 0
        mask.append(keep)
    return tuple(mask)


def sub_groups(shards: list[int], sub_group_size: int) -> list[int]:
    """Elements of each stage-3 optimizer sub-group, from `_create_fp16_sub_groups`
    (`runtime/zero/stage3.py`): parameters in order, a group closes once its partition numel reaches
    `sub_group_size`; one group if the whole partition fits."""
    if sub_group_size >= sum(shards):
        return [sum(shards)]
    groups, size = [], 0
    for i, s in enumerate(shards):
        size += s
        if size >= sub_group_size or i == len(shards) - 1:
            groups.append(size)
            size = 0
    return groups


def partition(numels: tuple[int, ...], setup: Setup) -> Partition:
    return _partition(numels, setup.dp, setup.param_persistence_threshold, setup.model_persistence_threshold,
                      setup.sub_group_size)


@lru_cache(maxsize=256)
def _partition(numels, n, param_threshold, model_threshold, sub_group_size) -> Partition:
    setup = Setup(dp=n, param_persistence_threshold=param_threshold, model_persistence_threshold=model_threshold,
                  sub_group_size=sub_group_size)
    p = sum(numels)
    align = NCCL_START_ALIGNMENT_FACTOR * n
    padded = ceil(p / align) * align
    shards = [ceil(x / n) for x in numels]
    mask = persistent_mask(numels, setup)
    groups = sub_groups(shards, setup.sub_group_size)
    return Partition(
        num_params=p,
        padded_flat=padded,
        flat_shard=padded // n,
        stage3_shard=sum(shards),
        # at N = 1 a parameter is a view of its partition: no separate whole copy
        persistent=sum(n * s for s, m in zip(shards, mask) if m) if n > 1 else 0,
        persistent_shard=sum(s for s, m in zip(shards, mask) if m),
        persistent_tensors=sum(mask),
        gathered_shard=sum(s for s, m in zip(shards, mask) if not m),
        num_sub_groups=len(groups),
        largest_sub_group=max(groups),
    )


def max_grads_in_partition(numels: tuple[int, ...], setup: Setup) -> int:
    """G_in of the busiest rank (`grads_in_partition`)."""
    return max(_grads_in_partition(numels, setup.dp))


def grads_in_partition(numels: tuple[int, ...], setup: Setup, rank: int) -> int:
    """G_in: the elements of `rank`'s `grads_in_partition` at stages 1/2. Each rank keeps the gradient
    of every parameter that overlaps its flat slice, whole (`stage_1_and_2.py`,
    `copy_grads_in_partition`), so a rank whose slice cuts through a large tensor holds all of it."""
    return _grads_in_partition(numels, setup.dp)[rank]


@lru_cache(maxsize=256)
def _grads_in_partition(numels: tuple[int, ...], n: int) -> tuple[int, ...]:
    """`grads_in_partition` of every rank."""
    shard = _partition(numels, n, 0, 0, 1).flat_shard
    per_rank = [0] * n
    start = 0
    for x in numels:
        first, last = start // shard, min((start + x - 1) // shard, n - 1)
        for r in range(first, last + 1):
            per_rank[r] += x
        start += x
    return tuple(per_rank)
