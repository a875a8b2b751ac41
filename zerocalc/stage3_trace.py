"""One steady-state ZeRO-3 iteration, replayed module by module the way DeepSpeed 0.19.8's
`PartitionedParameterCoordinator` runs it: which parameters each module's hook all-gathers, prefetches
and releases (`stage3_prefetch_bucket_size`, `stage3_max_reuse_distance`, the trace's later uses), and
what a checkpointed layer's recomputation gathers again (frozen LoRA base weights included).
Why a closed form is wrong here (2Ψ with a large prefetch bucket, not the paper's 3Ψ) and the rules
it replays: docs/how-it-works.md, "Stage 3's gathers". Checked against the comms logger on 2-rank CPU
jobs (`tests/test_against_deepspeed.py`, `tests/test_stage3_fetches.py`).
"""
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from functools import lru_cache
from dataclasses import dataclass, replace
from math import ceil

from zerocalc.model import ModelSpec
from zerocalc.partition import persistent_mask
from zerocalc.training import Setup, Stage


@dataclass(frozen=True)
class Stage3Iteration:
    forward_gather_calls: int
    forward_gather_elements: int      # per-rank shard elements all-gathered during forward
    backward_gather_calls: int
    backward_gather_elements: int     # ... and during backward. A parameter released in forward can be
                                      # prefetched again before forward ends: only the sum is a phase-free fact
    kept_after_forward_elements: int  # padded elements still gathered when forward ends
    copies: bool = False              # N = 1 with parameter offload: each fetch copies a host partition up;
                                      # no collective (DeepSpeed's comms logger shows none)
    forward_wide_elements: int = 0    # of the gathered elements, those of `ModelSpec.wide` tensors (fp32
    backward_wide_elements: int = 0   # under zero.Init: `states.wide_stage3_elements`)

    def all_gathers(self, phase: str) -> tuple[int, int]:
        """(calls, shard elements) of the all-gathers in 'forward' or 'backward': none when the
        fetches are copies."""
        if self.copies:
            return 0, 0
        if phase == "forward":
            return self.forward_gather_calls, self.forward_gather_elements
        return self.backward_gather_calls, self.backward_gather_elements


def simulate(model: ModelSpec, setup: Setup) -> Stage3Iteration:
    """At N = 1 parameters are views of their partitions: nothing is gathered or sent, unless the
    partitions live on the host (parameter offload): then every "gather" copies them up, and the
    reuse rule keeps them on the device as at N > 1 (measured on H200: the same 2.27 GB kept at the
    end of forward at N = 1 as at N = 2)."""
    n = setup.dp
    if n == 1 and setup.offload_param == "none":
        return Stage3Iteration(0, 0, 0, 0, 0)
    return _simulate(model, _walk_setup(setup), n)


def held_after_forward_elements(model: ModelSpec, setup: Setup) -> int:
    """Padded elements of the parameters whose gathered copy outlives their release in forward, a view
    of it saved for backward (`ModelSpec.viewed_params`); those the reuse rule keeps gathered are
    `kept_after_forward_elements`. None at N = 1, where a parameter is a view of its partition."""
    n, views = setup.dp, model.viewed_params(setup.activation_checkpointing)
    if not views or (n == 1 and setup.offload_param == "none"):
        return 0
    kept = set(_gathers(model, _walk_setup(setup))[4])
    return sum(ceil(model.param_numels[p] / n) * n for p in views if p not in kept)


def _walk_setup(setup: Setup) -> Setup:
    """The setup with only what the coordinator's walk depends on: which parameters are gathered,
    waited for and released at each step follows from the trace, the prefetch and reuse limits (in
    elements of the whole parameters) and which parameters persist; not from N or offload, which only
    scale what a gather moves. One walk serves every GPU count and offload choice."""
    return Setup(stage=Stage.PARAMETERS, activation_checkpointing=setup.activation_checkpointing,
                 prefetch_bucket_size=setup.prefetch_bucket_size, max_live_parameters=setup.max_live_parameters,
                 max_reuse_distance=setup.max_reuse_distance,
                 param_persistence_threshold=setup.param_persistence_threshold,
                 model_persistence_threshold=setup.model_persistence_threshold)


@lru_cache(maxsize=256)
def _simulate(model: ModelSpec, walk: Setup, n: int) -> Stage3Iteration:
    gathers = _gathers(model, walk)
    it = scaled(model.param_numels, gathers, n)
    if not model.wide:
        return it
    wide = scaled(model.wide_numels(), gathers, n)
    return replace(it, forward_wide_elements=wide.forward_gather_elements,
                   backward_wide_elements=wide.backward_gather_elements)


def scaled(numels: tuple[int, ...], gathers: tuple, n: int) -> Stage3Iteration:
    """The iteration at N ranks of a model of these tensors whose walk `_gathers` summed up."""
    fwd_calls, fwd_counts, bwd_calls, bwd_counts, kept = gathers
    shard = [ceil(x / n) for x in numels]
    return Stage3Iteration(fwd_calls, sum(shard[p] * k for p, k in fwd_counts), bwd_calls,
                           sum(shard[p] * k for p, k in bwd_counts), sum(shard[p] * n for p in kept), copies=n == 1)


@lru_cache(maxsize=64)
def _gathers(model: ModelSpec, walk: Setup):
    """One iteration's walk summed up: (forward's gather calls, ((parameter, times gathered in
    forward), ...), backward's calls, the same for backward, the non-persistent parameters still
    gathered when forward ends)."""
    turn = len(model.trace) - 1   # the last forward step
    calls, counts = [0, 0], [{}, {}]
    live, kept = set(), ()
    for step, actions in _walk(model, walk, False):   # summed as walked: the actions themselves are not kept
        phase = int(step > turn)
        for kind, what in actions:
            if kind == "gather":
                calls[phase] += 1
                for p in what:
                    counts[phase][p] = counts[phase].get(p, 0) + 1
                live.update(what)
            elif kind == "release":
                live.discard(what)
        if step == turn:
            kept = tuple(sorted(live))
    return calls[0], tuple(counts[0].items()), calls[1], tuple(counts[1].items()), kept


def fetches(model: ModelSpec, setup: Setup, record: bool, cold: bool = False) -> tuple[tuple[tuple, ...], ...]:
    """What the coordinator does at each step of one iteration's trace (forward's steps, then
    backward's), in order: ("gather", params) for each all-gather call (params in `ds_id` order), then
    ("wait", p) for each of the module's parameters still in flight (gathered now or prefetched), then
    ("release", p). record: the first iteration, while the trace is recorded: no prefetch, and each
    module's parameters are released after it (`release_sub_module` before the trace is complete).
    cold: the iteration after the recording one when no optimizer step came between (a gradient
    accumulation's second micro-step): the recording iteration released the persistent parameters
    too, and only the step gathers them again (`_post_step`), so this iteration gathers each at its
    first use, prefetched with the others, and keeps it.
    The same for every N and offload choice (`_walk_setup`)."""
    return _fetches(model, _walk_setup(setup), record, cold)


@lru_cache(maxsize=64)
def _fetches(model: ModelSpec, walk: Setup, record: bool, cold: bool = False) -> tuple[tuple[tuple, ...], ...]:
    return tuple(tuple(actions) for _step, actions in _walk(model, walk, record, cold))


def _walk(model: ModelSpec, setup: Setup, record: bool, cold: bool = False):
    """Yields (step, actions)."""
    numel = model.param_numels
    pers = persistent_mask(numel, setup)
    # The trace: forward's hooks, then backward's (recomputed layers included when checkpointing).
    trace = (*model.trace, *model.backward(setup.activation_checkpointing))
    recomputed = (False,) * len(model.trace) + model.recomputed(setup.activation_checkpointing)
    frozen = [t is False for t in model.trainable] if model.trainable else [False] * len(numel)
    held = set()          # frozen parameters the recomputation in progress fetched (`ds_recompute_parameters`)
    waiting = (None, ())  # (step, parameters) of the backward module whose backward the recomputation serves
    queue = deque((p, step) for step, mod in enumerate(trace) for p in mod)
    marked = {}
    available = set() if cold else {p for p in range(len(numel)) if pers[p]}
    inflight = set()      # gathered, not yet waited for by a module
    n_available = 0       # `__n_available_params`: ds_numel gathered this iteration, less releases
    # The reuse rule reads the modules after this one until they add up to max_reuse_distance elements:
    # those before the first later module m with elements[step + 1:m] >= the distance. A parameter is
    # kept if it occurs in one of them (its next occurrence comes before m).
    # Where a module is a stage-3 leaf (an MoE block) the rule reads the later modules' own parameters
    # (a leaf's own, not those under it) when releasing any other module, and every parameter under
    # each later module when releasing a leaf (`__params_to_release` iterates them with the recurse
    # flag of the module it releases: DeepSpeed 0.19.8 `partitioned_param_coordinator.py`).
    scan = model.leaf_scan(setup.activation_checkpointing)
    reads = [(trace, False)] if scan is None else [(tuple(s[0] for s in scan), False), (tuple(s[1] for s in scan), True)]
    windows = {}
    for mods, deep in reads:
        occurs = {}
        for step, mod in enumerate(mods):
            for p in mod:
                occurs.setdefault(p, []).append(step)
        windows[deep] = ([0, *accumulate(sum(numel[p] for p in mod) for mod in mods)], occurs)   # of the modules before each
    leaf = [s[2] for s in scan] if scan is not None else [False] * len(trace)

    prefetch_bucket, max_live = setup.prefetch_bucket_size, setup.max_live_parameters
    reuse = setup.max_reuse_distance
    popleft, get = queue.popleft, marked.get

    # Each module's parameters once, in hook order (a module can list a shared one twice); a module
    # without parameters (an activation, attention's core) only prefetches.
    for step, mod in enumerate([tuple(dict.fromkeys(mod)) for mod in trace]):
        actions = []
        release = ()
        if mod:
            todo = [p for p in mod if p not in available]
            if todo:
                todo.sort()
                actions.append(("gather", tuple(todo)))
                available.update(todo)
                inflight.update(todo)
                n_available += sum(numel[p] for p in todo)
            for p in mod:
                if p in inflight:
                    inflight.discard(p)
                    actions.append(("wait", p))
            if record:
                release = [p for p in mod if not pers[p]]
            else:
                # Pop this module's own entries off the queue.
                mine = {p for p in mod if get(p, -1) < step}
                popped = set()
                while queue and popped != mine:
                    p, s = popleft()
                    marked[p] = s
                    popped.add(p)
        if not record:
            # Prefetch.
            if prefetch_bucket > 0:
                budget = min(max_live - n_available, prefetch_bucket)
                batch, size = [], 0
                while queue and size < budget:
                    p, s = popleft()
                    if s > get(p, -1):
                        marked[p] = s
                    if p not in available and p not in batch:
                        batch.append(p)
                        size += numel[p]
                if batch:
                    batch.sort()
                    actions.append(("gather", tuple(batch)))
                    available.update(batch)
                    inflight.update(batch)
                    n_available += size
            # Release after the module runs, unless the reuse rule keeps it.
            if mod:
                release = [p for p in mod if not pers[p] and get(p, -1) <= step + 1]
                if release and reuse > 0:
                    release = _not_reused(release, step, windows[leaf[step]], reuse)
        if release and not recomputed[step] and step + 1 < len(trace) and recomputed[step + 1]:
            # This module's backward needs the recomputation that follows: DeepSpeed releases after a
            # module's backward, so its parameters stay gathered through the recomputation, whose own
            # forward of the module then finds them (a CPU rank 0 of 1,024, Llama-3.1-405B's shape scaled
            # down: its down projection gathered once, not again for the recomputation;
            # tests/test_stage3_order.py).
            waiting, release = (step, release), ()
        if recomputed[step]:
            held.update(p for p in mod if frozen[p] and not pers[p])
            if step + 1 == len(trace) or not recomputed[step + 1]:
                # The recomputation ends: the backward module that started it runs and is released, and
                # with it every frozen parameter the recomputation fetched (partitioned_param_coordinator.py:
                # `update_recompute_parameters` in `_fetch_sub_module_impl`, `release_sub_module`'s
                # `recompute_params`, DeepSpeed 0.19.8).
                start, params = waiting     # its release, at the recomputation's end
                kept_out = params if record or start is None else _not_reused(params, step, windows[leaf[start]], reuse)
                release, held, waiting = set(release) | held | set(kept_out), set(), (None, ())
        for p in sorted(release):
            if p in available:
                available.discard(p)
                n_available -= numel[p]
                actions.append(("release", p))
        yield step, actions


def _not_reused(params, step: int, window_of: tuple, reuse: int) -> list:
    """Of `params`, released by the module at `step`, those the reuse rule frees: not occurring again
    before the first later module at which the modules after `step` add up to `reuse` elements
    (`window_of`: the elements before each module and each parameter's steps, ascending, `_walk`'s
    `windows`)."""
    if not params or reuse <= 0:
        return list(params)
    elements, occurs = window_of
    window = bisect_left(elements, elements[step + 1] + reuse, step + 1)
    freed = []
    for p in params:
        later = occurs.get(p, ())
        k = bisect_right(later, step)       # its next occurrence after `step`, if any
        if k == len(later) or later[k] >= window:
            freed.append(p)
    return freed


def backward_plan(model: ModelSpec, setup: Setup, record: bool, cold: bool = False) -> tuple[tuple, ...]:
    """Backward's steps of `fetches` as the sequence plays them beside the backward's allocations:
    per step (its gathers and waits, the parameters it releases, whether it is a checkpointed
    layer's recomputation, what ends it). A step of a module with parameters is done after the
    module's backward: once the gradients of its trained parameters whose last backward step it is
    have reached their hooks (a frozenset of them), or, where there are none (frozen parameters, a
    tied embedding's head), at the next hook or segment's end (an empty frozenset); None for a step
    that waits for nothing (no parameters, or recomputed)."""
    return _backward_plan(model, _walk_setup(setup), record, cold)


@lru_cache(maxsize=64)
def _backward_plan(model: ModelSpec, walk: Setup, record: bool, cold: bool = False) -> tuple[tuple, ...]:
    steps = _fetches(model, walk, record, cold)[len(model.trace):]
    trace = model.backward(walk.activation_checkpointing)
    recomputed = model.recomputed(walk.activation_checkpointing)
    trained = set(model.trained_indices)
    last = {}
    for k, mod in enumerate(trace):
        if not recomputed[k]:
            last.update(dict.fromkeys(mod, k))
    return tuple((tuple(a for a in actions if a[0] != "release"), tuple(a[1] for a in actions if a[0] == "release"),
                  recomputed[k], None if recomputed[k] or not trace[k] else
                  frozenset(p for p in trace[k] if p in trained and last.get(p) == k))
                 for k, actions in enumerate(steps))
