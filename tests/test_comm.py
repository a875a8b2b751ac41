"""Logged communication bytes per optimizer step, worked out by hand for the toy model
n = (10, 7, 5), P = 22, bf16, N = 4 (Pp = 24, S = 6, S3 = 7)."""
from zerocalc.comm import collectives, total_bytes, total_wire_bytes
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage

TOY = ModelSpec("toy", (10, 7, 5), ((), (0,), (1,), (2,)))


def coll(stage, **kw):
    return collectives(TOY, Setup(stage=Stage(stage), dp=4, **kw))


def test_stage0_all_reduces_every_gradient_once():
    c = coll(0)
    assert total_bytes(c) == 2 * 22                     # all_reduce of b·P
    assert [x.op for x in c] == ["all_reduce"]


def test_stage0_fp32_adds_the_clipping_norm():
    assert total_bytes(coll(0, dtype="fp32")) == 4 * 22 + 4


def test_stage1_all_reduces_and_gathers_the_shard():
    # all_reduce b·P = 44, all_gather of the b·S shard = 12, fp32 norm 4 B, overflow flag 1 B
    assert total_bytes(coll(1)) == 44 + 12 + 4 + 1


def test_stage2_reduces_every_micro_step():
    # GAS 2: two all_reduce of 44, then the same step collectives
    assert total_bytes(coll(2, gas=2)) == 2 * 44 + 12 + 4 + 1


def test_stage3_all_persistent_sends_only_gradients_and_the_persistent_refresh():
    # every tensor persistent (<= 1e5): no forward gather; reduce_scatter c·N·S3 = 2·4·7 = 56;
    # fp64 norm 8 B; all_gather of the persistent shards b·7 = 14 after the step
    assert total_bytes(coll(3)) == 56 + 8 + 14


def test_stage3_nothing_persistent_gathers_forward_only():
    # threshold 0: forward gathers b·S3 = 14 (the prefetch bucket covers the model, so nothing is released)
    assert total_bytes(coll(3, param_persistence_threshold=0)) == 14 + 56 + 8


def test_stage3_released_params_are_gathered_again_in_backward():
    # no prefetch and no reuse window: every module is released after forward and gathered again
    c = coll(3, param_persistence_threshold=0, prefetch_bucket_size=0, max_reuse_distance=0)
    assert total_bytes(c) == 14 + 14 + 56 + 8


def test_ring_wire_volume_of_stage_1_is_three_halves_of_the_papers():
    # all-reduce 2(N-1)/N·L + all-gather (N-1)·L_shard; the tiny norms add a few bytes
    c = [x for x in coll(1) if x.elements > 1]
    assert total_wire_bytes(c) == 2 * 3 * 44 // 4 + 3 * 12


def test_stage_3_parameter_offload_at_n1_fetches_by_copy_not_collective():
    from zerocalc.estimate import estimate
    from zerocalc.model import from_params
    from zerocalc.training import Setup, Stage
    optimizer_only = estimate(from_params(10**8), Setup(stage=Stage.PARAMETERS, dp=1, offload_optimizer="cpu")).collectives
    off = estimate(from_params(10**8), Setup(stage=Stage.PARAMETERS, dp=1, offload_optimizer="cpu",
                                             offload_param="cpu")).collectives
    assert not any(c.op == "all_gather_into_tensor" for c in off)
    assert [c.as_dict() for c in off] == [c.as_dict() for c in optimizer_only]   # measured: 2,828,910,600 B both


def test_stage0_buckets_keep_their_tensors_and_one_alone_is_reduced_in_place():
    """`allreduce_no_retain` closes a bucket once it holds more than 500M elements: 600M alone (over the
    limit by itself), then 100M + 450M (550M > 500M), then the 10M left over, alone. The sizes are the
    sums; a bucket of one tensor is flattened as a view of it (no copy), which the sequence reads from
    the tensors."""
    from zerocalc.comm import stage0_allreduce_bucket_tensors, stage0_allreduce_buckets
    numels = (600_000_000, 100_000_000, 450_000_000, 10_000_000)
    assert stage0_allreduce_bucket_tensors(numels) == ((600_000_000,), (100_000_000, 450_000_000), (10_000_000,))
    assert stage0_allreduce_buckets(numels) == (600_000_000, 550_000_000, 10_000_000)
