"""`zerocalc estimate` through click's CliRunner: output, the JSON contract, and bad input."""
import json

import pytest
from click.testing import CliRunner

from zerocalc.cli import main


def run(*args):
    return CliRunner().invoke(main, ["estimate", *args])


def test_main_job_prints_all_four_stages():
    r = run("--params", "7e9", "--dp", "8")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("-----"))) + 1:]
    rows = [ln.split() for ln in table if ln.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert "P = 7,000,000,000" in r.output


def test_json_follows_the_contract():
    r = run("--params", "7e9", "--dp", "8", "--format", "json", "--gpu-memory", "80GiB")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert isinstance(doc["zerocalc_version"], str) and doc["inputs"]["num_params"] == 7 * 10**9
    for e in doc["estimates"]:
        assert set(e["per_rank_bytes"]) >= {"params", "gradients", "optimizer_states", "buffers", "activations", "total"}
        assert all(isinstance(e["per_rank_bytes"][k], int) for k in ("params", "gradients", "optimizer_states",
                                                                      "buffers", "total"))
        assert e["per_rank_bytes"]["activations"] is None          # no architecture given
        assert isinstance(e["peak_bytes"], int) and isinstance(e["cpu_bytes"], int)
        assert isinstance(e["fits"], bool)
        c = e["comm"]
        assert isinstance(c["bytes_per_rank_per_step"], int) and isinstance(c["volume_over_params"], float)
        assert sum(x["bytes"] for x in c["collectives"]) == c["bytes_per_rank_per_step"]
        assert all(set(x) >= {"op", "calls", "elements", "bytes"} for x in c["collectives"])
        assert e["offload_optimizer"] == "none" and e["offload_param"] == "none"


def test_json_stage_2_bf16_numbers_by_hand():
    # P = 7e9 in 100 tensors of 7e7, N = 8: Pp = 7e9 (a multiple of 16), S = 8.75e8
    doc = json.loads(run("--params", "7e9", "--dp", "8", "--stage", "2", "--format", "json").output)
    e = doc["estimates"][0]
    assert e["per_rank_bytes"]["params"] == 2 * 7 * 10**9                 # bf16, all of P
    assert e["per_rank_bytes"]["optimizer_states"] == 12 * 875_000_000   # fp32 master + Adam, one shard
    assert e["resident_state_bytes"] == 2 * 7 * 10**9 + 12 * 875_000_000
    # all_reduce 2P + all_gather 2S + norm 4 B + overflow 1 B
    assert e["comm"]["bytes_per_rank_per_step"] == 2 * 7 * 10**9 + 2 * 875_000_000 + 5
    # ring wire volume: 2·7/8 (all-reduce) + 7/8 (all-gather) = 2.625 × P·2 bytes, plus the tiny ones
    assert e["comm"]["volume_over_params"] == pytest.approx(2.625, abs=1e-6)


def test_csv_has_one_row_per_stage():
    r = run("--params", "1e9", "--dp", "4", "--format", "csv")
    assert r.exit_code == 0
    assert len(r.output.strip().splitlines()) == 5


def test_gpu_memory_decides_fits():
    small = json.loads(run("--params", "7e9", "--dp", "8", "--gpu-memory", "1GiB", "--format", "json").output)
    assert [e["fits"] for e in small["estimates"]] == [False] * 4
    huge = json.loads(run("--params", "7e9", "--dp", "8", "--gpu-memory", "10TiB", "--format", "json").output)
    assert [e["fits"] for e in huge["estimates"]] == [True] * 4


def test_tight_when_only_the_expected_allocator_overhead_fits():
    # Stage 3 of the chapter's 7B/8-GPU example: memory between the expected device bytes (fitted
    # reserved ratio) and the worst measured ratio is "tight": fits, but can OOM.
    e = json.loads(run("--params", "7e9", "--dp", "8", "--dtype", "fp16", "--stage", "3", "--format", "json").output)
    e = e["estimates"][0]
    context = e["device_bytes"] - e["peak_reserved_bytes"]
    assert e["peak_reserved_worst_bytes"] > e["peak_reserved_bytes"] > e["peak_bytes"]
    middle = (e["device_bytes"] + e["peak_reserved_worst_bytes"] + context) // 2
    args = ("--params", "7e9", "--dp", "8", "--dtype", "fp16", "--stage", "3", "--gpu-memory", str(middle))
    tight = json.loads(run(*args, "--format", "json").output)["estimates"][0]
    assert tight["fits"] is True and tight["fits_worst_case"] is False
    text = run(*args).output
    row = next(ln for ln in text.splitlines() if ln.split()[:1] == ["3"])   # the stage-3 row of the table
    assert row.split()[-1] == "tight"
    assert "tight: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text    # the mitigation is named
    assert "tight: PYTORCH" not in run(*args, "--gpu-memory", "10TiB").output   # not when nothing is tight


# A 4-layer Llama at stage 3 on 2 ranks, 512 tokens: its allocation sequence is simulated (milliseconds).
TINY_STAGE3 = ("--vocab-size", "32000", "--hidden-size", "1024", "--num-layers", "4", "--num-heads", "8", "--dp", "2",
               "--seq-len", "512", "--stage", "3")
MiB = 2**20


def _tiny(gpu_memory_bytes):
    r = run(*TINY_STAGE3, "--gpu-memory", str(gpu_memory_bytes), "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["estimates"][0]


def _fits_column(gpu_memory_bytes):
    text = run(*TINY_STAGE3, "--gpu-memory", str(gpu_memory_bytes)).output
    row = next(ln for ln in text.splitlines() if ln.split()[:1] == ["3"])
    return row.split(maxsplit=15)[-1], text


def test_fits_is_the_allocators_verdict_on_the_card_retries_included():
    # A card holding the unbounded replay's reserved: no cudaMalloc fails, nothing is replayed; the
    # headroom is the card less reserved and context, a lower bound.
    free = _tiny(2**40)
    context = free["device_bytes"] - free["peak_reserved_bytes"]
    reserved = free["peak_reserved_bytes"]
    assert free["fits_source"] == "allocator" and free["fits"] is True
    assert free["alloc_retries"] == 0 and free["oom"] is None and free["headroom_is_lower_bound"] is True
    assert free["headroom_bytes"] == 2**40 - free["device_bytes"]
    assert free["device_capacity_bytes"] == 2**40 - context
    # 2 MiB less: the unbounded reserved no longer fits, so the sequence is replayed against the card;
    # the allocator frees its cached segments and retries, and the job runs: fits, tight, with retries.
    short = _tiny(context + reserved - 2 * MiB)
    assert short["fits"] is True and short["fits_worst_case"] is False and short["oom"] is None
    assert short["alloc_retries"] > 0 and short["headroom_is_lower_bound"] is False
    # The headroom says how much less still runs: the card at exactly that runs (headroom 0), 2 MiB
    # (one step of the grid) less does not, and says where it ran out.
    need = short["device_capacity_bytes"] - short["headroom_bytes"]
    assert free["peak_bytes"] <= need < reserved
    at, below = _tiny(context + need), _tiny(context + need - 2 * MiB)
    assert at["fits"] is True and at["headroom_bytes"] == 0
    assert below["fits"] is False and below["headroom_bytes"] == -2 * MiB and below["fits_worst_case"] is False
    if need > free["peak_bytes"]:                 # the allocator, not the allocated peak, is what is short
        assert below["oom"]["reserved_bytes"] + below["oom"]["segment_bytes"] > below["device_capacity_bytes"]
        assert below["oom"]["phase"] == "init" or below["oom"]["phase"].startswith("step ")
    # The table says so: tight where it runs only thanks to the retries, NO (GPU) where it does not,
    # and its note says how fits was decided.
    fits, text = _fits_column(context + reserved - 2 * MiB)
    assert fits == "tight" and "the allocator freeing its cached segments" in text
    assert _fits_column(context + need - 2 * MiB)[0] == "NO (GPU)"
    assert "the allocator freeing its cached segments" not in _fits_column(2**40)[1]   # no replay: the old rule


def test_a_card_far_too_small_says_no_with_the_oom_point_and_how_far_short():
    # Half the unbounded reserved: the replay runs out; the headroom is negative, at least as short as
    # the live requests are (they alone need more than the capacity).
    free = _tiny(2**40)
    context = free["device_bytes"] - free["peak_reserved_bytes"]
    e = _tiny(context + free["peak_reserved_bytes"] // 2)
    assert e["fits"] is False and e["fails_on"] == ["GPU"]
    assert e["headroom_bytes"] <= e["device_capacity_bytes"] - e["peak_bytes"] < 0
    oom = e["oom"]
    assert oom["rank"] == 0 and oom["allocated_bytes"] <= oom["reserved_bytes"] <= e["device_capacity_bytes"]
    assert oom["reserved_bytes"] + oom["segment_bytes"] > e["device_capacity_bytes"]


def test_where_the_sequence_is_not_simulated_fits_is_the_ratios_and_says_so():
    e = json.loads(run("--params", "7e9", "--dp", "8", "--stage", "3", "--gpu-memory", "80GiB", "--format",
                       "json").output)["estimates"][0]
    assert e["fits_source"] == "ratio" and e["alloc_retries"] is None and e["oom"] is None
    assert e["headroom_bytes"] == 80 * 2**30 - e["device_bytes"] and e["headroom_is_lower_bound"] is False
    no_card = json.loads(run("--params", "7e9", "--dp", "8", "--stage", "3", "--format", "json").output)["estimates"][0]
    assert no_card["fits_source"] is None and no_card["headroom_bytes"] is None


def test_model_preset_and_overrides():
    r = run("--model", "llama-2-7b", "--dp", "8", "--format", "json")
    assert json.loads(r.output)["inputs"]["num_params"] == 6_738_415_616   # Llama-2-7B's published count
    r = run("--model", "llama-2-7b", "--num-layers", "2", "--dp", "8", "--format", "json")
    # embed 32000·4096 + 2 layers × (4·4096² + 3·4096·11008 + 2·4096) + norm 4096 + lm_head 32000·4096
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert json.loads(r.output)["inputs"]["num_params"] == 2 * 32000 * 4096 + 2 * layer + 4096


def test_ds_config_is_read(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
                               "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                     "offload_optimizer": {"device": "cpu"}}}))
    doc = json.loads(run("--params", "1e9", "--dp", "8", "--ds-config", str(cfg), "--format", "json").output)
    assert doc["inputs"]["dtype"] == "fp16" and doc["inputs"]["gas"] == 2 and doc["inputs"]["micro_batch"] == 4
    assert [e["stage"] for e in doc["estimates"]] == [3]
    assert doc["estimates"][0]["offload_optimizer"] == "cpu"
    assert doc["inputs"]["reduce_bucket_size"] == 1000


def test_hf_auto_values_resolve_from_the_hidden_size(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}))
    r = run("--model", "llama-2-7b", "--dp", "8", "--micro-batch", "1", "--ds-config", str(cfg), "--format", "json")
    inputs = json.loads(r.output)["inputs"]
    assert inputs["reduce_bucket_size"] == 4096 * 4096                 # h²
    assert inputs["prefetch_bucket_size"] == int(0.9 * 4096 * 4096)    # 0.9·h²
    assert inputs["param_persistence_threshold"] == 10 * 4096          # 10·h


def test_trainer_s_auto_gas_is_its_default_of_one_said_in_one_line(tmp_path):
    # HF docs' zero2 "auto" config: Trainer fills gradient_accumulation_steps from its own argument,
    # whose default is 1; the natural command gives the micro-batch only. Communication at stage 2 is
    # per optimizer step, so GAS 1 against GAS 2 is one reduce-scatter round against two.
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "train_batch_size": "auto", "zero_optimization": {"stage": 2}}))
    args = ["--model", "llama-2-7b", "--dp", "8", "--micro-batch", "4", "--ds-config", str(cfg), "--format", "json"]
    r = CliRunner().invoke(main, ["estimate", *args])
    assert r.exit_code == 0, r.output
    assert 'gradient_accumulation_steps "auto" taken as HF Trainer fills it by default: 1' in r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["inputs"]["gas"] == 1 and doc["inputs"]["micro_batch"] == 4
    two = json.loads(run(*args, "--gas", "2").output)
    assert two["inputs"]["gas"] == 2
    one_step = doc["estimates"][0]["comm"]["bytes_per_rank_per_step"]
    assert two["estimates"][0]["comm"]["bytes_per_rank_per_step"] > one_step


@pytest.mark.parametrize("kind, name", [("OneBitAdam", "OneBitAdam"), ("ZeroOneAdam", "ZeroOneAdam"),
                                        ("onebitlamb", "OneBitLamb")])
def test_the_removed_one_bit_optimizers_are_refused_as_deepspeed_refuses_them(tmp_path, kind, name):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": kind},
                               "zero_optimization": {"stage": 2}}))
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "2", "--ds-config", str(cfg)])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert f"optimizer.type = \"{kind}\": DeepSpeed 0.19.8's engine has no {name}" in r.output


@pytest.mark.parametrize("zero, top, named", [
    ({"stage": 3, "zero_hpz_partition_size": 8}, {}, "zero_optimization.zero_hpz_partition_size = 8"),
    ({"stage": 3, "zero_quantized_weights": True}, {}, "zero_optimization.zero_quantized_weights = true"),
    ({"stage": 3, "zero_quantized_gradients": True}, {}, "zero_optimization.zero_quantized_gradients = true"),
    ({"stage": 3, "stage3_module_granularity_threshold": 100}, {},
     "zero_optimization.stage3_module_granularity_threshold = 100"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu", "buffer_count": 8}}, {},
     "zero_optimization.offload_optimizer.buffer_count = 8"),
    ({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}, {},
     "zero_optimization.offload_param.pin_memory = false"),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 8}}, {},
     "zero_optimization.offload_param.buffer_count = 8"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, {},
     "zero_optimization.offload_optimizer.pin_memory = false"),
    ({"stage": 2}, {"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size = 2"),
    ({"stage": 3}, {"activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing.partition_activations = true"),
    ({"stage": 3}, {"activation_checkpointing": {"cpu_checkpointing": True}}, "activation_checkpointing.cpu_checkpointing = true"),
])
def test_a_field_whose_effect_is_not_modelled_is_named(tmp_path, zero, top, named):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, **top}))
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "8", "--ds-config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert f"warning: {named} is not modelled" in r.output
    # at DeepSpeed's default, nothing to say
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero["stage"]}}))
    assert "not modelled" not in CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "8",
                                                           "--ds-config", str(cfg)]).output


@pytest.mark.parametrize("given, name", [
    ("LLAMA-2-7B", "llama-2-7b"), ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),            # Meta's prefix on the Hub
    ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),               # the HF conversion: the same tensors
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"), ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("allenai/OLMo-2-1124-7B", "olmo-2-7b"),                 # the repository the profile was read from
    ("ALLENAI/olmo-2-1124-7b-instruct", "olmo-2-7b"),        # ... its instruction-tuned release
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),  # a variant token inside the name
    ("google/gemma-3-27b-it", "gemma-3-27b"),                # read from -pt, asked for as -it
    ("CohereForAI/c4ai-command-r-v01", "command-r"),
    ("https://huggingface.co/Qwen/Qwen3-8B/tree/main", "qwen3-8b")])   # the page's address, pasted
def test_model_takes_any_case_and_hub_ids(given, name):
    doc = lambda out: json.loads(out[out.index("{"):])  # noqa: E731  (a traced profile's note comes first)
    by_hub = doc(run("--model", given, "--dp", "8", "--stage", "3", "--format", "json").output)
    by_name = doc(run("--model", name, "--dp", "8", "--stage", "3", "--format", "json").output)
    assert by_hub["inputs"]["model"] == name and by_hub["estimates"] == by_name["estimates"]


def test_every_shipped_model_is_named_by_its_own_hub_repository():
    """The repository each profile's values were read from (zerocalc/hf/sources.json), as the Hub spells
    it and in lower case, is that model (27 of them had names `--model` did not take: OLMo-2-1124-7B,
    Mixtral-8x7B-v0.1, Phi-3-mini-4k-instruct, ...)."""
    from zerocalc import resolve
    with open(resolve.SOURCES) as f:
        sources = json.load(f)
    assert set(sources) == set(resolve.names()) - {"seed-gpt"}
    for name, source in sources.items():
        assert resolve.canonical_name(source["repo"]) == name, source["repo"]
        assert resolve.canonical_name(source["repo"].lower()) == name, source["repo"]


@pytest.mark.parametrize("given, near", [("llama3-8b", "did you mean llama-3-8b"), ("qwen-2.5-7b", "did you mean qwen2.5-7b"),
                                         ("Foo/Bar", "is not a shipped model; `zerocalc models`"),
                                         # another release (a longer context, its own rotary tables)
                                         ("microsoft/Phi-3-mini-128k-instruct", "did you mean phi-3-mini"),
                                         ("Qwen/Qwen3-30B-A3B-Instruct-2507", "did you mean qwen3-30b-a3b")])
def test_an_unknown_model_says_the_nearest_and_how_to_bring_one(given, near):
    r = CliRunner().invoke(main, ["estimate", "--model", given, "--dp", "8"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert near in r.output and "give --hf-config config.json" in r.output


def test_unknown_ds_config_keys_warn_and_go_on(tmp_path):
    cfg = tmp_path / "ds.json"
    # DeepSpeed ignores unknown top-level keys but its ZeRO model forbids extra keys (pydantic extra="forbid")
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "fancy": True, "train_micro_batch_size_per_gpu": 1}))
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "2", "--ds-config", str(cfg)])
    assert r.exit_code == 0
    assert "unknown key fancy" in r.output
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "frobnicate": 1}, "train_micro_batch_size_per_gpu": 1}))
    r = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--dp", "2", "--ds-config", str(cfg)])
    assert r.exit_code == 2 and "zero_optimization.frobnicate = 1: DeepSpeed 0.19.8 has no such key" in r.output


@pytest.mark.parametrize("args, says", [
    (["--params", "abc", "--dp", "8"], "cannot read 'abc'"),
    (["--params", "0", "--dp", "8"], "must be positive"),
    (["--params", "-7e9", "--dp", "8"], "cannot read"),
    (["--params", "7e9", "--dp", "0"], "at least 1"),
    (["--params", "7e9", "--dp", "8", "--stage", "4"], "stage 4 does not exist"),
    (["--params", "7e9", "--dp", "8", "--stage", "two"], "give 0, 1, 2, 3"),
    (["--params", "7e9", "--dp", "8", "--stage", "2", "--offload-param", "cpu"], "needs ZeRO stage 3"),
    (["--params", "7e9", "--dp", "8", "--dtype", "fp8"], "'fp8' is not one of"),
    (["--params", "7e9", "--dp", "8", "--optimizer", "lamb"], "'lamb' is not one of"),
    (["--params", "7e9", "--dp", "8", "--gpu-memory", "lots"], "cannot read 'lots' as a memory size"),
    (["--dp", "8"], "say what is trained"),
    (["--model", "llama-2-7b", "--num-heads", "7"], "not divisible by num-heads 7"),
])
def test_bad_input_exits_2_with_a_message(args, says):
    r = run(*args)
    assert r.exit_code == 2
    assert says in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("content, says", [
    ("{not json", "not valid Hjson/JSON"),
    ('{"zero_optimization": {"stage": "two"}}', 'zero_optimization.stage = "two": ZeRO stages are 0, 1, 2, 3'),
    ('{"zero_optimization": {"overlap_comm": 2}}', "zero_optimization.overlap_comm = 2: must be true or false"),
    ('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}', "not divisible"),
    ('{"train_micro_batch_size_per_gpu": "auto"}', "give --micro-batch"),
    ('[1, 2]', "a ds_config is a JSON object"),
])
def test_bad_ds_config_exits_2(tmp_path, content, says):
    cfg = tmp_path / "ds.json"
    cfg.write_text(content)
    r = run("--params", "7e9", "--dp", "8", "--ds-config", str(cfg))
    assert r.exit_code == 2, r.output
    assert says in r.output
    assert "Traceback" not in r.output


def test_missing_ds_config_file_exits_2():
    r = run("--params", "7e9", "--dp", "8", "--ds-config", "/nonexistent/ds.json")
    assert r.exit_code == 2 and "cannot read" in r.output


def test_host_rates_set_the_offload_time():
    # Stage 2 optimizer offload on one GPU: gradients down and the bf16 shard up at the host link, CPU
    # Adam at the host's rate: every offload term halves when both rates double (no pageable copy here).
    from zerocalc import calibration
    k = calibration.default()["time"]
    shape = ["--model", "llama-2-7b", "--num-layers", "4", "--dp", "1", "--stage", "2", "--offload-optimizer", "cpu",
             "--gpu", "h200", "--seq-len", "512", "--micro-batch", "1", "--format", "json"]

    def offload_s(*extra):
        r = run(*shape, *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["estimates"][0]["time"]["offload_s"]

    fast = offload_s("--cpu-adam-rate", str(2 * k["host_adam_elements_per_s"]),
                     "--host-link-gbps", str(2 * k["host_link_bytes_per_s"] / 1e9))
    assert fast == pytest.approx(offload_s() / 2)
    assert run("--params", "7e9", "--cpu-adam-rate", "0").exit_code == 2


def test_a_calibration_file_without_the_host_rates_takes_the_shipped_ones(tmp_path):
    from zerocalc import calibration
    old = json.loads(json.dumps(calibration.default()))
    for k in ("host_link_bytes_per_s", "host_adam_elements_per_s", "host_pageable_bytes_per_s"):
        del old["time"][k]
    f = tmp_path / "before-offload.json"
    f.write_text(json.dumps(old))
    shape = ["--model", "llama-2-7b", "--num-layers", "4", "--dp", "1", "--stage", "3", "--offload-optimizer", "cpu",
             "--gpu", "h200", "--seq-len", "512", "--micro-batch", "1", "--format", "json"]
    mine, shipped = run(*shape, "--calibration", str(f)), run(*shape)
    assert mine.exit_code == 0, mine.output
    assert json.loads(mine.output)["estimates"][0]["time"] == json.loads(shipped.output)["estimates"][0]["time"]


def test_expandable_segments_flag_reaches_the_estimate():
    """Without an architecture reserved is the calibrated ratio, lowered by the factor expandable
    segments were measured to bring (H200 rows, data/h200-t3-expandable-n1.csv): the flag must apply
    it, lower reserved and leave allocated alone."""
    from zerocalc import calibration
    cal = calibration.default()
    ratio = cal["allocator"]["reserved_over_allocated"]
    ratios = {"allocator": ratio, "allocator_expandable": ratio * cal["allocator_expandable"]["factor"]}
    args = ("--params", "1e9", "--dp", "8", "--stage", "2", "--format", "json")
    plain = json.loads(run(*args).output)["estimates"][0]
    exp = json.loads(run(*args, "--expandable-segments").output)["estimates"][0]
    assert exp["peak_bytes"] == plain["peak_bytes"]
    assert exp["peak_reserved_bytes"] < plain["peak_reserved_bytes"]
    assert plain["peak_reserved_bytes"] == int(plain["peak_bytes"] * ratios["allocator"])
    assert exp["peak_reserved_bytes"] == int(plain["peak_bytes"] * ratios["allocator_expandable"])
    assert "expandable_segments allocator" in run("--params", "1e9", "--dp", "8", "--expandable-segments").output
    assert "expandable_segments" not in run("--params", "1e9", "--dp", "8").output


# The usual per-GPU memories as nvidia-smi reports them: 16-80 GB cards hold that many GiB, the H200
# 143,771 MiB. Written out here, not read from zerocalc.
CARDS = [("16 GB", 16 * 2**30), ("24 GB", 24 * 2**30), ("32 GB", 32 * 2**30), ("40 GB", 40 * 2**30),
         ("48 GB", 48 * 2**30), ("80 GB", 80 * 2**30), ("141 GB", 143771 * 2**20)]


def test_without_gpu_memory_each_stage_says_the_smallest_gpu_it_fits_on():
    """The Quick start's question, 7B on 8 GPUs with no --gpu-memory: each stage names the smallest
    usual GPU holding its device bytes (reserved + context), and the one holding its worst case; on
    32 GB exactly the stages whose smallest GPU is at most 32 GB fit."""
    doc = json.loads(run("--params", "7e9", "--dp", "8", "--format", "json").output)
    at_32 = json.loads(run("--params", "7e9", "--dp", "8", "--gpu-memory", "32GiB", "--format", "json").output)
    table = run("--params", "7e9", "--dp", "8").output
    rows = {ln.split()[0]: ln for ln in table.splitlines() if ln[:5].strip().isdigit()}
    assert "fits on" in table.splitlines()[2] and "--gpu-memory 32GiB" in table
    for e, e32 in zip(doc["estimates"], at_32["estimates"]):
        assert e["fits"] is None and e["fits_worst_case"] is None           # no GPU given: no verdict ...
        smallest = next(((n, b) for n, b in CARDS if e["device_bytes"] <= b), (None, None))
        safe = next(((n, b) for n, b in CARDS if e["device_bytes"] - e["peak_reserved_bytes"]
                     + e["peak_reserved_worst_bytes"] <= b), (None, None))
        assert e["fits_on_gpu_memory_bytes"] == smallest[1]                # ... but the smallest GPU
        assert e["fits_on_worst_case_gpu_memory_bytes"] == safe[1]
        assert e32["fits"] == (smallest[1] is not None and smallest[1] <= 32 * 2**30)
        row = rows[str(e["stage"])]
        if smallest[0] is None:
            assert row.endswith("> 141 GB")
        elif smallest == safe:
            assert row.endswith(f" {smallest[0]}")
        else:
            assert row.endswith(f" {smallest[0]} tight, {safe[0] or '> 141 GB'}")
    # stage 0's step holds 14 B per parameter of states, 2 B of gradients and 8 B of their fp32 copies:
    # 24 × 7e9 = 168e9 B = 156 GiB allocated, beyond the H200's 140.4 GiB
    assert doc["estimates"][0]["fits_on_gpu_memory_bytes"] is None


def test_csv_carries_the_time_section_of_the_json():
    args = ("--model", "llama-2-7b", "--dp", "8", "--seq-len", "2048", "--gpu", "h100", "--stage", "2,3")
    doc = json.loads(run(*args, "--format", "json").output)
    import csv
    import io
    rows = list(csv.DictReader(io.StringIO(run(*args, "--format", "csv").output)))
    for e, row in zip(doc["estimates"], rows):
        assert set(e["time"]) <= set(row)                                   # every time field has a column
        for k, v in e["time"].items():
            assert float(row[k]) == pytest.approx(v, rel=1e-12), k
        assert row["fits"] == str(e["fits"]) and row["fits_worst_case"] == str(e["fits_worst_case"])
        assert (row["fits_source"], row["headroom_bytes"], row["alloc_retries"]) == \
            (e["fits_source"], str(e["headroom_bytes"]), str(e["alloc_retries"]))
    plain = list(csv.DictReader(io.StringIO(run("--params", "1e9", "--dp", "2", "--format", "csv").output)))
    assert plain[0]["step_s"] == "" and plain[0]["fits"] == ""             # no time without --gpu and a shape


@pytest.mark.slow   # seven plans and estimates of 7-70B models, each row of a plan simulated
@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_every_example_in_the_help_runs(command):
    """The examples `--help` teaches run as written (those reading the user's own files aside)."""
    import shlex
    text = CliRunner().invoke(main, [command, "--help"]).output.replace("\\\n", " ")
    examples = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("zerocalc ")]
    runnable = [ex for ex in examples if "config.json" not in ex]
    assert len(runnable) >= 3
    for ex in runnable:
        r = CliRunner().invoke(main, shlex.split(ex)[1:])
        assert r.exit_code == 0, (ex, r.output)


@pytest.mark.parametrize("flags, says", [
    ([], None),
    (["--stage", "2", "--offload-optimizer", "cpu"], "optim with optimizer offload."),
    (["--stage", "3", "--offload-param", "cpu"], "params with parameter offload."),
    (["--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"],
     "optim with optimizer offload, params with parameter offload."),
])
def test_the_table_says_which_columns_an_offload_keeps_on_the_host(flags, says):
    """The optim and params columns are the states' sizes wherever they live. With optimizer offload at
    stage 2 (7B, N = 8) optim is 12 B × 7e9 / 8 = 10.5e9 B, and the GPU's peak, the init's module
    parameters beside the flat buffer (2 × 2 B × 7e9 = 28e9 B), does not include it."""
    r = run("--params", "7e9", "--dp", "8", *flags)
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("offload:")]
    assert lines == ([] if says is None else ["offload: in host memory, counted in host/rank, not in peak or "
                                              "reserved: " + says])
    if flags[:2] == ["--stage", "2"]:
        e = json.loads(run("--params", "7e9", "--dp", "8", *flags, "--format", "json").output)["estimates"][0]
        assert (e["per_rank_bytes"]["optimizer_states"], e["peak_bytes"]) == (10_500_000_000, 28_000_000_000)


def test_the_table_says_nvme_offload_is_on_disk():
    """Optimizer offload to NVMe at stage 3 (7e9, N = 8): the optimizer's fp32 master and two moments,
    12 B × 7e9 / 8 = 10.5e9 B, go to disk, not into host/rank; the parameters offloaded to the host stay there."""
    flags = ("--params", "7e9", "--dp", "8", "--stage", "3", "--offload-optimizer", "nvme", "--offload-param", "cpu")
    lines = [ln for ln in run(*flags).output.splitlines() if ln.startswith("offload")]
    assert lines == ["offload: in host memory, counted in host/rank, not in peak or reserved: params with parameter offload.",
                     "offload to NVMe: on disk (host.nvme_bytes in --format json), not in host/rank, peak or reserved: "
                     "optim with optimizer offload."]
    e = json.loads(run(*flags, "--format", "json").output)["estimates"][0]
    assert e["host"]["nvme_bytes"] == 10_500_000_000


def test_the_column_legend_is_printed_on_request():
    """The table and the notes about this answer by default; what each column counts behind --explain."""
    plain, explained = run("--params", "7e9", "--dp", "8"), run("--params", "7e9", "--dp", "8", "--explain")
    assert plain.exit_code == explained.exit_code == 0
    assert "GiB per rank:" not in plain.output and "What each column counts: --explain." in plain.output
    assert "GiB per rank:" in explained.output and "--explain." not in explained.output
    assert "Peak set by" in plain.output   # a note about this answer stays


def test_one_rank_says_its_logged_collectives_cross_no_wire():
    """At N = 1 DeepSpeed still logs its gradient all-reduce (measured on H200, data/h200-t2-n1-s3.csv),
    so comm GB is not 0 while the wire volume is: the table says why, only then."""
    one, eight = run("--params", "7e9", "--dp", "1", "--stage", "0"), run("--params", "7e9", "--dp", "8", "--stage", "0")
    assert "N = 1: DeepSpeed still calls its collectives" in one.output
    assert "N = 1" not in eight.output


def test_a_traced_model_says_what_stands_in_where_its_trace_gave_nothing_and_why():
    """Where a profile's trace could not read the kept tensors, the allocation stream or the operators
    (`source["untraced"]`, the reason each attempt failed with), the note names what stands in (the
    Llama formulas, the calibrated ratio, a Llama layer's operators) and that reason; the estimate does
    take the ratio there. Phi-3-mini's own profile has all three: nothing stands in."""
    from dataclasses import replace

    from zerocalc import estimate, model, profile, resolve
    from zerocalc.training import Setup
    p = profile.shipped_profile("phi-3-mini")
    setups = [Setup(stage=2, seq_len=1024, micro_batch=2)]
    whole = resolve.notes(model.from_profile(p, "phi-3-mini"), setups, timed=True)[0]
    assert "could not be traced" not in whole and "reserved: its traced allocation stream" in whole
    untraced = {"activations": "ValueError: a", "stream": "ValueError: the stream does not cut into layers",
                "steps": "RuntimeError: c"}
    spec = model.from_profile(replace(p, activations=None, stream=None, steps=None,
                                      source={**p.source, "untraced": untraced}), "phi-3-mini")
    note = resolve.notes(spec, setups, timed=True)[0]
    assert "activations: the Llama formulas at its dimensions (its kept tensors could not be traced: ValueError: a)" in note
    assert ("reserved: the calibrated ratio (its allocation stream could not be traced: ValueError: the stream "
            "does not cut into layers)") in note
    assert ("step time: a Llama layer's operators and FLOPs at its dimensions (its own operators could not be "
            "traced: RuntimeError: c)") in note
    assert "step time" not in resolve.notes(spec, setups)[0]          # not timed: not said
    assert estimate.estimate(spec, setups[0]).reserved_source == "ratio"


def test_an_attention_the_stream_was_not_traced_under_takes_the_ratio_and_says_so():
    """Phi-3-mini's stream is traced under SDPA (its config's attention): with --attention eager
    reserved is the calibrated ratio, and the note says why."""
    result = CliRunner().invoke(main, ["estimate", "--model", "phi-3-mini", "--seq-len", "1024", "--attention",
                                       "eager", "--stage", "2", "--format", "json"])
    assert result.exit_code == 0
    assert ("reserved: the calibrated ratio under eager (its stream is traced under sdpa attention only)"
            in result.stderr)
    assert json.loads(result.stdout)["estimates"][0]["peak_reserved_source"] == "ratio"


def test_a_lora_stream_that_could_not_be_recorded_says_why(monkeypatch):
    """With LoRA the stream of the model's own trained tensors is recorded from PEFT's model; where that
    fails (here made to, as a model whose deeper layers train other tensors than the layer they are
    played as would), reserved is the calibrated ratio and the note gives the variant and the error."""
    pytest.importorskip("torch")
    from zerocalc.hf import adapted

    def fails(*args, **kwargs):
        raise ValueError("layer 3 trains other tensors than the layer it is played as")
    monkeypatch.setattr(adapted, "cached_variant", fails)
    result = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-0.5b", "--seq-len", "1024", "--lora-rank", "16",
                                       "--stage", "2", "--format", "json"])
    assert result.exit_code == 0
    assert ("reserved: the calibrated ratio (the stream of its own trained tensors could not be recorded from "
            "PEFT's model: plain: ValueError: layer 3 trains other tensors than the layer it is played as)") in result.stderr
    assert json.loads(result.stdout)["estimates"][0]["peak_reserved_source"] == "ratio"


