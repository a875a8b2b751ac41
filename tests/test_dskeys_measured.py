"""ds_config keys zerocalc classifies from real DeepSpeed 0.19.8 jobs, each run beside the same job without
the key on gloo CPU ranks (a job's `ds_extra`, validate/jobs.py). The rows and the commands that made them:
tests/data/cpu-dskeys.csv and cpu-dskeys-b.csv (2 ranks, validate/matrices/cpu-dskeys.json, -b.json) and
cpu-dskeys-n4.csv (4 ranks, validate/matrices/cpu-dskeys-n4.json), all `VALIDATE_FEW_STEPS=1 python -m validate
run --backend cpu ...`. On CPU ranks the offloaded tensors are counted in the state with the rest.

The model of every job: seed-gpt, vocab 1001, hidden 33, 2 layers, 3 heads, ffn 101, untied head, bf16,
micro-batch 2 × 16 tokens. Its parameters, module by module (Ψ):
  embed 1001·33 = 33,033; per block: ln1 2·33 = 66, attention in_proj 3·33·33 + 3·33 = 3,267 + 99,
  out_proj 33·33 + 33 = 1,089 + 33, ln2 66, mlp 33·101 + 101 + 101·33 + 33 = 3,333 + 101 + 3,333 + 33:
  11,420 a block, 22,840 for two; ln_f 66; head 1001·33 = 33,033. Ψ = 33,033 + 22,840 + 66 + 33,033 = 88,972.
"""
import csv
import json
import os

from click.testing import CliRunner

from zerocalc import comm, dskeys, states
from zerocalc.cli import main
from zerocalc.model import from_architecture
from zerocalc.arch import Architecture
from zerocalc.training import Setup, Stage

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ARCH = Architecture("seed-gpt", 1001, 33, 2, 3, 3, 101, False)
PSI = 33_033 + 2 * (66 + 3_267 + 99 + 1_089 + 33 + 66 + 3_333 + 101 + 3_333 + 33) + 66 + 33_033
AGB = "zero_optimization.allgather_bucket_size"


def rows(name):
    with open(os.path.join(DATA, name)) as f:
        return list(csv.DictReader(f))


def row(name, stage, extra=None, **setup):
    """The one row of `name` at this stage, with this ds_extra and these Setup columns."""
    got = [r for r in rows(name) if int(r["stage"]) == stage and r.get("ds_extra", "") == (
        json.dumps({"zero_optimization": extra}, sort_keys=True) if extra else "")
        and all(r[k] == str(v) for k, v in setup.items())]
    assert len(got) == 1, (stage, extra, setup, len(got))
    return got[0]


def detail(r):
    return json.loads(r["measured_comm_detail"])


def estimate(tmp_path, zero, *args, top=None):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, **(top or {}),
                               "zero_optimization": zero}))
    return CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "2", "--ds-config", str(cfg), *args])


def test_the_model_is_the_one_written_out():
    assert PSI == 88_972 == from_architecture(ARCH).num_params


def test_allgather_bucket_size_moves_nothing_at_stages_1_and_2():
    """runtime/utils.py `all_gather_dp_groups` returns through `all_gather_into_tensor_dp_groups` whenever
    torch has all_gather_into_tensor (comm/torch.py `get_all_gather_function`: every torch 2): one call per
    parameter group, whatever the bucket size. The bucketed loop after it would have sent
    max(1, 44,486·2 // 1000) = 88 `all_gather` calls at a bucket of 1000."""
    for stage in (1, 2):
        default, small = row("cpu-dskeys.csv", stage, grad_accum_dtype=""), \
            row("cpu-dskeys.csv", stage, {"allgather_bucket_size": 1000})
        assert default["outcome"] == small["outcome"] == "ok"
        assert small["measured_state_bytes"] == default["measured_state_bytes"]
        assert detail(small) == detail(default)
        # the updated partition gathered once: Ψ/N = 88,972/2 = 44,486 elements (Ψ is a multiple of the
        # flat buffer's alignment 2·N = 4: no padding) × 2 B (bf16) = 88,972 bytes, one call
        assert detail(small)["all_gather_into_tensor | [Caller Func: all_gather_into_tensor_dp_groups]"] == [
            [PSI // 2 * 2, 1]]
        # the gradients all-reduced in one reduce_bucket_size (5e8) bucket: Ψ × 2 B = 177,944 bytes
        assert detail(small)["all_reduce | [Caller Func: allreduce_bucket]"] == [[PSI * 2, 1]]
        predicted = comm.collectives(from_architecture(ARCH), Setup(stage=Stage(stage), dp=2, micro_batch=2))
        gather = next(c for c in predicted if c.op == "all_gather_into_tensor")
        assert (gather.calls, gather.bytes) == (1, PSI // 2 * 2)
    assert dskeys.lookup(AGB)[0] == "no_effect"


def test_allgather_bucket_size_is_silent(tmp_path):
    r = estimate(tmp_path, {"stage": 2, "allgather_bucket_size": 2e8})
    assert r.exit_code == 0 and "allgather_bucket_size" not in r.output


def test_an_odd_allgather_bucket_size_is_refused_where_deepspeed_asserts(tmp_path):
    """stage_1_and_2.py, `__init__`: `allgather_bucket_size % nccl_start_alignment_factor == 0` (2). Stage 1
    with bf16 and fp32 gradient accumulation runs BF16_Optimizer (engine.py `_configure_optimizer`), which
    does not ask; with CPU offload it runs the ZeRO optimizer again (measured below, cpu-dskeys-b.csv)."""
    refused = row("cpu-dskeys.csv", 2, {"allgather_bucket_size": 1001})
    assert refused["outcome"] == "error"
    assert "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2" in refused["error"]
    assert row("cpu-dskeys.csv", 1, {"allgather_bucket_size": 1001}, grad_accum_dtype="fp32")["outcome"] == "ok"

    odd = {"stage": 2, "allgather_bucket_size": 1001}
    r = estimate(tmp_path, odd)
    assert r.exit_code == 2 and f"{AGB} = 1001: must be even at ZeRO stage 2" in r.output
    bf16_optimizer = {"data_types": {"grad_accum_dtype": "fp32"}}
    assert estimate(tmp_path, dict(odd, stage=1), top=bf16_optimizer).exit_code == 0
    assert estimate(tmp_path, dict(odd, stage=1), "--offload-optimizer", "cpu", top=bf16_optimizer).exit_code == 2
    assert estimate(tmp_path, dict(odd, stage=1), "--stage", "3", top=bf16_optimizer).exit_code == 0
    assert estimate(tmp_path, dict(odd, stage=2), "--stage", "3").exit_code == 0   # stage 3 never reads it
    cfg = tmp_path / "ds.json"   # plan, with the stage the ds_config fixes
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": odd}))
    r = CliRunner().invoke(main, ["plan", "--params", "1e9", "--gpu", "h100", "--max-gpus", "8", "--global-batch",
                                  "16", "--seq-len", "512", "--ds-config", str(cfg)])
    assert r.exit_code == 2 and f"{AGB} = 1001" in r.output


def test_module_granularity_threshold_stays_warned_and_what_it_does_is_recorded(tmp_path):
    """parameter_offload.py `_get_granularity_recursively`: a module's granularity is its parameters //
    its modules with parameters (containers pass their children's counts on, not their own). A block:
    11,420 // (ln1, attention and its out_proj, ln2, mlp's two Linears, the block) = 11,420 // 7 = 1,631;
    the model: 88,972 // 18 = 4,942. `_set_leaf_by_threshold_preorder` makes the first module at or under
    the threshold a z3 leaf, fetched whole; its release keeps the data (`free_data` False), which moves the
    allocation stream too: not modelled, so the key stays warned about."""
    name = "cpu-dskeys.csv"
    s3 = dict(param_persistence_threshold=200)
    for knobs in ({"prefetch_bucket_size": 50_000_000}, {"prefetch_bucket_size": 0, "max_reuse_distance": 0}):
        base = row(name, 3, **s3, **knobs)
        # 1000: under every granularity, nothing changes
        assert detail(row(name, 3, {"stage3_module_granularity_threshold": 1000}, **s3, **knobs)) == detail(base)
        # 5000: the whole model one leaf; its input (token ids) needs no grad and the first backward stops
        whole = row(name, 3, {"stage3_module_granularity_threshold": 5000}, **s3, **knobs)
        assert whole["outcome"] == "error" and "doesn't match the broadcast shape [1001, 33]" in whole["error"]
    # 2000: each block one leaf. With prefetch and reuse off every fetch is its own call. A block's
    # non-persistent shards (threshold 200): in_proj ⌈3,267/2⌉ = 1,634, out_proj ⌈1,089/2⌉ = 545, mlp
    # ⌈3,333/2⌉ = 1,667 twice: 5,513 elements × 2 B = 11,026 bytes, once in forward and once in backward
    # per block (4 calls), where each module had its own call before: the mlp Linears 1,667 × 2 B = 3,334
    # (8 calls), the attention 1,634 + 545 = 2,179 × 2 B = 4,358 (4 calls). The same bytes, half the calls.
    off = {"prefetch_bucket_size": 0, "max_reuse_distance": 0}
    gathers = "all_gather_into_tensor | [Caller Func: allgather_fn]"
    embed_head = [33_034, 4]   # ⌈33,033/2⌉ = 16,517 × 2 B, embed and head, forward and backward
    assert detail(row(name, 3, **s3, **off))[gathers] == [[3_334, 8], [4_358, 4], embed_head]
    leaves = detail(row(name, 3, {"stage3_module_granularity_threshold": 2000}, **s3, **off))
    assert leaves[gathers] == [[11_026, 4], embed_head]
    assert 11_026 * 4 == 3_334 * 8 + 4_358 * 4
    r = estimate(tmp_path, {"stage": 3, "stage3_module_granularity_threshold": 2000})
    assert r.exit_code == 0 and "stage3_module_granularity_threshold = 2000 is not modelled" in r.output


def test_hpz_runs_on_four_cpu_ranks_and_stays_warned(tmp_path):
    """zero_hpz_partition_size 2 at N = 4 (partition_parameters.py: `num_ranks_in_param_group` 2): forward
    gathers from all 4 ranks as before; a parameter released after forward keeps a secondary shard, its
    padded size N·⌈numel/N⌉ over 2 (`_partition_param_sec`), and backward gathers that within its group of
    2: twice the logged bytes per call. Not modelled (nor the secondary shards' memory, which the worker's
    state walk does not see either)."""
    name = "cpu-dskeys-n4.csv"
    knobs = dict(param_persistence_threshold=200, prefetch_bucket_size=0, max_reuse_distance=0)
    base, hpz = row(name, 3, **knobs), row(name, 3, {"zero_hpz_partition_size": 2}, **knobs)
    gathers = "all_gather_into_tensor | [Caller Func: allgather_fn]"
    # shards at N = 4: mlp Linear ⌈3,333/4⌉ = 834 × 2 B = 1,668; attention ⌈3,267/4⌉ + ⌈1,089/4⌉ = 817 +
    # 273 = 1,090 × 2 B = 2,180; embed/head ⌈33,033/4⌉ = 8,259 × 2 B = 16,518; each forward and backward
    assert detail(base)[gathers] == [[1_668, 8], [2_180, 4], [16_518, 4]]
    # hpZ: forward's half unchanged; backward's secondary shards, 4·834/2 = 1,668 × 2 B = 3,336,
    # 4·1,090/2 = 2,180 × 2 B = 4,360, 4·8,259/2 = 16,518 × 2 B = 33,036
    assert detail(hpz)[gathers] == [[1_668, 4], [2_180, 2], [3_336, 4], [4_360, 2], [16_518, 2], [33_036, 2]]
    assert sum(b * c for b, c in detail(hpz)[gathers]) - sum(b * c for b, c in detail(base)[gathers]) == \
        3_336 * 4 // 2 + 4_360 * 2 // 2 + 33_036 * 2 // 2   # backward's bytes doubled: 44,068 more
    r = estimate(tmp_path, {"stage": 3, "zero_hpz_partition_size": 2})
    assert r.exit_code == 0 and "zero_optimization.zero_hpz_partition_size = 2 is not modelled" in r.output


B = "cpu-dskeys-b.csv"
S = PSI // 2   # a rank's slice of the flat group: Ψ/N = 44,486 elements (Ψ a multiple of 2·N = 4: no padding)
LARGEST = 33_033   # the largest tensor, the embedding (and the untied head)
REDUCED = "all_reduce | [Caller Func: allreduce_bucket]"
IN_PLACE = "all_reduce | [Caller Func: gradient_reduction_w_predivide]"


def test_stage_1_bf16_with_fp32_accumulation_runs_zero_under_cpu_offload():
    """engine.py `_do_optimizer_sanity_check`: BF16_Optimizer for stage 1 + bf16 + fp32 gradient
    accumulation `and not self.zero_cpu_offload()`; with offload_optimizer cpu it is ZeRO's optimizer."""
    zero = row(B, 1, grad_accum_dtype="fp32", offload_optimizer="cpu")
    # ZeRO-Offload's tensors, term by term (bf16 b = 2):
    #   the module's bf16 parameters (views of the flat group)  2·Ψ = 2·88,972 = 177,944
    #   fp32 master slice (single_partition_of_fp32_groups)     4·S = 4·44,486 = 177,944
    #   Adam exp_avg + exp_avg_sq of the slice                  8·S            = 355,888
    #   fp32 gradient slice on the host (offload_gradient_dict) 4·S            = 177,944
    #   bf16 upload buffer (param_buffer_of_bit16_for_cpu_...)  2·S            =  88,972
    #   gradient staging, host and device side, the largest     2 × 2·33,033   = 132,132
    #   tensor each (temp_grad_buffer_for_cpu/gpu_offload)
    assert int(zero["measured_state_bytes"]) == 177_944 + 177_944 + 355_888 + 177_944 + 88_972 + 132_132 \
        == 2 * PSI + 4 * S + 8 * S + 4 * S + 2 * S + 2 * 2 * LARGEST == 1_110_824
    state = json.loads(zero["measured_state_detail"])
    assert state["engine.optimizer.single_partition_of_fp32_groups[]"] == 4 * S
    assert not any("fp32_groups_flat_partition" in k or "non_expert_gradients" in k for k in state)
    # the same bytes as the job without fp32 accumulation: the fp32 gradients do not outlive the step
    assert zero["measured_state_bytes"] == row(B, 1, grad_accum_dtype="", offload_optimizer="cpu")[
        "measured_state_bytes"]
    # ZeRO's norm (4 B) and overflow flag (1 B) all-reduces, which BF16_Optimizer does not send
    assert detail(zero)["all_reduce | [Caller Func: complete_grad_norm_calculation_for_cpu_offload]"] == [[4, 1]]
    assert detail(zero)["all_reduce | [Caller Func: has_overflow]"] == [[1, 1]]

    # Without offload, BF16_Optimizer: 2Ψ + 4S + 8S and its full fp32 gradient buffer 4·Ψ (non_expert_gradients)
    bf16 = row(B, 1, dtype="bf16", grad_accum_dtype="fp32", offload_optimizer="none")
    assert int(bf16["measured_state_bytes"]) == 2 * PSI + 4 * S + 8 * S + 4 * PSI == 1_067_664
    assert json.loads(bf16["measured_state_detail"])["engine.optimizer.non_expert_gradients[]"] == 4 * PSI
    assert set(detail(bf16)) == {"all_gather_into_tensor | [Caller Func: all_gather_into_tensor_dp_groups]", REDUCED}

    setup = dict(stage=Stage.OPTIMIZER_STATES, dp=2, micro_batch=2, seq_len=16, grad_accum_dtype="fp32")
    model = from_architecture(ARCH)
    for offload, r in (("cpu", zero), ("none", bf16)):
        s = Setup(**setup, offload_optimizer=offload)
        assert s.bf16_optimizer == (offload == "none")
        assert states.model_states(model, s).total_bytes == int(r["measured_state_bytes"])
        assert sum(c.bytes for c in comm.collectives(model, s)) == int(r["measured_comm_bytes"])


def test_nvme_keeps_bf16_optimizer_over_the_cpu_adam():
    """`zero_cpu_offload()` is true of device "cpu" only, while `zero_use_cpu_optimizer()` (cpu or nvme)
    makes the basic optimizer DeepSpeedCPUAdam: with nvme, BF16_Optimizer steps CPU Adam. On CPU ranks it
    runs; on a GPU its fp32 slice is on the device, which CPU Adam asserts against (cpu_adam.py; not run)."""
    nvme = row(B, 1, grad_accum_dtype="fp32", offload_optimizer="nvme")
    assert int(nvme["measured_state_bytes"]) == 2 * PSI + 4 * S + 8 * S + 4 * PSI == 1_067_664
    state = json.loads(nvme["measured_state_detail"])
    assert state["engine.optimizer.non_expert_gradients[]"] == 4 * PSI
    # FusedAdam's overflow buffer is there without offload, not beside CPU Adam
    assert "engine.basic_optimizer._dummy_overflow_buf" not in state
    assert "engine.basic_optimizer._dummy_overflow_buf" in json.loads(
        row(B, 1, dtype="bf16", grad_accum_dtype="fp32", offload_optimizer="none")["measured_state_detail"])
    assert Setup(stage=Stage.OPTIMIZER_STATES, dp=2, grad_accum_dtype="fp32", offload_optimizer="nvme").bf16_optimizer


def test_stage_2_with_fp32_accumulation_runs_zero_with_or_without_offload():
    for offload, expected in (("none", 2 * PSI + 4 * S + 8 * S), ("cpu", 1_110_824)):
        acc = row(B, 2, grad_accum_dtype="fp32", offload_optimizer=offload)
        same = row(B, 2, grad_accum_dtype="", offload_optimizer=offload, reduce_bucket_size=500_000_000)
        # without offload: bf16 parameters 2Ψ, fp32 master slice 4S, Adam 8S = 711,776
        assert int(acc["measured_state_bytes"]) == int(same["measured_state_bytes"]) == expected
        assert detail(acc) == detail(same)


def test_the_other_mixes_with_fp32_accumulation():
    """BF16_Optimizer is for bf16 alone: stage 1 fp16 with fp32 accumulation runs ZeRO's optimizer, its
    state that of the job without it, 2Ψ + 4S + 8S = 711,776. Stage 0 takes no accumulation dtype but the
    model's (`_do_optimizer_sanity_check` raises)."""
    fp16 = row(B, 1, dtype="fp16", grad_accum_dtype="fp32")
    assert int(fp16["measured_state_bytes"]) == 2 * PSI + 4 * S + 8 * S == 711_776
    assert "engine.optimizer.single_partition_of_fp32_groups[]" in json.loads(fp16["measured_state_detail"])
    assert not Setup(stage=Stage.OPTIMIZER_STATES, dp=2, dtype="fp16", grad_accum_dtype="fp32").bf16_optimizer
    stage0 = row(B, 0, grad_accum_dtype="fp32")
    assert stage0["outcome"] == "error" and "NotImplementedError: unsupported mix of model_dtype=torch.bfloat16 " \
        "and grad_accum_dtype=torch.float32" in stage0["error"]


def test_reduce_scatter_false_sends_the_same_all_reduce():
    """stage_1_and_2.py `average_tensor`: with reduce_scatter false the bucket is all-reduced in place
    (`gradient_reduction_w_predivide`); with it true (the default) its per-rank slices go through
    `allreduce_and_scatter` → `allreduce_bucket`, which all-reduces them as one flattened copy (a bucket
    that spans two ranks' slices). The same state and the same all-reduces, one bucket or four; only the
    flatten copy, a transient the CPU rows cannot show, is not made: the key stays warned about."""
    for stage, size in ((1, 500_000_000), (2, 500_000_000), (2, 20_000)):
        default = row(B, stage, reduce_bucket_size=size, grad_accum_dtype="", offload_optimizer="none")
        off = row(B, stage, {"reduce_scatter": False}, reduce_bucket_size=size)
        assert off["measured_state_bytes"] == default["measured_state_bytes"] == str(2 * PSI + 4 * S + 8 * S)
        moved = detail(off)
        moved[REDUCED] = moved.pop(IN_PLACE)
        assert moved == detail(default)
    # one bucket: every gradient, Ψ × 2 B = 177,944 bytes
    assert detail(row(B, 2, {"reduce_scatter": False}, reduce_bucket_size=500_000_000))[IN_PLACE] == [[PSI * 2, 1]]
    # buckets of 20,000: the embedding and the head alone (33,033 each, over the bucket), the other
    # 88,972 − 2·33,033 = 22,906 elements in two
    small = detail(row(B, 2, {"reduce_scatter": False}, reduce_bucket_size=20_000))[IN_PLACE]
    assert sorted(small) == [[6_666, 1], [39_146, 1], [2 * LARGEST, 2]]
    assert 6_666 + 39_146 == 2 * (PSI - 2 * LARGEST)
    assert dskeys.lookup("zero_optimization.reduce_scatter")[:2] == ("not_modelled", True)


def test_use_multi_rank_bucket_allreduce_false_reduces_to_each_owner():
    """With reduce_scatter on and use_multi_rank_bucket_allreduce false, `average_tensor` sends each
    rank's slices of the bucket to it alone (`allreduce_no_retain(rank=dst)` → `dist.reduce`): N reduces
    of Ψ/N elements × 2 B = 88,972 bytes, where the default all-reduces Ψ × 2 B once. reduce_scatter false
    takes the in-place all-reduce before either. Not modelled: a different collective."""
    for stage in (1, 2):
        reduce = detail(row(B, stage, {"use_multi_rank_bucket_allreduce": False}))
        assert reduce["reduce | [Caller Func: allreduce_bucket]"] == [[S * 2, 2]] and REDUCED not in reduce
        both = detail(row(B, stage, {"reduce_scatter": False, "use_multi_rank_bucket_allreduce": False}))
        assert both[IN_PLACE] == [[PSI * 2, 1]]
        for extra in ({"use_multi_rank_bucket_allreduce": False}, {"reduce_scatter": False,
                                                                   "use_multi_rank_bucket_allreduce": False}):
            assert row(B, stage, extra)["measured_state_bytes"] == str(2 * PSI + 4 * S + 8 * S)
    assert dskeys.lookup("zero_optimization.use_multi_rank_bucket_allreduce")[:2] == ("not_modelled", True)


def test_allgather_partitions_false_changes_nothing(tmp_path):
    """`allgather_partitions` is read into the config (`engine.zero_allgather_partitions`) and never
    passed on: the same state and the same collectives, call sites included, at stages 1 and 2."""
    for stage in (1, 2):
        default = row(B, stage, reduce_bucket_size=500_000_000, grad_accum_dtype="", offload_optimizer="none")
        off = row(B, stage, {"allgather_partitions": False})
        assert off["measured_state_bytes"] == default["measured_state_bytes"]
        assert detail(off) == detail(default)
    assert dskeys.lookup("zero_optimization.allgather_partitions")[0] == "no_effect"
    r = estimate(tmp_path, {"stage": 2, "allgather_partitions": False})
    assert r.exit_code == 0 and "allgather_partitions" not in r.output


def test_offload_pin_memory_false_changes_nothing_on_cpu_ranks():
    """pin_memory false skips `pin_memory()` on the offload's host buffers (stage_1_and_2.py, stage3.py),
    which on CPU ranks returns the tensor itself (cpu_accelerator.py, torch's pinning path): the rows
    cannot show the host difference a GPU's pinned buffers make (host.py's power-of-two `pinned`). The
    device-side state and collectives are the same; the key stays warned about."""
    off = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
    for stage, knobs in ((1, {}), (2, {}), (3, {"param_persistence_threshold": 200})):
        pinned = row(B, stage, offload_optimizer="cpu", grad_accum_dtype="", **knobs)
        pageable = row(B, stage, off, **knobs)
        assert pageable["measured_state_bytes"] == pinned["measured_state_bytes"]
        assert detail(pageable) == detail(pinned)
        assert pageable["measured_host_ds_pinned_bytes"] == pinned["measured_host_ds_pinned_bytes"] == "0"
    assert dskeys.lookup("zero_optimization.offload_optimizer.pin_memory")[:2] == ("not_modelled", True)


def test_a_jobs_extra_keys_join_its_ds_config_at_every_depth():
    """A job's `ds_extra` adds keys inside the worker's blocks: an offload block given only pin_memory
    keeps the job's device (replacing the block would run the job without offload)."""
    from validate import jobs as J
    from validate.worker import ds_config
    from zerocalc import arch
    job = J.to_worker(J.make_job(arch.Architecture("seed-gpt", 1001, 33, 2, 3, 3, 101, False, 16), 2, stage=3,
                                 seq_len=16, offload_optimizer="cpu", offload_param="cpu"))
    extra = {"zero_optimization": {"offload_optimizer": {"pin_memory": False}, "offload_param": {"pin_memory": False},
                                   "reduce_scatter": False}, "wall_clock_breakdown": True}
    zero = ds_config({**job, "ds_extra": extra})
    assert zero["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert zero["zero_optimization"]["offload_param"]["pin_memory"] is False
    assert zero["zero_optimization"]["reduce_scatter"] is False and zero["wall_clock_breakdown"] is True
    assert zero["zero_optimization"]["stage"] == 3 and "pin_memory" not in ds_config(job)["zero_optimization"]["offload_optimizer"]


def test_stage_2_offload_to_nvme_is_offload_to_host_memory():
    """stage_1_and_2.py takes any offload device but "none" as CPU offload: on 2 gloo ranks (seed-gpt h33,
    Ψ = 88,972, S = Ψ/2 = 44,486) the nvme job holds and sends what the cpu job does, 2Ψ bf16 parameters
    + 4S fp32 master + 8S moments + 4S fp32 gradient slice on the host + 2S bf16 upload buffer + two
    staging buffers of the largest tensor (2 × 66,066) = 1,110,824 B. zerocalc answers the same host
    memory for both, none of it on disk, and says so."""
    with open(os.path.join(DATA, "cpu-nvme-s2.csv")) as f:
        cpu, nvme = sorted(csv.DictReader(f), key=lambda r: r["offload_optimizer"])
    assert (cpu["offload_optimizer"], nvme["offload_optimizer"]) == ("cpu", "nvme")
    expected = 2 * 88_972 + (4 + 8 + 4 + 2) * 44_486 + 2 * 66_066
    assert cpu["measured_state_bytes"] == nvme["measured_state_bytes"] == str(expected) == "1110824"
    assert cpu["measured_comm_bytes"] == nvme["measured_comm_bytes"]
    hosts = [json.loads(CliRunner().invoke(main, ["estimate", "--params", "7e9", "--dp", "8", "--stage", "2",
                                                  "--offload-optimizer", d, "--format", "json"]).output)
             ["estimates"][0]["host"] for d in ("cpu", "nvme")]
    assert hosts[0] == hosts[1] and hosts[1]["nvme_bytes"] == 0 and hosts[1]["pinned_bytes"] > 0
    text = CliRunner().invoke(main, ["estimate", "--params", "7e9", "--dp", "8", "--stage", "2", "--offload-optimizer",
                                     "nvme"]).output
    assert "offload: in host memory" in text and "NVMe" not in text
