"""The generated allocation sequence (`zerocalc.sequence`): what it leaves alive, worked out by hand
for a tiny model, and its reserved peak against the recorded H200 allocator histories."""
import os

import pytest

from zerocalc import allocator, sequence
from zerocalc.arch import Architecture, preset
from zerocalc.estimate import estimate
from zerocalc.model import from_architecture
from zerocalc.training import OPTIMIZERS, Setup, Stage

import history_jobs  # tests/

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 2**20, 2**30

# Tiny Llama: embedding 100·64 = 6400; one layer: q, k, v, o 64·64 = 4096 each, gate, up, down
# 128·64 = 8192 each, two RMSNorm weights of 64; final norm 64; untied head 6400.
# P = 6400 + 4·4096 + 3·8192 + 2·64 + 64 + 6400 = 53,952.
TINY = Architecture("hf-llama", vocab_size=100, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=128, tie_embeddings=False)
P = 53_952
WORKSPACES = 2 * 32 * MiB      # cuBLAS: forward's and autograd's, kept for the process
# The module buffers, on the device from init on: the rotary inv_freq and original_inv_freq, head_dim / 2
# = 8 fp32 elements each (under zero.Init at stage 3 in the training dtype, 2 B an element).
BUFFERS = 2 * 8 * 4


def setup(stage, dp=1, dtype_fp16=False, **kw):
    return Setup(stage=Stage(stage), dp=dp, optimizer=OPTIMIZERS["adamw"], dtype="fp16" if dtype_fp16 else "bf16",
                 seq_len=16, micro_batch=2, attention="sdpa", **kw)


def alive_bytes(events):
    """Requested bytes allocated and not freed at the end (no allocator rounding)."""
    sizes, alive = {}, 0
    for e in events:
        if e[0] == "alloc":
            sizes[e[1]] = e[2]
            alive += e[2]
        elif e[0] == "free":
            alive -= sizes.pop(e[1])
    return alive


def test_every_free_is_of_a_live_allocation():
    for stage in (0, 1, 2):
        live = set()
        for e in sequence.events(from_architecture(TINY), setup(stage)):
            if e[0] == "alloc":
                assert e[1] not in live
                live.add(e[1])
            else:
                live.remove(e[1])


@pytest.mark.parametrize("stage, dp, states_bytes", [
    # stage 2, N = 1: flat bf16 parameters 2·P, fp32 master 4·P, Adam's two moments 8·P (made at the
    # first step); the module's tensors, init's clone and zero buffer, activations, gradients, the
    # bucket, the partition gradients and the step's flatten and fp32 cast are all freed.
    (2, 1, 2 * P + 4 * P + 8 * P),
    # stage 1, N = 2: the flat group pads to a multiple of 2·N = 4 (53,952 is one), each rank keeps
    # S = 26,976: 2·P + 4·S + 8·S.
    (1, 2, 2 * P + 4 * 26_976 + 8 * 26_976),
    # stage 0 (FP16_Optimizer): the same 2·P + 4·P + 8·P; the bf16 gradients are set to None at the step.
    (0, 1, 2 * P + 4 * P + 8 * P),
])
@pytest.mark.parametrize("gas", [1, 3])
def test_after_a_step_only_model_states_and_cublas_workspaces_stay(stage, dp, states_bytes, gas):
    """Gradient accumulation leaves nothing more behind: the gradients kept across micro-steps (stages
    0 and 1), the bucket kept to the boundary (stage 1) and stage 2's accumulator are gone after the step."""
    events = sequence.events(from_architecture(TINY), setup(stage, dp, gas=gas), steps=1)
    assert alive_bytes(events) == states_bytes + BUFFERS + WORKSPACES


BUCKET = 2 * 500_000_000       # ZeRO-3's ipg bucket: reduce_bucket_size elements of bf16, kept


@pytest.mark.parametrize("dp, shard, persistent, threshold", [
    (1, P, 0, 0),
    # N = 2: every tensor of TINY has an even numel, so S3 = sum of ceil(n / 2) = P / 2 = 26,976
    (2, 26_976, 0, 0),
    # every tensor of TINY is below the default persistence threshold (1e5 elements): at N = 2 each
    # stays gathered whole from init on, 2·P bytes (at N = 1 a parameter is a view of its partition)
    (2, 26_976, 2 * P, 100_000),
    (1, P, 0, 100_000),
])
def test_stage3_leaves_its_partitions_bucket_and_moments(dp, shard, persistent, threshold):
    """Stage 3 after a step: the flat bf16 partition 2·S3, the fp32 partition 4·S3 (one sub-group),
    the ipg bucket, the flat gradient partitions 2·S3 and Adam's moments 8·S3, and the persistent
    parameters; the module's own tensors, init's partition copies, casts and zero buffer, every
    gathered parameter (released at the end of backward), the reduction's flatten and the step's fp64
    and fp32 copies are freed."""
    events = sequence.events(from_architecture(TINY), setup(3, dp, param_persistence_threshold=threshold), steps=1)
    assert alive_bytes(events) == 2 * shard + 4 * shard + BUCKET + 2 * shard + 8 * shard + persistent + BUFFERS + WORKSPACES
    assert ("empty_cache",) in events                  # init's defragment empties the cache


@pytest.mark.parametrize("stage, offload_param, threshold, states_bytes", [
    # stage 2 + optimizer offload: the flat bf16 group 2·P and temp_grad_buffer_for_gpu_offload, the
    # largest parameter's numel in bf16 (TINY's 128·64 = 8192); master, moments and gradients on the host
    (2, "none", 100_000, 2 * P + 2 * 8192),
    # stage 3 + optimizer offload: the flat bf16 partition 2·S3 (S3 = P at N = 1) and the ipg bucket
    (3, "none", 100_000, 2 * P + BUCKET),
    # and parameter offload: the partitions on the host too; the bucket stays, and at N = 1 every
    # persistent parameter (all of TINY's at the default threshold) stays on the device whole
    (3, "cpu", 0, BUCKET),
    (3, "cpu", 100_000, BUCKET + 2 * P),
])
def test_optimizer_offload_leaves_the_bit16_states_on_the_device(stage, offload_param, threshold, states_bytes):
    events = sequence.events(from_architecture(TINY), setup(stage, offload_optimizer="cpu", offload_param=offload_param,
                                                             param_persistence_threshold=threshold), steps=1)
    assert alive_bytes(events) == states_bytes + BUFFERS + WORKSPACES


def test_stage3_gathers_run_on_their_own_stream_at_n2_only():
    one = sequence.events(from_architecture(TINY), setup(3, 1, param_persistence_threshold=0), steps=2)
    two = sequence.events(from_architecture(TINY), setup(3, 2, param_persistence_threshold=0), steps=2)
    streams = lambda ev: {e[3] for e in ev if e[0] == "alloc"}          # noqa: E731
    assert streams(one) == {0, 2}                      # compute, and the reduction's flatten
    assert streams(two) == {0, 1, 2}                   # and the all-gathers


def test_overlap_comm_doubles_the_bucket_and_reduces_on_its_own_stream():
    """overlap_comm at N = 2: setup_buckets makes two buffers of reduce_bucket_size elements (bf16:
    2 x 5e8 B each), alive together through backward; the reduction stream's pool (3) takes the
    bucket's flatten (TINY's P = 53,952 gradients in one bucket spanning both ranks: 2·P B) and rank
    0's partition gradients, every parameter overlapping its slice [0, 26,976) whole (embedding 6400,
    q, k, v, o 4·4096, gate 8192: 30,976 elements, 2 B each); rank 1's are its own (gate, up, down
    3·8192, the norms 3·64, head 6400: 31,168): the busier, whose replay gives the job's peaks, rank 0
    replayed beside it for a verdict on a card (`simulated_ranks`). Stage 1 with overlap_comm takes stage 2's path: the same events.
    Afterwards the same model states stay."""
    tiny = from_architecture(TINY)
    events = sequence.events(tiny, setup(2, 2, overlap_comm=True), steps=1)
    assert [e[2] for e in events if e[0] == "alloc" and e[3] == 3] == [2 * P, 2 * 30_976]
    rank1 = sequence.events(tiny, setup(2, 2, overlap_comm=True), steps=1, rank=1)
    assert [e[2] for e in rank1 if e[0] == "alloc" and e[3] == 3] == [2 * P, 2 * 31_168]
    assert sequence.simulated_ranks(tiny, setup(2, 2)) == (1,)
    assert sequence.simulated_ranks(tiny, setup(2, 2), every=True) == (0, 1)
    buckets = [e[1] for e in events if e[0] == "alloc" and e[2] == 2 * 500_000_000]
    assert len(buckets) == 2 and buckets[1] == buckets[0] + 1
    assert sequence.events(tiny, setup(1, 2, overlap_comm=True)) == sequence.events(tiny, setup(2, 2, overlap_comm=True))
    assert alive_bytes(events) == alive_bytes(sequence.events(tiny, setup(2, 2), steps=1))


def test_a_later_job_makes_the_workspaces_before_init():
    fresh = sequence.events(from_architecture(TINY), setup(2), steps=1)
    later = sequence.events(from_architecture(TINY), setup(2), steps=1, fresh_process=False)
    assert later[:2] == [("alloc", 1, 32 * MiB, 0), ("alloc", 2, 32 * MiB, 0)]
    assert alive_bytes(later) == alive_bytes(fresh)


def test_zero_init_makes_one_parameter_whole_at_a_time():
    # Under zero.Init (N = 4, bf16) each parameter is made whole on the device in bf16 and its 1/4
    # partition made before the whole tensor is freed: for the embedding (100·64 = 6400): 2·6400 =
    # 12,800 B, the partition 2·1600 = 3,200, the whole freed. The whole model (2·P = 107,904 B) is
    # never alive at once.
    events = sequence.events(from_architecture(TINY), setup(3, 4, zero_init=True), steps=0)
    assert events[:3] == [("alloc", 1, 12_800, 0), ("alloc", 2, 3_200, 0), ("free", 1)]
    alive, most = {}, 0
    for e in events[:3 * 12]:       # the 12 parameters' construction
        if e[0] == "alloc":
            alive[e[1]] = e[2]
        else:
            alive.pop(e[1])
        most = max(most, sum(alive.values()))
    # the largest moment: the down projection whole (2·8192 = 16,384 B) and its partition 4,096 beside
    # the partitions made before it: the embedding's 3,200, q, k, v, o 4 · 2·1024 = 8,192, gate and up
    # 2 · 2·2048 = 8,192 (the head, 12,800 whole, comes with less beside it: 39,776)
    assert most == 16_384 + 4_096 + 3_200 + 8_192 + 8_192
    # at the end of construction only the partitions are alive: 2 B · ceil(n/4) each
    numels = [6400] + [4096] * 4 + [8192] * 3 + [64] * 3 + [6400]
    assert alive_bytes(events[:3 * 12]) == sum(2 * -(-n // 4) for n in numels)
    assert events[3 * 12:3 * 12 + 2] == [("alloc", 25, 8 * 2, 0), ("alloc", 26, 8 * 2, 0)]   # the buffers, bf16
    assert events[3 * 12 + 2] == ("free", 2)   # then the engine frees the partitions for its flat buffer


def test_stage3_gradient_accumulation_is_generated():
    # Stage 3 reduces and partitions every micro-step's gradients as they come (stage3.py:
    # partition_grads adds later micro-steps in place), so its sequence is each micro-step's
    # fetches, forward and backward in turn, and the step at the boundary only.
    model = from_architecture(TINY)
    assert sequence.events(model, setup(3, 2, gas=2)) is not None
    assert estimate(model, setup(3, 2, gas=2)).reserved_source == "simulated"


def test_what_is_not_generated_falls_back_to_the_ratio():
    model = from_architecture(TINY)
    for s in (setup(2, gas=2, offload_optimizer="cpu"),
              setup(3, offload_optimizer="cpu", dtype_fp16=True), setup(3, 2, offload_optimizer="cpu", offload_param="cpu"),
              setup(2, gas=2, overlap_comm=True), setup(1, overlap_comm=True, offload_optimizer="cpu"),
              Setup(stage=Stage(2), optimizer=OPTIMIZERS["adamw"], dtype="fp32", seq_len=16)):
        assert sequence.events(model, s) is None
        assert estimate(model, s).reserved_source == "ratio"
    e = estimate(model, setup(2))
    assert e.reserved_source == "simulated"
    assert e.as_dict()["peak_reserved_source"] == "simulated"


# Reserved growth the H200 allocator recorded in fresh processes (first job of the process, nothing
# cached: every stage 0-3 history without offload recorded so, data/snapshots/, GiB; rank 0's). The
# generated sequence gives the same reserved peak to 0.1%, the model's side played from the families'
# streams (`zerocalc/family_streams.json`; the hand-written layers they replaced, transcribed from the
# histories, are `tests/transcribed_sequence.py`).
FRESH_HISTORIES = [
    ("t3-warmup-b/seed-gpt-h768-l12-s2-bf16-n1-b1x2048-gas1-789692f14d", 5.379, 0.001),
    ("t4-warmup/hf-llama-h768-l12-s2-bf16-n1-b1x2048-gas1-0d2548528e", 3.455, 0.001),
    ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n2-b2x1024-gas1-a948bae5f0", 18.561, 0.001),
    ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n1-b8x2048-gas1-0729e40f46", 28.691, 0.001),
    # stage 3: N = 1 (no gathers), and N = 2 (the first iteration's per-module gathers, then prefetch)
    ("t4-warmup/seed-gpt-h2048-l24-s3-bf16-n1-b2x1024-gas1-384ef99f26", 34.715, 0.001),
    ("t4-warmup/hf-llama-h2048-l22-s3-bf16-n2-b2x1024-gas1-5cba866319", 20.037, 0.001),
    # optimizer offload (stages 1-3) and, for the Llama, parameter offload beside it
    ("t5-offload/hf-llama-h2048-l22-s1-bf16-n1-b1x512-gas1-941987ae02", 6.242, 0.001),
    ("t5-offload/seed-gpt-h2048-l24-s2-bf16-n1-b2x1024-gas1-1d0e8739a8", 10.236, 0.001),
    ("t5-offload/hf-llama-h2048-l22-s3-bf16-n1-b2x1024-gas1-b4a36ecbef", 9.584, 0.001),
    ("t5-offload/seed-gpt-h2048-l24-s3-bf16-n1-b2x1024-gas1-4e65d1b680", 13.510, 0.002),
    ("t4-warmup/hf-llama-h2048-l22-s3-bf16-n1-b4x2048-gas1-f4c95cdf9c", 11.305, 0.001),
    # gradient accumulation (GAS 2): stages 0-2 to 0.1% (stage 0 was 7.5% low with seed-gpt's coarse backward)
    ("t4-gas/seed-gpt-h768-l12-s2-bf16-n1-b2x1024-gas2-18b51ee617", 6.002, 0.001),
    ("t4-gas/hf-llama-h768-l12-s1-fp16-n1-b2x1024-gas2-11e84a6921", 4.924, 0.001),
    ("t4-gas/hf-llama-h768-l12-s2-bf16-n1-b1x2048-gas2-e251ce4402", 3.705, 0.001),
    ("t4-gas/seed-gpt-h768-l12-s0-bf16-n1-b4x512-gas2-49f13471da", 5.191, 0.001),
    # optimizer offload at N = 2 (rank 0's history; the row's peak is rank 1's, 10.957: not modelled)
    ("t6-offload-hist/seed-gpt-h2048-l24-s2-bf16-n2-b2x1024-gas1-98dcaca748", 10.189, 0.001),
    # overlap_comm at stages 1/2 (N = 2): the rules read from the 1.4B GPT's stage-2 history (the
    # first), then the other six (stage 1 and 2, GPT and Llama, checkpointed or not) to 0.3%
    ("t6-overlap/seed-gpt-h2048-l24-s2-fp16-n2-b2x1024-gas1-3efad2e735", 22.996, 0.001),
    ("t6-overlap/seed-gpt-h2048-l24-s1-fp16-n2-b2x1024-gas1-ec34dd3a11", 22.996, 0.001),
    ("t6-overlap/hf-llama-h2048-l22-s2-bf16-n2-b2x1024-gas1-6e214b72b6", 18.363, 0.001),
    ("t6-overlap/seed-gpt-h768-l12-s2-bf16-n2-b4x1024-gas1-a01b2f11cf", 7.965, 0.003),
    ("t6-overlap/hf-llama-h2048-l22-s1-bf16-n2-b4x1024-gas1-e2b1e2817c", 21.660, 0.001),
    ("t6-overlap/seed-gpt-h2048-l24-s2-bf16-n2-b4x1024-gas1-250ef99e00", 27.467, 0.002),
    ("t6-overlap/hf-llama-h2048-l22-s2-bf16-n2-b8x2048-gas1-fa680bafc8", 21.232, 0.001),
]


@pytest.mark.slow   # generates and replays a full-size job (the quick loop: pytest -m 'not slow')
@pytest.mark.xdist_group("committed")   # with the other readers of the committed rows, read once there
@pytest.mark.parametrize("name, recorded_gib, tolerance", FRESH_HISTORIES)
def test_generated_reserved_against_a_fresh_process_history(name, recorded_gib, tolerance):
    from validate import snapshot
    from validate.jobs import to_zerocalc
    snap = snapshot.load(os.path.join(ROOT, "data", "snapshots", name + ".json.gz"))
    trace = snap["device_traces"][0]
    recorded = allocator.replay(snapshot.allocator_events(trace), segment_addresses=snapshot.segment_addresses(trace))
    assert recorded.peak_reserved_bytes / GiB == pytest.approx(recorded_gib, abs=0.001)   # the history itself
    spec, s = to_zerocalc(history_jobs.job(name))
    generated = allocator.replay(sequence.events(spec, s, steps=2)).peak_reserved_bytes   # what a history spans
    assert abs(generated / recorded.peak_reserved_bytes - 1) <= tolerance


def test_a_process_of_one_job_is_a_fresh_process():
    model, s = from_architecture(TINY), setup(2)
    assert sequence.process_peak_reserved_bytes([(model, s)]) == sequence.peak_reserved_bytes(model, s)


def test_a_later_job_counts_what_the_earlier_one_left_reserved():
    """TINY's own tensors are all under 1 MiB (the small pool's 2 MiB segments); cuBLAS's two 32 MiB
    workspaces get segments of their own. After the first job the worker frees its tensors and empties
    the cache: the workspaces' two segments stay, and the second job, whose peak is counted from
    there, makes its small segments again: it reserves what the first did. Put the 1.4B GPT at stage 2
    (fp16, N = 2) first: its forward's workspace is carved from the 2698 MiB block that
    initialize_optimizer_states' zero buffer left free (as its H200 history records, event 991 without
    a new segment), so that whole segment survives the cache's emptying and the tiny job's peak counts
    it."""
    tiny, s = from_architecture(TINY), setup(2)
    alone = sequence.peak_reserved_bytes(tiny, s)
    assert sequence.process_peak_reserved_bytes([(tiny, s), (tiny, s)]) == alone
    gpt = from_architecture(preset("seed-gpt"), "seed-gpt")
    first = Setup(stage=Stage(2), dp=2, optimizer=OPTIMIZERS["adamw"], dtype="fp16", seq_len=1024, micro_batch=2)
    zero_buffer = 4 * 1_414_455_296 // 2                   # 4·S, S = P / N (P is a multiple of 2N)
    after = sequence.process_peak_reserved_bytes([(gpt, first), (tiny, s)])
    assert after >= zero_buffer and after > alone
    assert sequence.process_peak_reserved_bytes([(tiny, s), (tiny, setup(3, offload_optimizer="cpu", gas=2))]) is None


def test_a_whole_process_at_once_gives_each_job_what_its_own_prefix_gives():
    """`process_peaks_reserved_bytes` replays a process once and reads every job's peak from it; a job's
    peak must not depend on the jobs after it, and each job is read under its own allocator setting.
    Checked against asking job by job (each prefix ending at that job): the 1.4B GPT at stage 2, then
    TINY with expandable segments, then TINY without; and a process with a job that is not generated
    (stage 3 with optimizer offload and GAS 2), from which on nothing is known."""
    tiny, gpt = from_architecture(TINY), from_architecture(preset("seed-gpt"), "seed-gpt")
    first = Setup(stage=Stage(2), dp=2, optimizer=OPTIMIZERS["adamw"], dtype="fp16", seq_len=1024, micro_batch=2)
    jobs = [(gpt, first), (tiny, setup(2, expandable_segments=True)), (tiny, setup(2))]
    peaks = sequence.process_peaks_reserved_bytes(jobs)
    by_prefix = [sequence.process_peaks_reserved_bytes(jobs[:k + 1])[-1] for k in range(3)]
    assert peaks == by_prefix
    assert peaks[0] == sequence.peak_reserved_bytes(gpt, first)                 # the first job is a fresh process
    assert peaks[2] > sequence.peak_reserved_bytes(tiny, setup(2))              # the GPT's zero buffer stays
    stuck = [(tiny, setup(2)), (tiny, setup(3, offload_optimizer="cpu", gas=2)), (tiny, setup(2))]
    assert sequence.process_peaks_reserved_bytes(stuck) == [sequence.peak_reserved_bytes(tiny, setup(2)), None, None]


def test_a_later_job_that_starts_with_the_workspaces_made():
    """The 1.4B GPT at stage 2 (fp16, N = 2) run after a stage-0 job in one process
    (data/h200-t5-process-n2.csv): its history starts with cuBLAS's two workspaces in 32 MiB segments
    of their own and grows reserved by 21.131 GiB, what the same configuration grows as the first job
    of a process. Generated with the workspaces made first (two 32 MiB segments, 0.0625 GiB), it lands
    on the same segments: the residual stream's gradient, one tensor accumulated in place through the
    layers, keeps the block the first bucket's flatten would otherwise take (12% low without it)."""
    pd = pytest.importorskip("pandas")
    from validate import snapshot
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row
    snap = snapshot.load(os.path.join(ROOT, "data", "snapshots", "t5-process",
                                      "seed-gpt-h2048-l24-s2-fp16-n2-b2x1024-gas1-3f6b13ee2c.json.gz"))
    trace = snap["device_traces"][0]
    recorded = allocator.replay(snapshot.allocator_events(trace), snapshot.start_segments(snap),
                                segment_addresses=snapshot.segment_addresses(trace))
    assert recorded.peak_reserved_bytes / GiB == pytest.approx(21.131, abs=0.001)
    row = pd.read_csv(os.path.join(ROOT, "data", "h200-t5-process-n2.csv")).iloc[1].to_dict()
    spec, s = to_zerocalc(job_from_row(row))
    generated = allocator.replay(sequence.events(spec, s, steps=2, fresh_process=False)).peak_reserved_bytes
    assert abs(generated - 2 * 32 * MiB - recorded.peak_reserved_bytes) / recorded.peak_reserved_bytes < 0.001


def _recorded_job(folder, key, csv, index):
    """(history, its start segments, the row's model and setup, the row) of a recorded job."""
    pd = pytest.importorskip("pandas")
    from validate import snapshot
    from validate.jobs import to_zerocalc
    from validate.rows import job_from_row
    snap = snapshot.load(os.path.join(ROOT, "data", "snapshots", folder, key + ".json.gz"))
    rows = pd.read_csv(os.path.join(ROOT, "data", csv))
    row = rows.iloc[index].to_dict()
    assert row["key"] == key
    jobs = [to_zerocalc(job_from_row(r.to_dict())) for _, r in rows.iloc[:index + 1].iterrows()]
    return snap, snapshot.start_segments(snap), jobs, row


def test_a_later_job_fills_the_ranges_the_earlier_one_returned():
    """The 1.1B Llama at stage 2 (bf16, N = 2, 2x1024) after the 1.4B GPT at stage 2 (bf16, 4x1024) in
    one process (data/h200-t6-process-n2.csv): 14.533 GiB reserved, where it reserves 18.561 as a first
    job; the seventh job of h200-t2-n2-a's process, after the same first job, reserved the same. The
    GPT leaves its workspaces in a 128 MiB and a 32 MiB segment (its history); the Llama's history
    puts 92 of its 93 large segments inside the GPT's old address range, each at the lowest place
    it fits: the equal-sized free blocks they make are then taken in another order than in a fresh
    process. Simulated so (zerocalc.allocator: a segment takes the lowest range empty_cache returned
    that holds it), the pair is within 0.2%; with every new segment below the last, as in a fresh
    process, it was 14% high."""
    from validate import snapshot
    snap, start, jobs, row = _recorded_job("t6-process", "hf-llama-h2048-l22-s2-bf16-n2-b2x1024-gas1-e34f8ef4fe",
                                           "h200-t6-process-n2.csv", 1)
    assert sorted(s[1] // MiB for s in start) == [2, 32, 128]
    gpt = snapshot.load(os.path.join(ROOT, "data", "snapshots", "t6-process",
                                     "seed-gpt-h2048-l24-s2-bf16-n2-b4x1024-gas1-64c5ebe582.json.gz"))
    old = [(e["addr"], e["addr"] + e["size"]) for e in gpt["device_traces"][0]
           if e["action"] == "segment_alloc" and e["size"] > 2 * MiB]
    lo, hi = min(a for a, _ in old), max(b for _, b in old)
    new = [e["addr"] for e in snap["device_traces"][0] if e["action"] == "segment_alloc" and e["size"] > 2 * MiB]
    assert len(new) == 93 and sum(lo <= a < hi for a in new) == 92
    measured = row["measured_peak_reserved_bytes"]
    assert measured / GiB == pytest.approx(14.533, abs=0.001)
    assert abs(sequence.process_peak_reserved_bytes(jobs) / measured - 1) < 0.002


def test_reserved_can_still_grow_in_the_third_step():
    """The 1.1B Llama at stage 0 (bf16, N = 1, 4x2048) as the third job of its process
    (data/h200-t6-process-b-n1.csv, after the Llama at stage 2 8x2048 and the GPT at stage 2 8x1024):
    its history (init and the two warm-up steps) grows reserved to 35.512 GiB, the generated two steps
    from the same start cache to within 0.01%; the row's peak, 39.611 GiB, is set in the forward of
    a measured step after them (measured_forward_reserved_bytes), which a third generated step
    reaches too, and the simulation of the whole process gives it."""
    snap, start, jobs, row = _recorded_job("t6-process-b", "hf-llama-h2048-l22-s0-bf16-n1-b4x2048-gas1-e63c93a2fa",
                                           "h200-t6-process-b-n1.csv", 2)
    held = sum(s[1] for s in start)
    model, s = jobs[-1]
    assert snap["zerocalc_peak_reserved"] / GiB == pytest.approx(35.512, abs=0.001)
    assert row["measured_first_step_reserved_bytes"] == snap["zerocalc_peak_reserved"]
    assert row["measured_forward_reserved_bytes"] == row["measured_peak_reserved_bytes"]
    for steps, recorded in ((2, snap["zerocalc_peak_reserved"]), (3, row["measured_peak_reserved_bytes"])):
        ev = sequence.events(model, s, steps=steps, fresh_process=False)[2:]   # the workspaces are in `start`
        generated = held + allocator.replay(ev, start).peak_reserved_bytes
        assert abs(generated / recorded - 1) < 0.0002
    assert abs(sequence.process_peak_reserved_bytes(jobs) / row["measured_peak_reserved_bytes"] - 1) < 0.0002


def test_a_sum_over_tokens_stages_8_bytes_an_element_up_to_132_mib():
    """A norm weight's or a bias's gradient, summed over the tokens (the histories: 12 MiB for 2048
    tokens x 768, 32 MiB for 2048 x 2048, 128 MiB for 8192 x 2048; 132 MiB for 16384 x 2048)."""
    for tokens, width, staged in ((2048, 768, 12 * MiB), (2048, 2048, 32 * MiB), (8192, 2048, 128 * MiB),
                                  (16384, 2048, 132 * MiB)):
        assert sequence.staging_bytes(tokens * width) == staged


def _steps(init, step, count):
    """Pieces for `sequence.replay_steps`: init's events, then `count` steps, step(k, first handle)
    making each step's events with fresh handles from that first handle on."""
    pieces, last = [(init, 0)], max(e[1] for e in init if e[0] == "alloc")
    for k in range(count):
        events = step(k, last + 1)
        pieces.append((events, last))
        last = max([last] + [e[1] for e in events if e[0] == "alloc"])
    return pieces


def _run_and_skipped(pieces, monkeypatch):
    skipped = []
    real_skip = allocator._Allocator.skip
    monkeypatch.setattr(allocator._Allocator, "skip", lambda self, n: (skipped.append(n), real_skip(self, n)))
    return sequence.replay_steps(iter(pieces)), skipped


def test_a_step_that_leaves_the_cache_as_it_found_it_stops_the_replay(monkeypatch):
    """init keeps W (100 MiB); each step makes A (30 MiB), B (50 MiB), frees A, makes C (25 MiB), frees
    B and C. The first step makes a 30 MiB segment for A and a 50 MiB one for B; C takes A's freed
    block (25 of 30 MiB: 5 MiB left, more than 1 MiB, so split); all freed, both segments stay as
    whole free blocks. The second step runs on them: A takes the 30 MiB, B the 50 MiB, C A's again,
    nothing new; it leaves the cache as it found it, so steps 3..10 are not run. Reserved peaks at
    100 + 30 + 50 = 180 MiB, allocated at 100 + 30 + 50 = 180 MiB (A and B together), as replaying all
    ten steps gives."""
    init = [("alloc", 1, 100 * MiB, 0)]

    def step(k, h):
        return [("alloc", h, 30 * MiB, 0), ("alloc", h + 1, 50 * MiB, 0), ("free", h),
                ("alloc", h + 2, 25 * MiB, 0), ("free", h + 1), ("free", h + 2)]

    pieces = _steps(init, step, 10)
    result, skipped = _run_and_skipped(pieces, monkeypatch)
    assert skipped == [6] * 8                                   # steps 3 to 10
    assert result.peak_reserved_bytes == 180 * MiB and result.peak_allocated_bytes == 180 * MiB
    assert result == allocator.replay([e for events, _ in pieces for e in events])._replace(init_peak_allocated_bytes=100 * MiB)


def test_a_step_that_differs_from_the_steady_one_is_run(monkeypatch):
    """As above, but the seventh step makes B 60 MiB: no cached block holds it, so it needs a segment
    of its own (reserved 100 + 30 + 50 + 60 = 240 MiB); steps 3-6 are skipped, the seventh is run, the
    eighth (B 50 MiB again) is run against the seventh, which grew the cache, and the ninth and tenth
    are skipped once the eighth left the cache as it found it."""
    init = [("alloc", 1, 100 * MiB, 0)]

    def step(k, h):
        b = 60 * MiB if k == 6 else 50 * MiB
        return [("alloc", h, 30 * MiB, 0), ("alloc", h + 1, b, 0), ("free", h),
                ("alloc", h + 2, 25 * MiB, 0), ("free", h + 1), ("free", h + 2)]

    pieces = _steps(init, step, 10)
    result, skipped = _run_and_skipped(pieces, monkeypatch)
    assert len(skipped) == 4 + 2                                # steps 3-6, then 9 and 10
    assert result.peak_reserved_bytes == 240 * MiB
    assert result == allocator.replay([e for events, _ in pieces for e in events])._replace(init_peak_allocated_bytes=100 * MiB)


def test_a_tensor_kept_across_steps_is_not_a_steady_state(monkeypatch):
    """Each step frees the tensor the step before kept and keeps one of its own (a carried buffer):
    the cache may look the same, but the tensors held differ, so every step is run."""
    init = [("alloc", 1, 100 * MiB, 0), ("alloc", 2, 40 * MiB, 0)]

    def step(k, h):
        return [("alloc", h, 40 * MiB, 0), ("free", h - 1 if k else 2)]

    pieces = _steps(init, step, 5)
    result, skipped = _run_and_skipped(pieces, monkeypatch)
    assert skipped == []
    assert result == allocator.replay([e for events, _ in pieces for e in events])._replace(init_peak_allocated_bytes=140 * MiB)


def test_against_a_capacity_the_steps_retry_then_settle_or_stop_at_the_oom():
    """init keeps W (100 MiB); each step makes A (30 MiB), frees it, makes B (50 MiB), frees it.
    Capacity 150 MiB. Step 1: A a 30 MiB segment (130); B fits no free block (30 MiB): a 50 MiB segment
    would make 180 > 150, so the allocator returns A's free segment and retries (100 + 50 = 150).
    Step 2: A takes the front of B's free 50 MiB block (20 MiB stay, split), freed, merged back; B
    takes it whole: nothing made or returned, but the cache differs from step 1's start (B's segment,
    not A's), so step 2 is run; step 3 finds step 2's start and events: skipped, and so on. Reserved
    peaks at 150 MiB with one retry, as the replay of every event against the capacity gives.
    Capacity 140 MiB: step 1's B finds 130 reserved, the retry leaves 100, 150 > 140: OOM at event 3
    (init's W, A, A's free, B), and no later step runs."""
    init = [("alloc", 1, 100 * MiB, 0)]

    def step(k, h):
        return [("alloc", h, 30 * MiB, 0), ("free", h), ("alloc", h + 1, 50 * MiB, 0), ("free", h + 1)]

    pieces = _steps(init, step, 6)
    every = [e for events, _ in pieces for e in events]
    settled = sequence.replay_steps(iter(pieces), capacity_bytes=150 * MiB)
    assert settled.peak_reserved_bytes == 150 * MiB and settled.alloc_retries == 1 and settled.oom is None
    assert settled.releases == ((3, 30 * MiB),)
    assert settled == allocator.replay(every, capacity_bytes=150 * MiB)._replace(init_peak_allocated_bytes=100 * MiB)
    stopped = sequence.replay_steps(iter(pieces), capacity_bytes=140 * MiB)
    assert stopped.oom == (3, 50 * MiB, 50 * MiB, 100 * MiB, 100 * MiB)
    assert stopped == allocator.replay(every, capacity_bytes=140 * MiB)._replace(init_peak_allocated_bytes=100 * MiB)
    from zerocalc import fits
    assert [fits.phase(pieces, i) for i in (0, 1, 4, 5, 24)] == ["init", "step 1", "step 1", "step 2", "step 6"]


def test_the_allocators_verdict_on_a_generated_job_is_the_whole_replays():
    """A 4-layer Llama at stage 3, N = 2, 512 tokens, replayed against capacities from its live
    requests' peak to its unbounded reserved, every 64 MiB (`fits.at_capacity`, over
    `fits.CARD_STEPS` steps, steps skipped at the steady state): the same OOM or not and the same
    retries as replaying all its events against each; among them some run only thanks to retries
    and some run out."""
    from zerocalc import fits
    model = from_architecture(Architecture("hf-llama", 32000, 1024, 4, 8, 8, 4096, False))
    s = Setup(stage=Stage.PARAMETERS, dp=2, seq_len=512)
    jobs = fits.near_card(model, s)
    events = sequence.events(model, s, steps=fits.CARD_STEPS)
    assert [delay for _, delay, _ in jobs] == list(fits.GATHER_FREE_DELAYS)
    on_time = [j for j in jobs if not j[1]]
    least, reserved = fits.least_allocated_bytes(on_time), allocator.replay(events).peak_reserved_bytes
    seen = set()
    for capacity in range(least - least % (2 * MiB), reserved + 1, 64 * MiB):
        a, whole = fits.at_capacity(on_time, False, capacity), allocator.replay(events, capacity_bytes=capacity)
        assert (a.oom, a.alloc_retries) == (whole.oom, whole.alloc_retries)
        seen.add((a.runs, a.alloc_retries > 0))
    assert {(True, True), (False, True)} <= seen


def test_late_frees_move_only_the_all_gather_streams_frees():
    """`fits.late_frees` with a delay of 1: the free of h1 (made on the all-gather stream, 1) waits for
    one more allocation (h2) and comes after it; h2's free (stream 0) stays where it is; h3's free,
    due after an allocation that never comes in its piece, waits into the next piece and, with none
    after it, ends the job. The handles each piece had made before it are kept."""
    from zerocalc import fits
    g = sequence.GATHER_STREAM
    pieces = (([("alloc", 1, 10, g), ("free", 1), ("alloc", 2, 10, 0), ("free", 2), ("alloc", 3, 10, g), ("free", 3)], 0),
              ([("alloc", 4, 10, 0), ("free", 4), ("alloc", 5, 10, g), ("free", 5)], 3))
    assert fits.late_frees(pieces, 1) == (
        ([("alloc", 1, 10, g), ("alloc", 2, 10, 0), ("free", 1), ("free", 2), ("alloc", 3, 10, g)], 0),
        ([("alloc", 4, 10, 0), ("free", 3), ("free", 4), ("alloc", 5, 10, g), ("free", 5)], 3))
    assert fits.late_frees(pieces, 0) == tuple((list(e), last) for e, last in pieces)


def test_a_job_that_runs_only_with_frees_on_time_does_not_fit():
    """Two 100 MiB blocks of the all-gather stream one after the other, the first freed before the
    second is made. On time the second takes the first's cached block: 100 MiB reserved, it runs on a
    150 MiB card. Freed one allocation late, the first is still held when the second is asked for: a
    second 100 MiB segment, past 150 MiB, and the retry finds no whole free segment to return (the only
    one is held): OOM. So it runs under one timing and not the other: timing-dependent, not fits."""
    from zerocalc import fits
    g = sequence.GATHER_STREAM
    pieces = (([], 0), ([("alloc", 1, 100 * MiB, g), ("free", 1), ("alloc", 2, 100 * MiB, g), ("free", 2)], 0))
    jobs = ((0, 0, pieces), (0, 1, fits.late_frees(pieces, 1)))
    a = fits.at_capacity(jobs, False, 150 * MiB)
    assert not a.runs and a.timing_dependent and a.delays_run == (0,) and a.oom_delay == 1 and a.pressed
    assert a.oom.segment_bytes == 100 * MiB and a.oom.reserved_bytes == 100 * MiB and a.oom_phase == "step 1"
    assert fits.at_capacity(jobs, False, 200 * MiB).runs
    assert fits.smallest_capacity_bytes(jobs, False, 150 * MiB, 300 * MiB) == 200 * MiB


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stopping_at_the_steady_state_gives_the_whole_replay(stage):
    """The generated job replayed to its steady state against every event of it replayed: the same
    segments, releases and peaks (a tiny Llama, at N = 2 and with checkpointing, five steps)."""
    model = from_architecture(TINY)
    for s in (setup(stage, dp=2), setup(stage, dp=1, activation_checkpointing=True)):
        pieces, done, last = [], 0, 0
        for t, _ in sequence._pieces(model, s, 5, True, 0):
            pieces.append((t.events[done:], last))
            done, last = len(t.events), t.last_handle
        assert sequence.replay_steps(iter(pieces))._replace(init_peak_allocated_bytes=None) == allocator.replay(sequence.events(model, s, steps=5))


@pytest.mark.parametrize("numel, flattens", [(1000, 0), (1001, 3)])
def test_stage3_reduces_a_bucket_of_one_gradient_as_a_view(numel, flattens):
    """Three gradients of `numel` elements with reduce_bucket_size 1000 at N = 2: each arrives to find
    the bucket full (1000 + numel > 1000), so each bucket holds one. reduce_scatter_coalesced reduces
    one tensor that needs no padding as a view of it (1000 % 2 == 0: no flatten); 1001 elements are
    padded to 1002, so each of the three buckets is flattened on the reduction stream: 2·1002 bytes."""
    from zerocalc.model import ModelSpec
    model = ModelSpec("three", (numel,) * 3, ((0,), (1,), (2,)))
    t = sequence._Trace()
    ds = sequence._Stage3(t, model, setup(3, dp=2, reduce_bucket_size=1000))
    for i in (2, 1, 0):
        ds.grad_ready(i, numel)
    ds.end_backward()
    on_reduce = [e[2] for e in t.events if e[0] == "alloc" and e[3] == sequence._Stage3.REDUCE_STREAM]
    assert on_reduce == [2 * 1002] * flattens


def _peak_live(events, stream=0):
    """The most bytes alive at once among the events' allocations on `stream`."""
    sizes, live, peak = {}, 0, 0
    for e in events:
        if e[0] == "alloc" and e[3] == stream:
            sizes[e[1]] = e[2]
            live += e[2]
            peak = max(peak, live)
        elif e[0] == "free" and e[1] in sizes:
            live -= sizes.pop(e[1])
    return peak


@pytest.mark.parametrize("numel, peak_bytes", [(400, 800), (1500, 6000)])
def test_stage3_keeps_a_gradient_larger_than_the_bucket_until_the_next_hook(numel, peak_bytes):
    """Three bf16 gradients of `numel` elements, reduce_bucket_size 1000, N = 2. 400 elements fit the
    bucket: each is copied into it and freed in its hook, so one gradient (800 B) is alive at a time.
    1,500 do not: DeepSpeed leaves such a gradient where autograd made it, in the bucket's list, until
    the next gradient's hook reduces the bucket, so the next one (3,000 B) is made beside it: 6,000 B."""
    from zerocalc.model import ModelSpec
    model = ModelSpec("three", (numel,) * 3, ((0,), (1,), (2,)))
    t = sequence._Trace()
    ds = sequence._Stage3(t, model, setup(3, dp=2, reduce_bucket_size=1000))
    start = len(t.events)
    for i in (2, 1, 0):
        ds.grad_ready(i, numel)
    ds.end_backward()
    assert _peak_live(t.events[start:]) == peak_bytes
    assert alive_bytes(t.events[start:]) == 0


def test_stage3_hands_a_leafs_gradients_together_at_its_hook():
    """A model of a 100-element weight and a stage-3 leaf (an MoE block) of three 100-element ones,
    bf16, N = 2, reduce_bucket_size 1000. The leaf's gradients wait for its backward hook: the two made
    first stay alive (400 B) and nothing reaches the bucket until the third is made, then all three
    go in `parameters()` order. A gradient of another module arriving first ends the leaf's backward:
    its hook gives the parameters that made none zeros the size of the gathered weight (2 x 200 B)."""
    from zerocalc.model import ModelSpec
    scan = (((0,), (0,), False), ((), (1, 2, 3), True))
    model = ModelSpec("moe", (100,) * 4, ((0,), (1, 2, 3)), leaf_scans=(scan, scan[::-1], scan[::-1]))
    assert model.stage3_leaves == ((1, 2, 3),)
    t = sequence._Trace()
    ds = sequence._Stage3(t, model, setup(3, dp=2, reduce_bucket_size=1000))
    start = len(t.events)
    ds.grad_ready(3, 100)
    ds.grad_ready(2, 100)
    assert ds.bucket_params == [] and alive_bytes(t.events[start:]) == 400
    ds.grad_ready(1, 100)
    assert ds.bucket_params == [1, 2, 3] and alive_bytes(t.events[start:]) == 0
    t = sequence._Trace()
    ds = sequence._Stage3(t, model, setup(3, dp=2, reduce_bucket_size=1000))
    start = len(t.events)
    ds.grad_ready(3, 100)
    ds.grad_ready(0, 100)
    assert ds.bucket_params == [1, 2, 3, 0]
    made = [e[2] for e in t.events[start:] if e[0] == "alloc"]
    assert made == [200, 200, 200, 200] and alive_bytes(t.events[start:]) == 0


def test_the_peaks_say_whether_allocated_peaked_at_init():
    """init keeps W (100 MiB) and makes and frees T (200 MiB: a model held whole, then partitioned):
    allocated peaks at 300 MiB there. Steps that make and free A (50 MiB) take it from T's cached
    block and stay below: the peak is init's. Steps that make A of 250 MiB reach 100 + 250 = 350 MiB
    (a new 250 MiB segment beside T's, reserved 550 MiB): the peak is a step's."""
    init = [("alloc", 1, 100 * MiB, 0), ("alloc", 2, 200 * MiB, 0), ("free", 2)]
    for a_bytes, want in ((50 * MiB, (300 * MiB, 300 * MiB, True)), (250 * MiB, (350 * MiB, 550 * MiB, False))):
        pieces = _steps(init, lambda k, h: [("alloc", h, a_bytes, 0), ("free", h)], 3)
        r = sequence.replay_steps(iter(pieces))
        assert r.init_peak_allocated_bytes == 300 * MiB
        assert sequence.peaks_of([r]) == want
