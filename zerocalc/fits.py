"""Whether a job runs on a card, by the caching allocator's own verdict: the generated allocation
sequence (`zerocalc.sequence`) replayed against what the card leaves the allocator
(`allocator.replay(capacity_bytes=...)`). A cudaMalloc past that makes torch's allocator return its
cached free segments and retry before it raises OutOfMemoryError, so a job whose unbounded replay
reserves more than the card holds can still run there. Every simulated rank is replayed
(`sequence.offload_ranks`: the busiest decides).

Needed only where the unbounded replay's reserved exceeds the capacity: at or under it no cudaMalloc
fails, no retry happens, and the verdict is the unbounded replay's (`Estimate.fits_device`).
"""
from itertools import chain
from typing import NamedTuple

from zerocalc import allocator, sequence
from zerocalc.allocator import OutOfMemory
from zerocalc.model import ModelSpec
from zerocalc.training import Setup


class AtCapacity(NamedTuple):
    """Each simulated rank's replay against one capacity."""
    capacity_bytes: int
    alloc_retries: int              # torch's num_alloc_retries, the most of any rank
    oom: OutOfMemory | None         # the first rank's (in rank order) that ran out; None: every rank ran
    oom_rank: int | None
    oom_phase: str | None           # where in the job: "init" or "step k" (k from 1)

    @property
    def runs(self) -> bool:
        return self.oom is None

    def oom_dict(self) -> dict | None:
        """The OOM point for the JSON: rank, phase and `OutOfMemory`'s fields; None where it ran."""
        return None if self.oom is None else {"rank": self.oom_rank, "phase": self.oom_phase, **self.oom._asdict()}


def job_pieces(model: ModelSpec, setup: Setup) -> tuple[tuple[int, tuple], ...]:
    """(rank, its pieces) for each simulated rank (`sequence.step_pieces`: init, then each step),
    generated once for the several replays a verdict and its headroom take."""
    with sequence.cycle_collector_paused():
        return tuple((r, tuple(sequence.step_pieces(model, setup, rank=r)))
                     for r in sequence.offload_ranks(model, setup))


def unbounded_peaks_bytes(jobs, expandable_segments: bool) -> tuple[int, int]:
    """The ranks' largest allocated and reserved peaks replayed without a capacity:
    `sequence.peaks_bytes` from pieces already made."""
    with sequence.cycle_collector_paused():
        replays = [sequence.replay_steps(iter(pieces), expandable_segments) for _, pieces in jobs]
    return max(r.peak_allocated_bytes for r in replays), max(r.peak_reserved_bytes for r in replays)


def phase(pieces, event: int) -> str:
    """Which piece of a job event `event` lies in: "init" (piece 0) or "step k"."""
    start = 0
    for k, (events, _) in enumerate(pieces):
        start += len(events)
        if event < start:
            return "init" if k == 0 else f"step {k}"
    raise ValueError(f"event {event} is past the job's {start} events")


def at_capacity(jobs, expandable_segments: bool, capacity_bytes: int) -> AtCapacity:
    """Each rank's job (`job_pieces`) replayed against capacity_bytes (`sequence.replay_steps`)."""
    retries, first = 0, None
    with sequence.cycle_collector_paused():
        for rank, pieces in jobs:
            r = sequence.replay_steps(iter(pieces), expandable_segments, capacity_bytes)
            retries = max(retries, r.alloc_retries)
            if r.oom is not None and first is None:
                first = (r.oom, rank, phase(pieces, r.oom.event))
    return AtCapacity(capacity_bytes, retries, *(first or (None, None, None)))


def least_allocated_bytes(jobs) -> int:
    """The most any rank's live requests hold at once (`allocator.least_allocated_bytes`): no
    capacity below it runs."""
    return max(allocator.least_allocated_bytes(chain.from_iterable(events for events, _ in pieces))
               for _, pieces in jobs)


def smallest_capacity_bytes(jobs, expandable_segments: bool, failing_bytes: int, running_bytes: int,
                            guess_bytes: int | None = None) -> int:
    """The capacity at which every rank's job runs without OOM, by `allocator.bisect_capacity`
    between failing_bytes (where one does not) and running_bytes (where all do), guess_bytes its
    first probe (a failure's demand): the smallest where running is monotone in the capacity, else a
    boundary between the two (see `bisect_capacity`)."""
    def short(capacity):
        oom = at_capacity(jobs, expandable_segments, capacity).oom
        return None if oom is None else oom.demand_bytes
    return allocator.bisect_capacity(short, failing_bytes, running_bytes, guess_bytes)
