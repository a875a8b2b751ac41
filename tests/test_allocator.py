"""The caching-allocator simulation: its rules on sequences worked by hand, then against the
allocator's own history of real DeepSpeed jobs on an H200 (data/snapshots/t3-warmup)."""
import glob

import pytest

from zerocalc.allocator import replay, round_size, segment_size

MiB = 2**20


def alloc(handle, n_bytes, stream=0):
    return ("alloc", handle, n_bytes, stream)


def free(handle):
    return ("free", handle)


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MiB                 # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB             # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB      # large, under 10 MiB: 20 MiB segments
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB           # from 10 MiB: rounded up to 2 MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB


def test_a_freed_bucket_taken_by_a_smaller_tensor_makes_the_next_bucket_a_new_segment():
    # What the history of seed-gpt 768 x 12, stage 2, shows: the 954 MiB gradient bucket is freed after
    # the first backward, Adam's first step puts a 619 MiB moment into its block (split: 335 MiB left
    # free), and the next backward's bucket fits nowhere.
    r = replay([alloc("bucket", 954 * MiB), free("bucket"), alloc("exp_avg", 619 * MiB), alloc("bucket2", 954 * MiB)])
    assert [s.size_bytes for s in r.segments] == [954 * MiB, 954 * MiB]
    assert r.peak_reserved_bytes == 1908 * MiB
    assert r.peak_allocated_bytes == (619 + 954) * MiB


def test_freed_neighbours_merge_back_into_one_block():
    # 40 MiB segment; 15 MiB at its front, the 25 MiB rest taken exactly; both freed merge into 40 MiB,
    # which a 40 MiB request then reuses: one segment.
    r = replay([alloc("a", 40 * MiB), free("a"), alloc("b", 15 * MiB), alloc("c", 25 * MiB),
                free("b"), free("c"), alloc("d", 40 * MiB)])
    assert [s.size_bytes for s in r.segments] == [40 * MiB]


def test_a_block_freed_on_another_stream_is_not_reused():
    r = replay([alloc("a", 100 * MiB, stream=0), free("a"), alloc("b", 100 * MiB, stream=7)])
    assert [(s.size_bytes, s.stream) for s in r.segments] == [(100 * MiB, 0), (100 * MiB, 7)]


def test_small_pool_shares_2_mib_segments():
    # 100 B -> 512 B at the front of a 2 MiB segment; 1 MiB fits in the 2 MiB - 512 B left; the next
    # 1 MiB does not (1 MiB - 512 B left): a second segment.
    r = replay([alloc("a", 100), alloc("b", MiB), alloc("c", MiB)])
    assert [s.size_bytes for s in r.segments] == [2 * MiB, 2 * MiB]
    assert r.peak_allocated_bytes == 512 + 2 * MiB


def test_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    # 11.5 MiB in a cached 12 MiB block leaves 0.5 MiB: not split, so the request holds all 12 MiB
    # (max_memory_allocated counts it); 5 MiB in the 20 MiB segment of a small-large request leaves
    # 15 MiB: split, and a 15 MiB request then takes that rest.
    r = replay([alloc("a", 12 * MiB), free("a"), alloc("b", 23 * MiB // 2)])
    assert r.peak_allocated_bytes == 12 * MiB
    r = replay([alloc("a", 5 * MiB), alloc("b", 15 * MiB)])
    assert [s.size_bytes for s in r.segments] == [20 * MiB]
    assert r.peak_allocated_bytes == 20 * MiB


def test_a_free_of_a_block_from_before_the_sequence_is_ignored_and_bad_events_are_refused():
    assert replay([free("old"), alloc("a", MiB)]).peak_allocated_bytes == MiB
    with pytest.raises(ValueError, match="expected 'alloc' or 'free'"):
        replay([("realloc", "a", 1, 0)])


CLEAN_HISTORIES = [p for p in sorted(glob.glob("data/snapshots/t3-warmup/*.json.gz"))
                   if "adc78cf520" in p or "a8545fd141" in p]


@pytest.mark.parametrize("path", CLEAN_HISTORIES, ids=lambda p: p.split("/")[-1][:40])
def test_replaying_a_real_history_makes_the_segments_it_recorded(path):
    """Jobs that started with an empty cache (seed-gpt 768 x 12 stage 2, mb 1 x 2048; seed-gpt 2048 x 24
    stage 3, three streams): from model build to the end of warm-up, every cudaMalloc the allocator
    recorded (size, stream, order) and so the reserved peak (5.379 and 13.141 GiB, as measured)."""
    from validate.snapshot import allocator_events, load
    snap = load(path)
    trace = snap["device_traces"][0]
    assert snap["zerocalc_base_reserved"] == 0
    recorded = [(e["size"], e["stream"]) for e in trace if e["action"] == "segment_alloc"]
    r = replay(allocator_events(trace))
    assert [(s.size_bytes, s.stream) for s in r.segments] == recorded
    assert r.peak_reserved_bytes == sum(size for size, _ in recorded)


def test_both_clean_histories_are_committed():
    assert len(CLEAN_HISTORIES) == 2


def test_a_sequence_can_start_from_cached_segments():
    # A 20 MiB segment at 1000 MiB from before the sequence: 5 MiB allocated (handle = its address), 15 MiB
    # free. 10 MiB takes the front of the free 15 (5 MiB rest stays free); the old block is freed; 5 MiB
    # then fits either 5 MiB hole exactly (no segment); 6 MiB fits nowhere: a new 20 MiB segment.
    a = 1000 * MiB
    cached = [(a, 20 * MiB, 0, False, [(a, 5 * MiB, True), (a + 5 * MiB, 15 * MiB, False)])]
    r = replay([alloc("h1", 10 * MiB), free(a), alloc("h2", 5 * MiB), alloc("h3", 6 * MiB)], cached)
    assert [s.size_bytes for s in r.segments] == [20 * MiB]
    assert r.peak_reserved_bytes == 20 * MiB                # growth over the 20 MiB cached before
    assert r.peak_allocated_bytes == (5 + 10 + 6) * MiB - 5 * MiB   # 21 MiB at the end, 5 of them before
