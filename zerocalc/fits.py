"""Whether a job runs on a card, by the caching allocator's own verdict: the generated allocation
sequence (`zerocalc.sequence`) replayed against what the card leaves the allocator
(`allocator.replay(capacity_bytes=...)`). A cudaMalloc past that makes torch's allocator return its
cached free segments and retry before it raises OutOfMemoryError, so a job whose unbounded replay
reserves more than the card holds can still run there. Every rank that can run out first is replayed.

Needed only near the card (`LATE_REPLAY_MARGIN`): well under it no cudaMalloc fails, no retry
happens, and the verdict is the unbounded replay's (`Estimate.fits_device`). At stage 3 the
all-gather stream's frees come back late by however far the host runs ahead, differently in every
run, so the verdict is taken under several timings (`GATHER_FREE_DELAYS`) and `fits` means it runs
under every one. Where a retry returned segments, where cudaMalloc puts the next ones decides which
equal-sized free block later requests take, so such a replay is run again with the other placement
(`allocator.PLACEMENTS`) and `fits` means it runs under both. The evidence: docs/scale.md, "`fits` on
a smaller card"; the rules: docs/reserved-memory.md, "How `fits` is decided".
"""
from itertools import chain
from typing import NamedTuple

from zerocalc import allocator, sequence
from zerocalc.allocator import OutOfMemory
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage


# How many allocations late the all-gather stream's frees complete, for each timing the verdict takes:
# on time, then delays spanning the medians (0-15) to the 90th percentiles (3-323) of five runs' histories
# (data/snapshots/cards-oom/). Each applied to every such free alike: a spread of timings, not one run's.
GATHER_FREE_DELAYS = (0, 4, 16, 64)
# The late timing `estimate --explain` quotes reserved at (`Estimate.peak_reserved_late_bytes`): the runs
# measured at N >= 8 reached at most about it (docs/scale.md).
LATE_RESERVED_DELAY = GATHER_FREE_DELAYS[1]
# Training steps a job near its card is replayed over (three elsewhere, `sequence.events`): under a cap
# the retries return segments, so a step can leave the cache other than it found it and a later one run
# out (the 8B at stage 3, N = 64, on a 40 GB card in its fourth step, data/h200-cards-40-n64.csv;
# DeepSeek-V2-Lite at stage 1, N = 16, on an 80 GB card in its fourth under transformers 5.25; their
# replays do too; docs/scale.md). A step that leaves the cache as it found it ends the replay early.
CARD_STEPS = 5
# The late timings are replayed where the on-time replay's reserved is within this factor of the card:
# the measured reserved of the 56 stage-3 fake-world rows is at most 1.23 times the on-time replay's, so
# farther from the card no cudaMalloc fails under the timings that ran.
LATE_REPLAY_MARGIN = 1.25


class AtCapacity(NamedTuple):
    """Each simulated rank's replay against one capacity, under each timing of the frees."""
    capacity_bytes: int
    alloc_retries: int              # torch's num_alloc_retries, the most of any rank (frees on time)
    oom: OutOfMemory | None         # the first (rank, then timing) that ran out; None: every one ran
    oom_rank: int | None
    oom_phase: str | None           # where in the job: "init" or "step k" (k from 1)
    oom_delay: int | None = None    # its timing: the all-gather stream's frees that many allocations late
    delays_run: tuple = ()          # the timings under which every rank ran, under every placement
    pressed: bool = False           # some replay reached the capacity (a retry or an OOM)
    oom_placement: str | None = None    # its placement of new segments after a retry (`allocator.PLACEMENTS`)
    placement_dependent: bool = False   # some timing runs under one placement and runs out under the other

    @property
    def runs(self) -> bool:
        return self.oom is None

    @property
    def timing_dependent(self) -> bool:
        """Runs under some timings of the frees, or placements of new segments, and runs out under others:
        the run decides."""
        return self.oom is not None and (bool(self.delays_run) or self.placement_dependent)

    def oom_dict(self) -> dict | None:
        """The OOM point for the JSON: rank, phase, timing and `OutOfMemory`'s fields; None where it ran."""
        return None if self.oom is None else {"rank": self.oom_rank, "phase": self.oom_phase,
                                              "delay_allocations": self.oom_delay,
                                              "segment_placement": self.oom_placement,
                                              "runs_with_delays": list(self.delays_run), **self.oom._asdict()}


def job_pieces(model: ModelSpec, setup: Setup, ranks: tuple[int, ...] | None = None) -> tuple[tuple[int, int, tuple], ...]:
    """(rank, 0, its pieces) for each simulated rank (`sequence.step_pieces`: init, then each of three
    steps): the unbounded replay's. Near a card `near_card` makes the job again, over `CARD_STEPS`
    steps, for every rank and timing the verdict needs. `ranks`: these ranks alone (`Estimate.ranks`)."""
    return _ranks_pieces(model, setup, ranks or sequence.simulated_ranks(model, setup))


def _ranks_pieces(model: ModelSpec, setup: Setup, ranks) -> tuple[tuple[int, int, tuple], ...]:
    """(rank, 0, its pieces) for each of `ranks`."""
    with sequence.cycle_collector_paused():
        return tuple((r, 0, tuple(sequence.step_pieces(model, setup, rank=r))) for r in ranks)


def near_card(model: ModelSpec, setup: Setup, ranks: tuple[int, ...] | None = None) -> tuple[tuple[int, int, tuple], ...]:
    """Each of `ranks` (`Estimate.ranks`), or of the busiest ranks (`job_pieces`'s) and every other rank
    that can run out first (`sequence.simulated_ranks(every=True)`), made over `CARD_STEPS` steps and,
    where it has an all-gather stream (stage 3), also under each later timing of `GATHER_FREE_DELAYS`
    (`late_frees`): what a verdict on a card replays."""
    ranks = ranks or tuple(dict.fromkeys(sequence.simulated_ranks(model, setup)
                                         + sequence.simulated_ranks(model, setup, every=True)))
    out = []
    gathers = setup.stage == Stage.PARAMETERS     # the all-gather stream is stage 3's alone
    for r in ranks:
        with sequence.cycle_collector_paused():
            pieces = tuple(sequence.step_pieces(model, setup, rank=r, steps=CARD_STEPS))
        out.append((r, 0, pieces))
        if gathers and any(e[0] == "alloc" and e[3] == sequence.GATHER_STREAM for events, _ in pieces for e in events):
            out += [(r, d, late_frees(pieces, d)) for d in GATHER_FREE_DELAYS if d]
    return tuple(out)


def late_frees(pieces, delay: int) -> tuple:
    """The pieces with each free of a block made on the all-gather stream moved `delay` allocations
    later (carried across pieces; any still waiting at the end freed there)."""
    on_gather, waiting, n, out = set(), [], 0, []
    for events, last in pieces:
        moved = []
        for e in events:
            if e[0] == "free" and e[1] in on_gather and delay:
                waiting.append((n + delay, e))
                continue
            moved.append(e)
            if e[0] == "alloc":
                n += 1
                if e[3] == sequence.GATHER_STREAM:
                    on_gather.add(e[1])
                while waiting and waiting[0][0] <= n:
                    moved.append(waiting.pop(0)[1])
        out.append((moved, last))
    if waiting:
        out[-1] = (out[-1][0] + [e for _, e in waiting], out[-1][1])
    return tuple(out)


def unbounded_peaks_bytes(jobs, expandable_segments: bool, every_timing: bool = False) -> sequence.Peaks:
    """The ranks' largest allocated and reserved peaks replayed without a capacity, frees on time
    (every_timing: under every timing): `sequence.peaks_bytes` from pieces already made."""
    with sequence.cycle_collector_paused():
        return sequence.peaks_of([sequence.replay_steps(iter(pieces), expandable_segments)
                                  for _, delay, pieces in jobs if every_timing or not delay])


def phase(pieces, event: int) -> str:
    """Which piece of a job event `event` lies in: "init" (piece 0) or "step k"."""
    start = 0
    for k, (events, _) in enumerate(pieces):
        start += len(events)
        if event < start:
            return "init" if k == 0 else f"step {k}"
    raise ValueError(f"event {event} is past the job's {start} events")


def at_capacity(jobs, expandable_segments: bool, capacity_bytes: int) -> AtCapacity:
    """Each rank's job under each timing (`job_pieces`) replayed against capacity_bytes
    (`sequence.replay_steps`), and, where a retry returned segments, again with the other placement of
    new ones (`allocator.PLACEMENTS`; the expandable allocator maps pages, placed as they come)."""
    retries, first, failed, pressed = 0, None, set(), False
    placements = allocator.PLACEMENTS[:1] if expandable_segments else allocator.PLACEMENTS
    with sequence.cycle_collector_paused():
        for rank, delay, pieces in jobs:
            for placement in placements:
                r = sequence.replay_steps(iter(pieces), expandable_segments, capacity_bytes, placement)
                pressed |= r.alloc_retries > 0 or r.oom is not None
                if not delay and placement == placements[0]:
                    retries = max(retries, r.alloc_retries)
                if r.oom is not None:
                    failed.add((delay, placement))
                    if first is None:
                        first = (r.oom, rank, phase(pieces, r.oom.event), delay, placement)
                if not r.alloc_retries:    # nothing returned: every placement is this one
                    break
    delays = {d for _, d, _ in jobs}
    delays_run = tuple(sorted(d for d in delays if not any((d, p) in failed for p in placements)))
    placement_dependent = any((d, placements[0]) not in failed and (d, p) in failed for d in delays for p in placements)
    oom, rank, where, delay, placement = first or (None,) * 5
    return AtCapacity(capacity_bytes, retries, oom, rank, where, delay, delays_run, pressed, placement, placement_dependent)


def least_allocated_bytes(jobs) -> int:
    """The most any rank's live requests hold at once (`allocator.least_allocated_bytes`): no
    capacity below it runs."""
    return max(allocator.least_allocated_bytes(chain.from_iterable(events for events, _ in pieces))
               for _, _, pieces in jobs)


def smallest_capacity_bytes(jobs, expandable_segments: bool, failing_bytes: int, running_bytes: int,
                            guess_bytes: int | None = None) -> int:
    """The capacity at which every rank's job runs without OOM under every timing, by `allocator.bisect_capacity`
    between failing_bytes (where one does not) and running_bytes (where all do), guess_bytes its
    first probe (a failure's demand): the smallest where running is monotone in the capacity, else a
    boundary between the two (see `bisect_capacity`)."""
    def short(capacity):
        oom = at_capacity(jobs, expandable_segments, capacity).oom
        return None if oom is None else oom.demand_bytes
    return allocator.bisect_capacity(short, failing_bytes, running_bytes, guess_bytes)
