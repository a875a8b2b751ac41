"""Step time worked by hand with chosen constants; `zerocalc plan` against `zerocalc estimate`."""
import json

import pytest
from click.testing import CliRunner

from zerocalc import arch as A
from zerocalc.cli import main
from zerocalc.estimate import estimate
from zerocalc.hardware import gpu
from zerocalc.model import from_architecture
from zerocalc.plan import gpu_counts
from zerocalc.training import Setup, Stage

CAL = {"activations": {"hf-llama": {"h": 10, "kv": 2, "f": 4}},
       "time": {"efficiency": 0.5, "launch_s_per_layer": 0.0, "module_hook_s": 0.0,
                "optimizer_s_per_element": 1e-12, "step_overhead_s": 0.01, "link_efficiency": 1.0}}


def test_step_time_by_hand():
    a = A.Architecture("hf-llama", 32000, 4096, 32, 32, 32, 11008, False)
    spec = from_architecture(a)
    p = spec.num_params                                    # 6,738,415,616
    s = Setup(stage=Stage.DISABLED, dp=1, micro_batch=2, seq_len=2048, dtype="bf16")
    t = estimate(spec, s, cal=CAL, hardware=gpu("h100")).time
    tokens = 2 * 2048
    flops = 6 * p * tokens + 12 * 32 * 4096 * 2048 * tokens          # 6PT + attention 12·L·h·s·T
    assert t.compute_s == pytest.approx(flops / (0.5 * 989e12))
    assert t.optimizer_s == pytest.approx(1e-12 * p + 0.01)         # stage 0: every element on this rank
    assert t.comm_s == 0 and t.step_s == pytest.approx(t.compute_s + t.optimizer_s)
    assert t.tokens_per_s == pytest.approx(tokens / t.step_s)
    assert t.mfu == pytest.approx(6 * p * tokens / (t.step_s * 989e12))


def test_stage_2_communication_is_exposed_and_costs_wire_over_bandwidth():
    spec = from_architecture(A.preset("llama-2-7b"))
    s = Setup(stage=Stage.GRADIENTS, dp=8, micro_batch=1, seq_len=1024)
    e = estimate(spec, s, cal=CAL, hardware=gpu("h100"))
    wire = sum(c.wire_bytes for c in e.collectives)
    calls = sum(c.calls for c in e.collectives)
    assert e.time.comm_s == pytest.approx(wire / 450e9 + calls * 20e-6)
    assert e.time.exposed_comm_s == e.time.comm_s                    # overlap_comm is off at stage 2
    assert e.time.comm_share == pytest.approx(e.time.comm_s / e.time.step_s)


def test_no_time_without_an_architecture():
    from zerocalc.model import from_params
    assert estimate(from_params(10**9), Setup(seq_len=1024), hardware=gpu("h100")).time is None


def test_gpu_counts_are_powers_of_two_then_whole_nodes():
    assert gpu_counts(1, 64, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert gpu_counts(1, 16, 4) == [1, 2, 4, 8, 16]
    assert gpu_counts(1, 6, 8) == [1, 2, 4]


def plan(*args, model="llama-2-13b", code=0):
    r = CliRunner().invoke(main, ["plan", "--model", model, "--gpu", "h100", "--gpu-memory", "80GiB",
                                  "--seq-len", "4096", "--global-batch", "256", "--format", "json", *args])
    assert r.exit_code == code, r.output
    return json.loads(r.output)


def test_plan_ranks_fitting_setups_by_throughput():
    doc = plan("--max-gpus", "16", "--top", "50")
    speeds = [c["time"]["tokens_per_s"] for c in doc["ranked"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 5
    assert all(c["rejected"] is None and c["device_bytes"] <= 80 * 2**30 for c in doc["ranked"])
    assert all(c["micro_batch"] * c["gas"] * c["dp"] == 256 for c in doc["ranked"])


def test_explain_lists_why_setups_were_rejected():
    doc = plan("--max-gpus", "8", "--explain")
    reasons = [c["rejected"] for c in doc["rejected"]]
    assert any("needs" in r and "GiB per GPU" in r for r in reasons)


def test_min_gpus_agrees_with_estimate():
    best = plan("--max-gpus", "64", "--min-gpus", model="llama-2-70b")["ranked"][0]
    assert best["dp"] > 1
    args = ["estimate", "--model", "llama-2-70b", "--dp", str(best["dp"]), "--stage", str(best["stage"]),
            "--micro-batch", str(best["micro_batch"]), "--gas", str(best["gas"]), "--seq-len", "4096",
            "--offload-optimizer", best["offload_optimizer"], "--gpu", "h100", "--gpu-memory", "80GiB",
            "--attention", "sdpa", "--format", "json"]
    if best["stage"] == 3:
        args += ["--offload-param", best["offload_param"]]
    args.append("--activation-checkpointing" if best["activation_checkpointing"] else "--no-activation-checkpointing")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    e = json.loads(r.output)["estimates"][0]
    assert e["fits"] is True
    assert e["device_bytes"] == best["device_bytes"]
    assert e["time"]["step_s"] == pytest.approx(best["time"]["step_s"])
    # and with half the GPUs nothing fits
    assert plan("--max-gpus", str(best["dp"] // 2), "--min-gpus", model="llama-2-70b", code=1)["ranked"] == []


def test_plan_with_nothing_that_fits_exits_1():
    r = CliRunner().invoke(main, ["plan", "--model", "llama-2-70b", "--gpu", "h100", "--gpu-memory", "8GiB",
                                  "--max-gpus", "2", "--seq-len", "4096", "--global-batch", "8"])
    assert r.exit_code == 1 and "Nothing fits" in r.output
