"""PyTorch's CUDA caching allocator, simulated: which segments it cudaMallocs for a sequence of
allocations and frees, hence `torch.cuda.max_memory_reserved()`.

Reserved exceeds allocated because freed blocks stay cached and a request only reuses a cached block
of its own pool and stream that is large enough: the order of allocations decides how much is
reserved. This module is the allocator's half of that prediction (`zerocalc.sequence` makes the
other half, the allocation sequence). It follows c10/cuda/CUDACachingAllocator.cpp (torch 2.11,
default settings): rounding, the small and large pools, best fit by (stream, size, address), segment
sizes, splitting and merging, `empty_cache`, and with `capacity_bytes` the out-of-memory retry that
returns cached segments before raising (`Replay.oom`); `expandable_segments=True` runs that
allocator's rules instead (`_ExpandableAllocator`). Each rule with its source, the segment
placement, and the check against 66 recorded H200 histories (same segments, order, size and stream;
`tests/test_allocator.py`) are in docs/reserved-memory.md, "The allocator, simulated".
"""
import bisect
from typing import NamedTuple

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20        # kSmallSize: the largest request of the small pool
SMALL_SEGMENT_BYTES = 2 << 20        # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 << 20       # kLargeBuffer: the segment of a request under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 << 20     # kMinLargeAlloc
LARGE_ROUND_BYTES = 2 << 20          # kRoundLarge


def round_size(n_bytes: int) -> int:
    """What a request of n_bytes occupies (`round_size`)."""
    return max(MIN_BLOCK_BYTES, -(-n_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(rounded_bytes: int) -> int:
    """The cudaMalloc for a request no cached block can hold (`get_allocation_size`)."""
    if rounded_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-rounded_bytes // LARGE_ROUND_BYTES) * LARGE_ROUND_BYTES


def should_split(block_bytes: int, rounded_bytes: int) -> bool:
    remaining = block_bytes - rounded_bytes
    small = rounded_bytes <= SMALL_REQUEST_BYTES
    return remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_REQUEST_BYTES


class Segment(NamedTuple):     # NamedTuples: cheaper than dataclasses to make at import
    size_bytes: int
    stream: int
    event: int          # index of the allocation that made it


class OutOfMemory(NamedTuple):
    """Where a replay with a capacity raised OutOfMemoryError: its retry found no room either."""
    event: int              # index of the allocation that failed
    request_bytes: int      # its size as the allocator rounds it (`round_size`)
    segment_bytes: int      # the cudaMalloc that did not fit (expandable segments: the pages to map)
    reserved_bytes: int     # reserved then, after the retry's release (all the allocator held, seeds included)
    allocated_bytes: int    # allocated then (rounded block sizes, seeds included)

    @property
    def demand_bytes(self) -> int:
        """What the failed request needed: reserved after the retry plus its cudaMalloc. A capacity
        under it fails at that request from the same state."""
        return self.reserved_bytes + self.segment_bytes


class Replay(NamedTuple):
    segments: tuple[Segment, ...]
    releases: tuple[tuple[int, int], ...]   # (event index, bytes) of each segment `empty_cache` or a retry returned
    peak_reserved_bytes: int      # max_memory_reserved less what was reserved before the sequence
    peak_allocated_bytes: int     # max_memory_allocated likewise (rounded block sizes)
    alloc_retries: int = 0        # torch's num_alloc_retries: cached segments released to retry a cudaMalloc
    oom: OutOfMemory | None = None   # where a replay with a capacity ran out; the events after it are not run
    init_peak_allocated_bytes: int | None = None   # allocated's peak by the end of init (`sequence.replay_steps`)

    def reserved_changes(self) -> list[tuple[int, int]]:
        """(event index, bytes) of every change to reserved, in order: segments made (+), segments
        `empty_cache` returned (-)."""
        return sorted([(s.event, s.size_bytes) for s in self.segments] + [(i, -n) for i, n in self.releases])


def replay(events, cached=(), expandable_segments: bool = False, segment_addresses=(),
           capacity_bytes: int | None = None, placement: str = "returned") -> Replay:
    """Run the allocator over events: ("alloc", handle, n_bytes, stream), ("free", handle) and
    ("empty_cache",), from the segments in `cached`: (address, size, stream, small, [(block address, size,
    allocated)]) each, as the worker records them before a history (an allocated one's handle is its
    address). A free of a handle never allocated (a block from before the sequence) is ignored.
    `expandable_segments`: the allocator of PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    (`_ExpandableAllocator`); `segments` are then the page ranges it maps.
    `segment_addresses`: the addresses cudaMalloc returned, in order (a recorded history's); without
    them each new segment lies below the lowest so far, as the driver placed the large segments of
    every fresh process recorded on H200 (`data/snapshots/`). Addresses only break ties between
    equal-sized free blocks (the lowest address wins), but such ties decide where a gradient bucket
    or an Adam moment lands. `placement`: where a new segment goes without a recorded address once
    `empty_cache` or a retry returned some (`PLACEMENTS`).
    `capacity_bytes`: the most the allocator may hold (reserved, the cached segments included), as a
    card of that much free memory allows: past it the allocator frees its cache and retries, then
    raises OutOfMemoryError (module docstring); None: unbounded."""
    a = start(cached, expandable_segments, segment_addresses, capacity_bytes, placement)
    a.run(events)
    return a.result()


# Where cudaMalloc puts a new large segment once segments were returned: "returned", at the low end of the
# lowest returned range that holds it (a later job of a process, `_segment_address`); "below", below every
# segment, as if none had been returned. After a retry mid-job the H100's driver did neither throughout
# (rank 5 of 8's history, data/snapshots/cards-ranks/: its job ran out where "returned" runs and
# "below" runs out), so a verdict that rests on a retry takes both (`zerocalc.fits`).
PLACEMENTS = ("returned", "below")


def start(cached=(), expandable_segments: bool = False, segment_addresses=(),
          capacity_bytes: int | None = None, placement: str = "returned") -> "_Allocator":
    """An allocator to feed events piece by piece (`run`), whose `state` can be compared between
    pieces and whose `result` is `replay`'s over everything fed: `replay` is start, run, result."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    a = _ExpandableAllocator() if expandable_segments else _Allocator()
    a.capacity = capacity_bytes
    a.placement = placement
    a.addresses = iter(segment_addresses)
    for seg in cached:
        a.seed(*seg)
    a.base_reserved, a.base_allocated = a.reserved, a.allocated
    a.peak_reserved, a.peak_allocated = a.reserved, a.allocated
    return a


CAPACITY_GRID_BYTES = 2 << 20   # every segment (kSmallBuffer, kLargeBuffer, kRoundLarge) and page is a multiple:
                                # whether a capacity runs depends only on how many of these it holds


def least_allocated_bytes(events, cached=()) -> int:
    """The most the live requests ever hold together, each rounded (`round_size`), the cached
    segments' allocated blocks included: a block is never smaller than its request, so no capacity
    below this runs the events without OOM."""
    live = {addr: size for seg in cached for addr, size, allocated in seg[4] if allocated}
    now = peak = sum(live.values())
    for e in events:
        if e[0] == "alloc":
            n = live[e[1]] = round_size(e[2])
            now += n
            peak = max(peak, now)
        elif e[0] == "free":
            now -= live.pop(e[1], 0)
    return peak


GUIDED_PROBES = 4   # `bisect_capacity`'s probes chosen by a failure's demand, at most


def bisect_capacity(short, failing_bytes: int, running_bytes: int, guess_bytes: int | None = None) -> int:
    """The capacity on the 2 MiB grid (`CAPACITY_GRID_BYTES`) at which a sequence first runs between
    failing_bytes, where it does not, and running_bytes, where it does. `short(capacity)`: None where
    it runs, else the failed request's demand (`OutOfMemory.demand_bytes`). A bisection keeping that
    pair, so it ends on a grid capacity that runs whose grid neighbour below fails.

    Probes are chosen to end soon (at a failure's demand or guess_bytes, just below a run found so,
    else halfway; at most `GUIDED_PROBES` guided). Running is not monotone in the capacity in general
    (`tests/test_allocator.py`), so the answer is a boundary inside the pair given: a caller who knows
    its own capacity's verdict passes it as running_bytes or failing_bytes, and the answer is on the
    same side of it. Why, and how many replays it takes: docs/reserved-memory.md, "How `fits` is decided"."""
    grid = CAPACITY_GRID_BYTES
    low, high = failing_bytes // grid, running_bytes // grid
    if high <= low:
        raise ValueError(f"a capacity that runs ({running_bytes} B) below one that fails ({failing_bytes} B)")
    guided = 0
    probe = None if guess_bytes is None else -(-guess_bytes // grid)
    while high - low > 1:
        chosen = probe is not None and low < probe < high and guided < GUIDED_PROBES
        guided += chosen
        if not chosen:
            probe = (low + high) // 2
        demand = short(probe * grid)
        if demand is None:
            high, probe = probe, (probe - 1 if chosen else None)       # a demand that ran: is it the least?
        else:
            low, probe = probe, min(-(-demand // grid), high - 1)      # where that request would be served
    return high * grid


def smallest_capacity_bytes(events, cached=(), expandable_segments: bool = False, segment_addresses=()) -> int:
    """The smallest capacity (on the 2 MiB grid) at which `replay` runs the events without OOM, by
    `bisect_capacity` between `least_allocated_bytes` (below which nothing runs) and the unbounded
    replay's peak reserved (at which no retry happens: the replay is the unbounded one)."""
    unbounded = start(cached, expandable_segments, segment_addresses)
    unbounded.run(events)
    high = unbounded.peak_reserved          # absolute: the seeded segments included
    def short(capacity):
        oom = replay(events, cached, expandable_segments, segment_addresses, capacity).oom
        return None if oom is None else oom.demand_bytes
    return bisect_capacity(short, least_allocated_bytes(events, cached) - 1, high)


class _OutOfMemoryError(Exception):
    """torch's OutOfMemoryError, carrying its `OutOfMemory` (allocated filled in by `run`)."""


class _Block:
    __slots__ = ("addr", "size", "free", "pool", "fl", "seg_start", "seg_end", "mapped")

    def __init__(self, addr, size, pool, fl, seg_start, seg_end, mapped=True):
        self.addr, self.size, self.free, self.pool, self.fl = addr, size, True, pool, fl
        self.seg_start, self.seg_end, self.mapped = seg_start, seg_end, mapped


class _FreeBlocks:
    """One pool's free blocks in (size, address) order, held as the sorted distinct sizes and each
    size's addresses, sorted: a request's block (the smallest that fits, the lowest address among
    equal sizes) is a dictionary look-up when one of its own size is free, else a bisection over
    the sizes. `_Allocator.run` does these operations written out."""
    __slots__ = ("sizes", "at")

    def __init__(self):
        self.sizes: list[int] = []
        self.at: dict[int, list[int]] = {}

    def add(self, size: int, addr: int) -> None:
        same = self.at.get(size)
        if same is None:
            self.at[size] = [addr]
            bisect.insort(self.sizes, size)
        else:
            bisect.insort(same, addr)

    def remove(self, size: int, addr: int) -> None:
        same = self.at[size]
        if len(same) == 1:
            del self.at[size]
            del self.sizes[bisect.bisect_left(self.sizes, size)]
        else:
            del same[bisect.bisect_left(same, addr)]      # sorted, each address once

    def fitting(self, size: int):
        """(size, address) of the free blocks of at least size bytes, in order."""
        for k in range(bisect.bisect_left(self.sizes, size), len(self.sizes)):
            for addr in self.at[self.sizes[k]]:
                yield self.sizes[k], addr

    def __iter__(self):
        return self.fitting(0)

    def __len__(self) -> int:
        return sum(len(same) for same in self.at.values())


class _Allocator:
    """The simulation's state: blocks by start and by end address (segments are laid end to end at
    increasing addresses, as fresh cudaMallocs roughly are), and each pool's free blocks in (size,
    address) order (`_FreeBlocks`)."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.releases: list[tuple[int, int]] = []
        self.free_blocks: dict[tuple[bool, int], _FreeBlocks] = {}   # pool (small, stream) -> its free blocks
        self.by_stream: dict = {}               # stream -> (large pool's, small pool's) free blocks
        self.rounded: dict[int, int] = {}       # request bytes -> `round_size`, of the requests so far
        self.starts: dict[int, _Block] = {}
        self.ends: dict[int, _Block] = {}
        self.live: dict = {}                    # handle -> block
        self.next_addr = 0                      # the expandable allocator's next virtual range
        self.low_addr = 1 << 47                 # below every segment made or seeded so far
        self.addresses = iter(())
        self.held: list[tuple[int, int]] = []   # (start, end) of the segments held, sorted
        self.holes: list[tuple[int, int]] = []  # (start, end) of large segments empty_cache returned, sorted
        self.placement = "returned"             # `PLACEMENTS`: whether new segments go into `holes`
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.fed = 0                            # events run so far
        self.fed_addresses = 0                  # segment addresses taken from `addresses`
        self.capacity: int | None = None        # the most reserved may reach (`replay`'s capacity_bytes)
        self.retries = 0                        # release_cached_blocks + cudaMalloc retries so far
        self.oom: OutOfMemory | None = None     # set when a request found no room: later events are not run

    def _pool_lists(self, stream) -> tuple[_FreeBlocks, _FreeBlocks]:
        """The free blocks of stream's large and small pools, made on first use."""
        lists = self.by_stream.get(stream)
        if lists is None:
            lists = self.by_stream[stream] = tuple(self.free_blocks.setdefault((small, stream), _FreeBlocks())
                                                   for small in (False, True))
        return lists

    def _free_list(self, pool) -> _FreeBlocks:
        return self._pool_lists(pool[1])[bool(pool[0])]

    def run(self, events) -> None:
        """Replay events, numbered on from those run before: `malloc` and `free` written out in the
        loop (they run for every event of a simulated job; a subclass's `malloc` is called). After an
        out-of-memory error nothing more is run: the job has ended."""
        if self.oom is not None or type(self) is not _Allocator:
            return self._run_each(events)
        starts, ends, live, by_stream = self.starts, self.ends, self.live, self.by_stream
        bisect_left, insort, Block = bisect.bisect_left, bisect.insort, _Block
        allocated, peak_allocated = self.allocated, self.peak_allocated
        rounded = self.rounded
        try:
            for i, e in enumerate(events, self.fed):
                kind = e[0]
                if kind == "alloc":                     # `malloc`
                    size = rounded.get(e[2])
                    if size is None:
                        size = rounded[e[2]] = round_size(e[2])
                    small = size <= SMALL_REQUEST_BYTES
                    lists = by_stream.get(e[3])
                    if lists is None:
                        lists = self._pool_lists(e[3])
                    fl = lists[small]
                    at = fl.at
                    same = at.get(size)
                    if same is not None:                # a free block of its size: taken whole
                        b = starts[same.pop(0)]
                        if not same:
                            del at[size]
                            sizes = fl.sizes
                            del sizes[bisect_left(sizes, size)]
                    else:
                        sizes = fl.sizes
                        k = bisect_left(sizes, size)
                        if k < len(sizes):
                            found = sizes[k]
                            same = at[found]
                            b = starts[same.pop(0)]
                            if not same:
                                del at[found], sizes[k]
                        else:
                            b = self._segment(size, e[3], i, fl)
                        rest = b.size - size
                        if rest >= MIN_BLOCK_BYTES if small else rest > SMALL_REQUEST_BYTES:   # should_split
                            cut = b.addr + size
                            ends[cut + rest] = starts[cut] = Block(cut, rest, b.pool, fl, b.seg_start, b.seg_end)
                            ends[cut] = b
                            b.size = size
                            same = at.get(rest)                                              # fl.add
                            if same is None:
                                at[rest] = [cut]
                                insort(sizes, rest)
                            else:
                                insort(same, cut)
                    b.free = False
                    live[e[1]] = b
                    allocated += b.size
                    if allocated > peak_allocated:
                        peak_allocated = allocated
                elif kind == "free":                    # `free`
                    b = live.pop(e[1], None)
                    if b is None:
                        continue
                    size = b.size
                    allocated -= size
                    b.free = True
                    fl = b.fl
                    at = fl.at
                    addr = b.addr
                    end = addr + size
                    if end < b.seg_end:
                        other = starts.get(end)
                        if other is not None and other.free:     # merged with the free block after it
                            n = other.size
                            same = at[n]                                                     # fl.remove
                            if len(same) == 1:
                                del at[n], fl.sizes[bisect_left(fl.sizes, n)]
                            else:
                                del same[bisect_left(same, end)]
                            del starts[end], ends[end]
                            size += n
                            b.size = size
                            ends[addr + size] = b
                    if addr > b.seg_start:
                        other = ends.get(addr)
                        if other is not None and other.free:     # and with the one before it
                            n = other.size
                            same = at[n]
                            if len(same) == 1:
                                del at[n], fl.sizes[bisect_left(fl.sizes, n)]
                            else:
                                del same[bisect_left(same, other.addr)]
                            del starts[addr], ends[addr]
                            size += n
                            addr = other.addr
                            other.size = size
                            ends[addr + size] = other
                    same = at.get(size)                                                      # fl.add
                    if same is None:
                        at[size] = [addr]
                        insort(fl.sizes, size)
                    else:
                        insort(same, addr)
                elif kind == "empty_cache":
                    self.empty_cache(i)
                else:
                    raise ValueError(f"unknown event {kind!r} at {i}: expected 'alloc', 'free' or 'empty_cache'")
        except _OutOfMemoryError as error:      # raised by `_segment`, before the event changed anything
            self.oom = error.args[0]._replace(allocated_bytes=allocated)
        finally:
            self.allocated, self.peak_allocated = allocated, peak_allocated
        self.fed += len(events)

    def _run_each(self, events) -> None:
        """`run` through the methods, one call per event."""
        malloc, free = self.malloc, self.free
        try:
            for i, e in enumerate(events, self.fed):
                if self.oom is not None:
                    break
                kind = e[0]
                if kind == "alloc":
                    malloc(e[1], e[2], e[3], i)
                elif kind == "free":
                    free(e[1])
                elif kind == "empty_cache":
                    self.empty_cache(i)
                else:
                    raise ValueError(f"unknown event {kind!r} at {i}: expected 'alloc', 'free' or 'empty_cache'")
        except _OutOfMemoryError as error:
            self.oom = error.args[0]._replace(allocated_bytes=self.allocated)
        self.fed += len(events)

    def skip(self, n_events: int) -> None:
        """Count n_events as run without running them: events known to leave the state and the peaks
        as they are (see `state`); later events keep their numbers."""
        self.fed += n_events

    def result(self) -> Replay:
        return Replay(tuple(self.segments), tuple(self.releases), self.peak_reserved - self.base_reserved,
                      self.peak_allocated - self.base_allocated, self.retries, self.oom)

    def state(self) -> tuple:
        """All that the allocator's answer to later events depends on: every block (address, size,
        free, pool, segment, mapped), which handle holds which, the free lists, the segments held and
        returned, where the next segment goes, what is reserved and allocated, and how many segments
        were made and returned so far (equal states have made none since). Not the peaks, which later
        events only read. Two equal states of one allocator answer the same events the same way."""
        blocks = sorted((a, b.size, b.free, b.pool, b.seg_start, b.seg_end, b.mapped) for a, b in self.starts.items())
        return (blocks, {h: b.addr for h, b in self.live.items()},
                {pool: tuple(f) for pool, f in self.free_blocks.items() if f.sizes},
                {pool: tuple(u) for pool, u in getattr(self, "unmapped", {}).items() if u},
                tuple(self.held), tuple(self.holes), self.low_addr, self.next_addr, self.reserved, self.allocated,
                len(self.segments), len(self.releases), self.fed_addresses)

    def seed(self, addr: int, size: int, stream: int, small: bool, blocks) -> None:
        """A segment cached before the sequence, with its blocks (address, size, allocated)."""
        pool = (bool(small), stream)
        fl = self._free_list(pool)
        for block_addr, block_size, allocated in blocks:
            b = _Block(block_addr, block_size, pool, fl, addr, addr + size)
            self._add(b)
            if allocated:
                b.free = False
                self.live[block_addr] = b
                self.allocated += block_size
            else:
                fl.add(block_size, block_addr)
        self.reserved += size
        bisect.insort(self.held, (addr, addr + size))
        self.next_addr = max(self.next_addr, addr + size)
        self.low_addr = min(self.low_addr, addr)

    def empty_cache(self, event: int) -> None:
        """Return every segment that is one free block."""
        for pool, free in self.free_blocks.items():
            whole = [(size, addr) for size, addr in free
                     if self.starts[addr].seg_start == addr and self.starts[addr].seg_end == addr + size]
            for size, addr in whole:
                free.remove(size, addr)
                self._drop(self.starts[addr])
                self.held.remove((addr, addr + size))
                self.reserved -= size
                self.releases.append((event, size))
                if not pool[0]:
                    self._hole(addr, addr + size)

    def _add(self, b: _Block) -> None:
        self.starts[b.addr], self.ends[b.addr + b.size] = b, b

    def _drop(self, b: _Block) -> None:
        del self.starts[b.addr], self.ends[b.addr + b.size]

    def _next(self, b):
        return self.starts.get(b.addr + b.size) if b.addr + b.size < b.seg_end else None

    def _prev(self, b):
        return self.ends.get(b.addr) if b.addr > b.seg_start else None

    def _split(self, b, size: int):
        """Cut b after its first size bytes; return the rest (same mapping, not on any list)."""
        self._drop(b)
        rest = _Block(b.addr + size, b.size - size, b.pool, b.fl, b.seg_start, b.seg_end, mapped=b.mapped)
        b.size = size
        self._add(b)
        self._add(rest)
        return rest

    def _merge(self, b, unmapped: list | None = None):
        """b merged with its free neighbours of the same mapping, which come off their lists (their
        pool's free blocks; its unmapped addresses, given for an unmapped b); return the merged block
        (on no list)."""
        for other in (self._next(b), self._prev(b)):
            if other is not None and other.free and other.mapped == b.mapped:
                if other.mapped:
                    other.fl.remove(other.size, other.addr)
                else:
                    del unmapped[bisect.bisect_left(unmapped, other.addr)]
                self._drop(other)
                self._drop(b)
                b = _Block(min(b.addr, other.addr), b.size + other.size, b.pool, b.fl, b.seg_start, b.seg_end,
                           mapped=b.mapped)
                self._add(b)
        return b

    def _take(self, handle, b, size: int, split: bool) -> None:
        """Hand out the front of free block b (off its list) for a request of size bytes."""
        if split:
            rest = self._split(b, size)
            b.fl.add(rest.size, rest.addr)
        b.free = False
        self.live[handle] = b
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _overlaps(self, addr: int, size: int) -> bool:
        """Whether [addr, addr + size) meets a segment held now."""
        k = bisect.bisect_right(self.held, (addr, float("inf")))
        return (k > 0 and self.held[k - 1][1] > addr) or (k < len(self.held) and self.held[k][0] < addr + size)

    def _hole(self, start: int, end: int) -> None:
        """A returned address range, merged with the ranges returned before it that it touches."""
        k = bisect.bisect_left(self.holes, (start, end))
        if k < len(self.holes) and self.holes[k][0] == end:
            end = self.holes.pop(k)[1]
        if k > 0 and self.holes[k - 1][1] == start:
            start = self.holes.pop(k - 1)[0]
            k -= 1
        self.holes.insert(k, (start, end))

    def _segment_address(self, seg_bytes: int) -> int:
        """Where cudaMalloc puts a new segment: the recorded address; else a large one at the low end
        of the lowest range an earlier `empty_cache` returned that holds it (a later job of a process
        fills what the jobs before it returned from the bottom up: 92 of the 93 large segments the
        1.1B Llama made after the 1.4B GPT's job, `snapshots/t6-process/`, lie in the GPT's old range,
        each at the lowest place it fits, the last, a 2100 MiB Adam moment, below it), unless the
        placement is "below"; else below every segment so far."""
        addr = next(self.addresses, None)
        self.fed_addresses += addr is not None
        if addr is None and seg_bytes > SMALL_SEGMENT_BYTES and self.placement == "returned":
            k = next((k for k, (lo, hi) in enumerate(self.holes) if hi - lo >= seg_bytes), None)
            if k is not None:
                addr, hi = self.holes[k]
                self.holes[k:k + 1] = [(addr + seg_bytes, hi)] if hi > addr + seg_bytes else []
        if addr is None or self._overlaps(addr, seg_bytes):
            addr = self.low_addr - seg_bytes   # none recorded, or the replay has diverged from the history
        self.low_addr = min(self.low_addr, addr)
        return addr

    def _retry(self, event: int) -> None:
        """What torch's `malloc` does when a cudaMalloc fails: `release_cached_blocks` (every cached
        segment that is one free block returned, in every pool and stream: `empty_cache`), and the
        cudaMalloc retried (`num_alloc_retries`)."""
        self.retries += 1
        self.empty_cache(event)

    def _segment(self, size: int, stream: int, event: int, fl: _FreeBlocks) -> _Block:
        """A new segment for a request of size bytes (rounded) that no free block holds: one block,
        free, on no list. Past the capacity: the retry, then OutOfMemoryError (`_OutOfMemoryError`,
        raised before anything changed but what the retry released)."""
        seg = segment_size(size)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            self._retry(event)
            if self.reserved + seg > self.capacity:
                raise _OutOfMemoryError(OutOfMemory(event, size, seg, self.reserved, self.allocated))
        addr = self._segment_address(seg)
        bisect.insort(self.held, (addr, addr + seg))
        b = _Block(addr, seg, (size <= SMALL_REQUEST_BYTES, stream), fl, addr, addr + seg)
        self._add(b)
        self.segments.append(Segment(seg, stream, event))
        self.reserved += seg
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return b

    def malloc(self, handle, n_bytes: int, stream: int, event: int) -> None:
        """The smallest free block of the request's pool that holds it (the lowest address among
        equal sizes), else a new segment; split by `should_split`."""
        size = round_size(n_bytes)
        fl = self._pool_lists(stream)[size <= SMALL_REQUEST_BYTES]
        found = next(fl.fitting(size), None)
        if found is not None:
            fl.remove(*found)
            b = self.starts[found[1]]
        else:
            b = self._segment(size, stream, event, fl)
        self._take(handle, b, size, should_split(b.size, size))

    def free(self, handle) -> None:
        """The block returns to its pool's free list, merged with its free neighbours in the segment."""
        b = self.live.pop(handle, None)
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        b = self._merge(b)
        b.fl.add(b.size, b.addr)


LARGE_PAGE_BYTES = LARGE_SEGMENT_BYTES   # an expandable segment maps 20 MiB pages in the large pool
SMALL_PAGE_BYTES = SMALL_SEGMENT_BYTES   # and 2 MiB pages in the small one (`find_expandable_block`)
VIRTUAL_BYTES = 1 << 48                  # its address range: far more than any GPU's memory


class _ExpandableAllocator(_Allocator):
    """expandable_segments:True (torch 2.11 `find_expandable_block`, `try_allocate_expandable_block`,
    `map_block`, `unmap_block`): one virtual range per pool and stream, mapped page by page at its
    lowest free addresses; a request still takes the smallest free mapped block that fits, but one
    that can only grow into unmapped pages counts at its grown size (`get_free_block`); any block is
    split when 512 B or more remain; `empty_cache` unmaps every whole free page, and so does the
    retry past a capacity."""

    def __init__(self):
        super().__init__()
        self.unmapped: dict[tuple[bool, int], list[int]] = {}   # pool -> addresses of unmapped blocks
        self.failed_map_bytes = 0                                # the pages of the last mapping that failed

    def _grown(self, b) -> int:
        nxt = self._next(b)
        return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def malloc(self, handle, n_bytes: int, stream: int, event: int) -> None:
        size = round_size(n_bytes)
        fl = self._pool_lists(stream)[size <= SMALL_REQUEST_BYTES]
        fits = fl.fitting(size)
        found = next(fits, None)
        if found is not None:     # the first in (size, address) order after which the next grows no less
            grown = self._grown(self.starts[found[1]])
            for other in fits:
                other_grown = self._grown(self.starts[other[1]])
                if other_grown >= grown:
                    break
                found, grown = other, other_grown
            fl.remove(*found)
            b = self.starts[found[1]]
        else:
            pool = (size <= SMALL_REQUEST_BYTES, stream)
            b = self._map_for(pool, size, stream, event)
            if b is None:       # the pages did not fit the capacity: release the cache, retry once
                self._retry(event)
                b = self._map_for(pool, size, stream, event)
                if b is None:
                    raise _OutOfMemoryError(OutOfMemory(event, size, self.failed_map_bytes, self.reserved,
                                                        self.allocated))
        self._take(handle, b, size, b.size - size >= MIN_BLOCK_BYTES)

    def _map_for(self, pool, size: int, stream: int, event: int):
        """The lowest addresses of free and unmapped blocks with room for size, mapped and merged
        into one free block (taken off the free list); None where a mapping would take reserved past
        the capacity (`try_allocate_expandable_block` returning nullptr: the ranges mapped before the
        one that failed stay mapped, free)."""
        start = None
        for addr in self.unmapped.get(pool, []):
            c = self.starts[addr]
            prev = self._prev(c)
            if prev is not None and prev.free:
                c = prev
            room, b = 0, c
            while b is not None and b.free and room < size:
                room += b.size
                b = self._next(b)
            if room >= size:
                start = c
                break
        if start is None:   # a new expandable segment: one unmapped block over its whole range
            start = _Block(self.next_addr, VIRTUAL_BYTES, pool, self._free_list(pool), self.next_addr,
                           self.next_addr + VIRTUAL_BYTES, mapped=False)
            self.next_addr += VIRTUAL_BYTES
            self._add(start)
            bisect.insort(self.unmapped.setdefault(pool, []), start.addr)
        c = start
        if not c.mapped:
            c = self._map(c, min(c.size, size), stream, event)
        while c is not None and c.size < size:
            c = self._map(self._next(c), min(size - c.size, self._next(c).size), stream, event)
        if c is not None:
            c.fl.remove(c.size, c.addr)
        return c

    def _map(self, b, size: int, stream: int, event: int):
        """Map the pages covering the first size bytes of unmapped block b; merge with free mapped
        neighbours; return the free block that holds them (on the free list). None, nothing mapped,
        where the pages would take reserved past the capacity: `ExpandableSegment::map` creates them
        one by one and on the first cuMemCreate that fails releases those it made (`map_block`
        returning false)."""
        page = SMALL_PAGE_BYTES if b.pool[0] else LARGE_PAGE_BYTES
        mapped = -(-size // page) * page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            self.failed_map_bytes = mapped
            return None
        self.unmapped[b.pool].remove(b.addr)
        if mapped < b.size:
            bisect.insort(self.unmapped[b.pool], self._split(b, mapped).addr)
        b.mapped = True
        self.segments.append(Segment(mapped, stream, event))
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        b = self._merge(b)
        b.fl.add(b.size, b.addr)
        return b

    def empty_cache(self, event: int) -> None:
        """Unmap the whole pages inside every free mapped block; a segment left all unmapped goes."""
        for pool, free in self.free_blocks.items():
            page = SMALL_PAGE_BYTES if pool[0] else LARGE_PAGE_BYTES
            for size, addr in list(free):
                b = self.starts[addr]
                lo = b.seg_start + -(-(addr - b.seg_start) // page) * page
                hi = b.seg_start + (addr + size - b.seg_start) // page * page
                if lo >= hi:
                    continue
                free.remove(size, addr)
                self._drop(b)
                for part_lo, part_hi in ((addr, lo), (hi, addr + size)):
                    if part_hi > part_lo:
                        part = _Block(part_lo, part_hi - part_lo, pool, free, b.seg_start, b.seg_end)
                        self._add(part)
                        free.add(part.size, part.addr)
                hole = _Block(lo, hi - lo, pool, free, b.seg_start, b.seg_end, mapped=False)
                self._add(hole)
                self.reserved -= hole.size
                self.releases.append((event, hole.size))
                unmapped = self.unmapped.setdefault(pool, [])
                bisect.insort(unmapped, self._merge(hole, unmapped).addr)
