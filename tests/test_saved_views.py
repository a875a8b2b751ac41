"""Forward's saved views of parameters at stage 3 (`ModelSpec.viewed_params`): transformers runs a fused
experts module's 3-d weights through grouped_mm as `weight.transpose(-2, -1)`, autograd keeps that view
for backward, and DeepSpeed's release (`param.data` emptied) does not reach it, so each layer's gathered
experts stay on the device until its backward. Measured: data/h100-hf-fake-diag-*.csv (data/README.md)."""
import os
from dataclasses import replace

import pytest

from zerocalc import resolve, stage3_trace
from zerocalc.estimate import estimate
from zerocalc.training import Setup, Stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_views(spec):
    p = spec.profile
    return replace(spec, profile=replace(p, modules=tuple(m._replace(views=False) for m in p.modules)))


def test_the_shipped_profiles_mark_the_fused_experts_whose_views_forward_keeps():
    qwen = resolve.preset_spec("qwen1.5-moe-a2.7b", {})
    assert [m.name for m in qwen.profile.modules if m.views] == [f"model.layers.{i}.mlp.experts" for i in range(24)]
    assert len(qwen.viewed_params(False)) == 48          # gate_up_proj and down_proj of each layer
    assert qwen.viewed_params(True) == frozenset()       # a checkpointed layer's forward saves nothing
    # GPT-OSS keeps its experts transposed ([E, h, 2i]): grouped_mm takes the parameter itself, which the
    # release empties; nn.Linear runs through DeepSpeed's linear, which saves the parameter too
    for name in ("gpt-oss-20b", "llama-3.1-8b", "qwen2.5-7b"):
        assert not any(m.views for m in resolve.preset_spec(name, {}).profile.modules), name


def test_stage3_holds_every_released_layers_gathered_experts_until_backward():
    """Qwen1.5-MoE-A2.7B at rank 0 of 8, stage 3, 1 x 2048, not checkpointed (the H100 rows' job). A
    layer's experts: gate_up_proj 60 x 2816 x 2048 = 346,030,080 and down_proj 60 x 2048 x 1408 =
    173,015,040 elements, each a multiple of 8 (no padding), bf16: 1,038,090,240 B gathered. DeepSpeed's
    reuse rule keeps the last layer's gathered anyway (its backward comes within max_reuse_distance 1e9
    elements: the head's 311,164,928 twice), so 23 layers' are held beyond what it kept:
    23 x 1,038,090,240 = 23,876,075,520 B at the end of forward."""
    spec = resolve.preset_spec("qwen1.5-moe-a2.7b", {})
    setup = Setup(stage=Stage.PARAMETERS, dp=8, micro_batch=1, seq_len=2048)
    held = 23 * 2 * (60 * 2816 * 2048 + 60 * 2048 * 1408)
    assert held == 23_876_075_520
    assert 2 * stage3_trace.held_after_forward_elements(spec, setup) == held
    with_views, without = estimate(spec, setup), estimate(_without_views(spec), setup)
    assert with_views.phases[1].total_bytes - without.phases[1].total_bytes == held      # forward's phase
    # the replayed peak, at backward's start, rises by them (and a router's 245,760 B gathered at that moment)
    assert with_views.peak_bytes - without.peak_bytes == pytest.approx(held, rel=1e-4)
    # none at N = 1 (a parameter is a view of its partition) or checkpointed
    for other in (replace(setup, dp=1), replace(setup, activation_checkpointing=True)):
        assert stage3_trace.held_after_forward_elements(spec, other) == 0
        assert estimate(spec, other).peak_bytes == estimate(_without_views(spec), other).peak_bytes


def test_the_h100_rows_of_the_held_experts():
    """The uncapped rows of the card job zerocalc had said fits (data/h100-hf-fake-diag-*.csv, rank 0 of 8):
    the whole model built on the GPU and under zero.Init, and a 4-layer cut built on the GPU and on the
    host, and Qwen3-1.7B's stage-2 row (GAS 2, 4 x 2048): allocated within 3% and reserved within 8% of
    the trace's prediction for the rank each ran as (rank 0: `estimate` answers the busiest rank, rank 1 at
    stage 2, which reserves 10.1% more; tests/test_fake_ranks.py)."""
    pytest.importorskip("torch")
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.report import load
    from validate.rows import job_from_row
    rows = load([os.path.join(ROOT, "data", f"h100-hf-fake-diag-{n}-n8.csv") for n in ("moe", "moe-b", "qwen3")])
    assert len(rows) == 5 and (rows["outcome"] == "ok").all()
    for _, r in rows.iterrows():
        job = job_from_row(r.to_dict())
        e = estimate(hf_models.traced_spec(job), to_zerocalc(job)[1], ranks=(0,))
        alloc = e.peak_bytes / float(r["measured_peak_allocated_bytes"]) - 1
        reserved = e.peak_reserved_bytes / float(r["measured_peak_reserved_bytes"]) - 1
        assert abs(alloc) <= 0.03 and abs(reserved) <= 0.08, (r["key"], alloc, reserved)


def test_the_held_out_moe_rows():
    """Predicted before they ran (validate/matrices/h100-views-predicted.json; data/h100-hf-fake-views-*.csv,
    rank 0 of 8 and 16 on an H100): Mixtral (6 layers) and OLMoE-1B-7B with their experts held,
    Granite-MoE's `ParallelExperts`, Qwen1.5-MoE checkpointed and GPT-OSS (12 layers, transposed experts)
    with none: allocated within 3% on each, reserved within 8% but GPT-OSS's (eager attention: -13.4%, open)."""
    pytest.importorskip("torch")
    import json
    from validate import hf_models
    from validate.jobs import to_zerocalc
    from validate.report import load
    from validate.rows import job_from_row
    with open(os.path.join(ROOT, "validate", "matrices", "h100-views-predicted.json")) as f:
        before = {v["config"]: v for v in json.load(f).values() if v["matrix"] != "h100-views-n16.json"
                  or v["config"] != "gpt-oss-20b"}     # the SDPA job transformers refused on the GPU
    rows = load([os.path.join(ROOT, "data", f"h100-hf-fake-views-{n}.csv") for n in ("n8", "n16", "gptoss-n16")])
    rows = rows[rows["outcome"] == "ok"]
    names = []
    for _, r in rows.iterrows():
        job = job_from_row(r.to_dict())
        name = job["hf"]["name"]
        names.append(name)
        e = estimate(hf_models.traced_spec(job), to_zerocalc(job)[1])
        # GPT-OSS's reserved (eager attention) is open: -13.4% with its MoE blocks as stage-3 leaves, -14.8%
        # as the run fetched them (no leaves: `z3_leaf_modules`), where its allocated is -0.0% (was +1.6%):
        # the GPU's timing, below (`test_gpt_oss_reserved_is_the_gpus_timing_not_the_stream`)
        bound = 0.15 if name == "gpt-oss-20b" else 0.08
        # the answer before the run, and today's
        for allocated, reserved in ((before[name]["peak_allocated_bytes"], before[name]["peak_reserved_bytes"]),
                                    (e.peak_bytes, e.peak_reserved_bytes)):
            alloc_err = allocated / float(r["measured_peak_allocated_bytes"]) - 1
            reserved_err = reserved / float(r["measured_peak_reserved_bytes"]) - 1
            assert abs(alloc_err) <= 0.03 and abs(reserved_err) <= bound, (name, alloc_err, reserved_err)
    assert sorted(names) == ["gpt-oss-20b", "granite-3.0-1b-a400m", "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"]


def test_gpt_oss_reserved_is_the_gpus_timing_not_the_stream():
    """GPT-OSS-20B cut to 12 layers at N = 16, eager, the held-out row open above, with its H100 history
    (data/snapshots/views-gptoss/): its own allocations replayed with each free taken where the GPU
    completed it give the measurement, 47,211,085,824 B (43.97 GiB); with each taken where it was
    requested, as zerocalc generates a job, 41,064,333,312 B (38.24), zerocalc's reserved within 2 MiB
    (one small segment) and its allocated within 0.01%. The whole miss is how far the GPU ran behind the
    host: blocks of 100 MB and more that another stream used (gathered experts, gradients reduced on
    the reduction stream) became free up to 239 allocations after their free (327 of them late)."""
    pytest.importorskip("torch")
    from validate import hf_models, snapshot
    from validate.jobs import to_zerocalc
    from validate.report import load
    from validate.rows import job_from_row
    from zerocalc import allocator
    row = load([os.path.join(ROOT, "data", "h100-hf-fake-views-gptoss-hist-n16.csv")]).iloc[-1]
    snap = snapshot.load(os.path.join(ROOT, "data", "snapshots", "views-gptoss", row["key"] + ".json.gz"))
    trace = snap["device_traces"][0]

    def replayed(on_request):
        return allocator.replay(snapshot.allocator_events(trace, on_request), snapshot.start_segments(snap),
                                segment_addresses=snapshot.segment_addresses(trace))
    assert replayed(False).peak_reserved_bytes == int(row["measured_peak_reserved_bytes"]) == 47_211_085_824
    on_time = replayed(True)
    assert on_time.peak_reserved_bytes == 41_064_333_312
    assert on_time.peak_allocated_bytes == int(row["measured_peak_allocated_bytes"])
    job = job_from_row(row.to_dict())
    e = estimate(hf_models.traced_spec(job), to_zerocalc(job)[1], ranks=(0,))
    assert abs(e.peak_reserved_bytes - on_time.peak_reserved_bytes) <= 2 << 20
    assert abs(e.peak_bytes / on_time.peak_allocated_bytes - 1) < 1e-4


def test_estimate_says_what_the_views_hold():
    """The note names the modules and the bytes (23 x 1,038,090,240 B = 22.24 GiB for Qwen1.5-MoE-A2.7B at
    N = 8, above), and is not there where nothing is held: checkpointed, or at N = 1."""
    from click.testing import CliRunner
    from zerocalc.cli import main
    args = ["estimate", "--model", "qwen1.5-moe-a2.7b", "--stage", "3", "--seq-len", "2048"]
    out = CliRunner().invoke(main, args + ["--dp", "8"]).output
    assert ("autograd keeps views of each Qwen2MoeExperts's gathered parameters for backward, which "
            "DeepSpeed's release cannot free: up to 22.2 GiB held until backward") in out
    for more in (["--dp", "8", "--activation-checkpointing"], ["--dp", "1"]):
        result = CliRunner().invoke(main, args + more)
        assert result.exit_code == 0 and "autograd keeps views" not in result.output, more
