"""One steady-state ZeRO-3 iteration, replayed module by module the way DeepSpeed 0.19.8's
`PartitionedParameterCoordinator` (`runtime/zero/partitioned_param_coordinator.py`) runs it.

What it decides, and what a closed form gets wrong:
- `fetch_sub_module` all-gathers the module's unavailable parameters, pops the module's entries off
  the parameter queue, then prefetches from the queue until `stage3_prefetch_bucket_size` numel of
  *unavailable* parameters are in flight; parameters already gathered are popped for free and
  marked as needed at their later step.
- `release_sub_module` releases a module's non-persistent parameters unless that mark says they are
  needed later, or they reappear within `stage3_max_reuse_distance` numel of the trace ahead.
So with a prefetch bucket as large as the model the prefetcher runs through the whole trace and
nothing is released: 2Ψ of traffic, not the paper's 3Ψ, and the whole model stays gathered from
forward through backward. Checked against the comms logger on 2-rank CPU jobs
(`tests/test_against_deepspeed.py`).
"""
from collections import deque
from functools import lru_cache
from dataclasses import dataclass
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
    return _simulate(model, Setup(stage=Stage.PARAMETERS, dp=setup.dp, offload_param=setup.offload_param,
                                  activation_checkpointing=setup.activation_checkpointing,
                                  prefetch_bucket_size=setup.prefetch_bucket_size,
                                  max_live_parameters=setup.max_live_parameters,
                                  max_reuse_distance=setup.max_reuse_distance,
                                  param_persistence_threshold=setup.param_persistence_threshold,
                                  model_persistence_threshold=setup.model_persistence_threshold))


@lru_cache(maxsize=256)
def _simulate(model: ModelSpec, setup: Setup) -> Stage3Iteration:
    n = setup.dp
    if n == 1 and setup.offload_param == "none":
        return Stage3Iteration(0, 0, 0, 0, 0)
    shard = [ceil(x / n) for x in model.param_numels]
    turn = len(model.trace) - 1   # the last forward step
    out = {"fwd_calls": 0, "fwd": 0, "bwd_calls": 0, "bwd": 0}
    kept_after_forward = 0
    for step, actions, gathered in _walk(model, setup, record=False):
        for a in actions:
            if a[0] == "gather":
                phase = "bwd" if step > turn else "fwd"
                out[phase + "_calls"] += 1
                out[phase] += sum(shard[p] for p in a[1])
        if step == turn:
            kept_after_forward = gathered
    return Stage3Iteration(out["fwd_calls"], out["fwd"], out["bwd_calls"], out["bwd"], kept_after_forward, copies=n == 1)


@lru_cache(maxsize=64)
def fetches(model: ModelSpec, setup: Setup, record: bool) -> tuple[tuple[tuple, ...], ...]:
    """What the coordinator does at each step of one iteration's trace (forward's steps, then
    backward's), in order: ("gather", params) for each all-gather call (params in `ds_id` order), then
    ("wait", p) for each of the module's parameters still in flight (gathered now or prefetched), then
    ("release", p). record: the first iteration, while the trace is recorded: no prefetch, and each
    module's parameters are released after it (`release_sub_module` before the trace is complete)."""
    return tuple(tuple(actions) for _step, actions, _gathered in _walk(model, setup, record))


def _walk(model: ModelSpec, setup: Setup, record: bool):
    """Yields (step, actions, padded elements of non-persistent parameters gathered after it)."""
    n = setup.dp
    numel = model.param_numels
    pers = persistent_mask(numel, setup)
    padded = [ceil(x / n) * n for x in numel]
    # The trace: forward's hooks, then backward's (recomputed layers included when checkpointing).
    ids = [list(m) for m in model.trace]
    trace = ids + [list(m) for m in model.backward(setup.activation_checkpointing)]
    queue = deque((p, step) for step, mod in enumerate(trace) for p in mod)
    marked = {}
    available = {p for p in range(len(numel)) if pers[p]}
    inflight = set()      # gathered, not yet waited for by a module
    gathered = 0          # padded elements of non-persistent params available now
    n_available = 0       # `__n_available_params`: ds_numel gathered this iteration, less releases

    for step, mod in enumerate(trace):
        actions = []

        def gather(params):
            nonlocal gathered, n_available
            todo = sorted(dict.fromkeys(p for p in params if p not in available))
            if not todo:
                return
            actions.append(("gather", tuple(todo)))
            available.update(todo)
            inflight.update(todo)
            gathered += sum(padded[p] for p in todo)
            n_available += sum(numel[p] for p in todo)

        gather(mod)
        for p in dict.fromkeys(mod):
            if p in inflight:
                inflight.discard(p)
                actions.append(("wait", p))
        if record:
            release = {p for p in mod if not pers[p]}
        else:
            # Pop this module's own entries off the queue.
            mine = {p for p in mod if marked.get(p, -1) < step}
            popped = set()
            while queue and popped != mine:
                p, s = queue.popleft()
                marked[p] = s
                popped.add(p)
            # Prefetch.
            if setup.prefetch_bucket_size > 0:
                budget = min(setup.max_live_parameters - n_available, setup.prefetch_bucket_size)
                batch, size = [], 0
                while queue and size < budget:
                    p, s = queue.popleft()
                    fetch = p not in available and p not in batch
                    marked[p] = max(marked.get(p, -1), s)
                    if fetch:
                        batch.append(p)
                        size += numel[p]
                gather(batch)
            # Release after the module runs.
            release = {p for p in mod if not pers[p] and marked.get(p, -1) <= step + 1}
            traversed = 0
            for later in trace[step + 1:]:
                if traversed >= setup.max_reuse_distance or not release:
                    break
                for p in later:
                    release.discard(p)
                    traversed += numel[p]
        for p in sorted(release):
            if p in available:
                available.discard(p)
                gathered -= padded[p]
                n_available -= numel[p]
                actions.append(("release", p))
        yield step, actions, gathered
