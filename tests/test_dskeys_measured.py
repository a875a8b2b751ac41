"""ds_config keys zerocalc classifies from real DeepSpeed 0.19.8 jobs, each run beside the same job without
the key on gloo CPU ranks (a job's `ds_extra`, validate/jobs.py). The rows and the commands that made them:
tests/data/cpu-dskeys.csv (2 ranks, validate/matrices/cpu-dskeys.json) and cpu-dskeys-n4.csv (4 ranks,
validate/matrices/cpu-dskeys-n4.json), both `VALIDATE_FEW_STEPS=1 python -m validate run --backend cpu ...`.

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

from zerocalc import comm, dskeys
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
    does not ask; with CPU offload it runs the ZeRO optimizer again (from the source, not measured here)."""
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
