"""zerocalc.host: the host peak per rank, worked out by hand term by term for small configurations, and
`estimate`/`plan` reporting a configuration that overflows the host as not fitting, host named."""
import json

from click.testing import CliRunner

from zerocalc import host
from zerocalc.cli import main
from zerocalc.estimate import estimate
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage

# The runtime every event carries: the process before the build, and (from initialize on) its growth.
BASE = host.BASELINE_BYTES
GROWTH = host.RUNTIME_GROWTH_BYTES


def two_tensors(a, b):
    """A model of two parameter tensors of a and b elements, no architecture (no transformers, no tie)."""
    return ModelSpec("two tensors", (a, b), ((0,), (1,)))


def test_pinned_blocks_round_up_to_a_power_of_two():
    assert host.pinned(0) == 0
    assert host.pinned(1) == 1
    assert host.pinned(4096) == 4096
    assert host.pinned(4097) == 8192
    assert host.pinned(3 * 2**30) == 4 * 2**30


def test_stage_2_optimizer_offload_term_by_term():
    # P = 4000 (1000 + 3000), N = 1, bf16 (b = 2), AdamW (K = 8). Pp = ⌈4000 / 2⌉·2 = 4000, S = 4000.
    h = host.host_memory(two_tensors(1000, 3000), Setup(stage=Stage.GRADIENTS, dp=1, offload_optimizer="cpu"))
    build, cast, master, bit16, grads, first = h.events
    assert build.bytes == BASE + 4 * 4000                            # fp32 model 16,000
    assert cast.bytes == BASE + GROWTH + 16_000 + 2 * 3000           # + the largest tensor's bf16 copy
    assert master.bytes == BASE + GROWTH + 16_000 + 16_384           # 4S pageable + pinned(16,000)
    assert bit16.bytes == BASE + GROWTH + 16_384 + 8_000 + 8_192     # master + 2S pageable + pinned(8,000)
    # master 16,384 + bit16 8,192 + staging pinned(2·3000) 8,192, then 4S pageable + pinned(16,000)
    assert grads.bytes == BASE + GROWTH + 16_384 + 8_192 + 8_192 + 16_000 + 16_384
    # held: 16,384 + 8,192 + 8,192 + 16,384 = 49,152 pinned; Adam's moments 8·4000 = 32,000
    assert first.bytes == BASE + GROWTH + 49_152 + 32_000
    assert h.pinned_bytes == 49_152
    assert h.peak_bytes == first.bytes and h.peak_phase == "first_step"


def test_stage_3_optimizer_and_parameter_offload_at_two_ranks():
    # nᵢ = 1000, 3001 at N = 2: partitions 500 and 1501, S3 = 2001; one sub-group (sub_group_size 1e9).
    h = host.host_memory(two_tensors(1000, 3001), Setup(stage=Stage.PARAMETERS, dp=2, offload_optimizer="cpu",
                                                        offload_param="cpu"))
    per_param = 1024 + 4096            # pinned(2·500 = 1000) + pinned(2·1501 = 3002)
    flat = 4096                        # pinned(2·2001 = 4002)
    master = 4 * 2001                  # 8,004 pageable
    grads = 8192                       # pinned(4·2001 = 8004)
    grad_partitions = 4096             # pinned(2·2001 = 4002)
    moments = 8 * 2001                 # 16,008
    by_what = {e.what.split(" (")[0]: e.bytes for e in h.events}
    assert by_what["parameter partitions pinned, then their flat buffer"] == BASE + GROWTH + per_param + flat
    # .to(cpu, fp32) and its clone: 2 × 8,004
    assert by_what["fp32 master of sub-group 0: .to(cpu, fp32) and its clone"] == \
        BASE + GROWTH + per_param + flat + 2 * master
    # the unused 4·max S3_j buffer, the sub-group's pinned gradient and its pageable source
    assert by_what["fp32 gradient of sub-group 0 pinned"] == BASE + GROWTH + per_param + flat + master + \
        master + grads + master
    assert h.events[-1].bytes == BASE + GROWTH + per_param + flat + master + grads + grad_partitions + moments
    assert h.pinned_bytes == per_param + flat + grads + grad_partitions
    assert h.peak_bytes == BASE + GROWTH + 45_516


def test_stage_3_with_partitions_on_the_gpu_converts_the_master_on_the_cpu_at_the_first_step():
    # N = 1, optimizer offload only: S3 = 4000; the step's fp32 -> bf16 copy makes 2·4000 on the host.
    h = host.host_memory(two_tensors(1000, 3000), Setup(stage=Stage.PARAMETERS, dp=1, offload_optimizer="cpu"))
    held = 16_000 + 16_384 + 8_192     # master 4·S3 pageable, pinned(4·S3), pinned(2·S3) gradient partitions
    assert h.peak_bytes == BASE + GROWTH + held + 32_000 + 8_000
    assert h.steady_bytes == BASE + GROWTH + held + 32_000


def test_the_host_answer_is_kept_per_host_setup_and_equals_the_full_setups():
    """host_memory reads its setup through `_host_key` and keeps the answer: for every stage, offload,
    N, dtype and accumulation count the kept answer equals the same body run on the whole setup, micro-batch,
    sequence length and checkpointing included (so a field the body reads and the projection drops fails
    here), and setups that differ only in those share one answer."""
    from itertools import product
    model = ModelSpec("three tensors", (1000, 3001, 2000), ((0,), (1,), (2,)))
    for stage, (opt, par), n, dtype, gas, zero_init in product(
            Stage, [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")], (1, 2, 3),
            ("bf16", "fp32"), (1, 2, 5), (False, True)):
        if (opt != "none" and stage == Stage.DISABLED) or (par != "none" and stage != Stage.PARAMETERS):
            continue
        setups = [Setup(stage=stage, dp=n, dtype=dtype, gas=gas, offload_optimizer=opt, offload_param=par,
                        zero_init=zero_init, sub_group_size=1500, micro_batch=micro, seq_len=seq,
                        activation_checkpointing=ckpt)
                  for micro, seq, ckpt in ((1, None, False), (4, 512, True))]
        answers = [host.host_memory(model, s) for s in setups]
        assert answers[0] is answers[1]
        assert answers[0] == host.host_bytes(model, setups[1], BASE, GROWTH)


def test_the_node_holds_its_ranks():
    e = estimate(two_tensors(1000, 3000), Setup(stage=Stage.GRADIENTS, dp=8, offload_optimizer="cpu"),
                 host_memory_bytes=2**40, ranks_per_node=4)
    assert e.host_node_bytes == 4 * e.host.peak_bytes


def test_estimate_puts_a_named_gpus_preset_node_on_each_host():
    """`estimate --dp 64 --gpu h100`: 64 ranks on H100 hosts of 8 (the preset's node, as `plan` and the
    step time's inter-node test take it), so a host holds 8 ranks, not 64; --nodes/--gpus-per-node say
    otherwise when given; without a GPU nothing names a node, and all N share one host as before."""
    base = ["estimate", "--params", "7e9", "--stage", "3", "--offload-optimizer", "cpu", "--format", "json"]
    ranks = lambda args: json.loads(_fits(base + args))["estimates"][0]["host"]["ranks_per_node"]  # noqa: E731
    assert ranks(["--dp", "64", "--gpu", "h100"]) == 8
    assert ranks(["--dp", "4", "--gpu", "h100"]) == 4
    assert ranks(["--nodes", "2", "--gpus-per-node", "32", "--gpu", "h100"]) == 32
    assert ranks(["--dp", "64"]) == 64
    d = json.loads(_fits(base + ["--dp", "64", "--gpu", "h100"]))["estimates"][0]
    assert d["host"]["node_bytes"] == 8 * d["host"]["peak_bytes"]


def _fits(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return r.output


def test_estimate_names_the_host_when_only_the_host_is_too_small():
    # A 7B Llama at stage 3 with both offloads on one H200 (141 GiB): the GPU holds it; the model says the
    # host needs ~154 GiB (the first step: 4P master, 8P moments, pinned partitions and gradients).
    args = ["estimate", "--model", "llama-2-7b", "--stage", "3", "--dp", "1", "--offload-optimizer", "cpu",
            "--offload-param", "cpu", "--seq-len", "2048", "--gpu-memory", "141GiB"]
    d = json.loads(_fits(args + ["--host-memory", "125GiB", "--format", "json"]))["estimates"][0]
    assert d["fits_device"] is True and d["fits_host"] is False and d["fits"] is False
    assert d["fails_on"] == ["host"]
    assert d["host"]["node_bytes"] > 125 * 2**30
    assert "NO (host)" in _fits(args + ["--host-memory", "125GiB"])
    assert json.loads(_fits(args + ["--host-memory", "1TiB", "--format", "json"]))["estimates"][0]["fits"] is True


def test_plan_rejects_a_host_overflow_and_explains_it():
    args = ["plan", "--model", "llama-2-7b", "--gpu", "h200", "--seq-len", "2048", "--global-batch", "8",
            "--max-gpus", "1", "--explain"]
    small = _fits(args + ["--host-memory", "100GiB"])
    offload_lines = [ln for ln in small.splitlines() if "offload cpu/" in ln and "not a multiple" not in ln]
    assert offload_lines and all("of host memory per node" in ln for ln in offload_lines)
    doc = json.loads(_fits(args + ["--host-memory", "100GiB", "--format", "json"]))
    assert all(c["offload_optimizer"] == "none" for c in doc["ranked"])
    big = json.loads(_fits(args + ["--host-memory", "1TiB", "--format", "json"]))
    assert not any("host memory" in (c["rejected"] or "") for c in big["rejected"])


def test_a_preset_host_memory_is_printed_as_an_assumption():
    out = _fits(["estimate", "--params", "1e9", "--dp", "1", "--stage", "2", "--gpu", "h200"])
    assert "assumed" in out and "--host-memory" in out


def test_committed_h200_rows_within_ten_percent_and_pinned_as_modelled():
    """The 24 H200 offload rows (data/h200-host-*.csv): the host peak per rank within 10% of VmHWM on every
    row (docs/host-memory.md: worst 2.6% after the baseline was measured and one growth constant fitted on
    them), and torch's pinned bytes equal to the modelled power-of-two blocks within 16 MiB."""
    import glob
    import os
    from validate.host_report import host_rows
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = host_rows(sorted(glob.glob(os.path.join(root, "data", "h200-host-*.csv"))))
    assert len(rows) >= 20
    assert {r["row"]["family"] for r in rows} >= {"seed-gpt", "hf-gpt2", "hf-llama"}
    assert {r["row"]["stage"] for r in rows} == {"1", "2", "3"}
    assert any(r["row"]["offload_param"] == "cpu" for r in rows)
    for r in rows:
        assert abs(r["predicted"] - r["measured"]) <= 0.10 * r["measured"], r["row"]["key"]
        assert abs(r["predicted_pinned"] - r["pinned"]) <= 16 * 2**20, r["row"]["key"]
