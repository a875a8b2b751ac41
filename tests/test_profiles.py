"""Shipped profiles (torch-free): published parameter counts, the transcribed presets reproduced
by their traced profiles, the compact JSON, MoE at stage 3, and --model / --hf-config input."""
import json
import os

import pytest
from click.testing import CliRunner

from zerocalc import arch as A
from zerocalc import profile as P
from zerocalc.cli import main
from zerocalc.model import from_architecture

# Published parameter counts (each model card / the hub's safetensors total).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_620_634_112,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "gemma-2-2b": 2_614_341_888,
    "phi-3-mini": 3_821_079_552,
    "deepseek-v2-lite": 15_706_484_224,
    "pythia-6.9b": 6_857_302_016,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_profiles_have_the_published_parameter_counts(name):
    assert P.shipped_profile(name).num_params == PUBLISHED[name]


def test_qwen2_5_7b_by_hand():
    """Qwen2.5-7B (h 3584, 28 layers, 28 heads, 4 KV heads of 128, FFN 18944, vocab 152064, untied):
    the attention's q, k, v projections have biases (Qwen2), o_proj none."""
    h, layers, kv, f, v = 3584, 28, 4 * 128, 18944, 152064
    attn = (h * h + h) + 2 * (kv * h + kv) + h * h     # q with bias, k and v with bias, o
    mlp = 3 * h * f                                    # gate, up, down
    norms = 2 * h
    total = v * h + layers * (attn + mlp + norms) + h + v * h   # embedding, layers, final norm, head
    assert total == 7_615_616_512
    assert P.shipped_profile("qwen2.5-7b").num_params == total


@pytest.mark.parametrize("name", sorted(set(A.PRESETS) & set(P.shipped())))
def test_traced_profiles_of_the_presets_equal_the_transcribed_tensors_and_traces(name):
    spec = P.to_model_spec(P.shipped_profile(name))
    want = from_architecture(A.PRESETS[name])
    assert spec.transcribed
    assert spec.param_numels == want.param_numels
    assert spec.trace == want.trace
    assert spec.backward_trace == want.backward_trace
    assert spec.checkpointed_backward_trace == want.checkpointed_backward_trace
    assert spec.buffer_numels == want.buffer_numels


def test_shipped_profiles_are_small_and_cover_the_families():
    files = P.shipped()
    assert len(files) >= 25
    sizes = [os.path.getsize(f) for f in files.values()]
    assert max(sizes) < 32_000 and sum(sizes) < 600_000
    kinds = {P.shipped_profile(n).model_type for n in files}
    assert {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "phi3", "olmo2",
            "gpt_neox", "gpt2", "deepseek_v2"} <= kinds


def test_json_round_trip_and_repeated_layers_stored_once():
    p = P.shipped_profile("llama-3.1-405b")
    d = P.to_json(p)
    assert P.from_json(json.loads(json.dumps(d))) == p
    # embedding, one repeat entry for the 126 layers, final norm, head
    assert len(d["params"]) == 4 and d["params"][1]["repeat"] == 126


def test_an_moe_block_is_one_stage3_fetch_unit():
    """Mixtral-8x7B: each layer's MixtralSparseMoeBlock (router 8·h, experts' gate_up 8·2f·h and
    down 8·h·f) is fetched whole; without the leaf, router and experts are separate steps."""
    p = P.shipped_profile("mixtral-8x7b")
    h, f = 4096, 14336
    leaf = P.to_model_spec(p)
    moe = 8 * h + 8 * 2 * f * h + 8 * h * f
    steps = [sum(leaf.param_numels[i] for i in step) for step in leaf.trace]
    assert steps.count(moe) == 32
    plain = P.to_model_spec(p, z3_leaf_moe=False)
    assert moe not in [sum(plain.param_numels[i] for i in step) for step in plain.trace]
    assert leaf.num_params == plain.num_params == 46_702_792_704


def _run(*args):
    return CliRunner().invoke(main, list(args))


def test_model_names_a_shipped_profile():
    r = _run("estimate", "--model", "qwen2.5-7b", "--dp", "8", "--stage", "3", "--format", "json")
    assert r.exit_code == 0, r.output
    inputs = json.loads(r.stdout)["inputs"]
    assert inputs["num_params"] == 7_615_616_512
    # embedding; per layer q, k, v weight and bias, o, gate, up, down, two norms (12); final norm; head
    assert inputs["num_param_tensors"] == 1 + 28 * 12 + 1 + 1


def test_models_lists_presets_and_profiles():
    r = _run("models")
    assert r.exit_code == 0
    assert "qwen3-30b-a3b" in r.output and "8/128" in r.output and "seed-gpt" in r.output


def test_moe_at_stage3_says_the_block_is_one_fetch_unit():
    r = _run("estimate", "--model", "mixtral-8x7b", "--dp", "8", "--stage", "3")
    assert r.exit_code == 0
    assert "set_z3_leaf_modules(model, [MixtralSparseMoeBlock])" in r.output


def test_overriding_the_seed_gpt_hidden_size_keeps_ffn_four_times_hidden():
    r = _run("estimate", "--model", "seed-gpt", "--hidden-size", "1024", "--stage", "0", "--format", "json")
    assert r.exit_code == 0, r.output
    a = A.preset_derived("seed-gpt", hidden_size=1024)[0]
    assert a.ffn_hidden_size == 4 * 1024
    # embedding 50257·1024, per layer 12h² + 13h (4h² attention, 8h² MLP; biases and norms), final norm, head
    h, v = 1024, 50257
    assert A.num_params(a) == v * h + 24 * (12 * h * h + 13 * h) + 2 * h + v * h
    r = _run("estimate", "--model", "seed-gpt", "--hidden-size", "1024", "--stage", "0")
    assert "--hidden-size 1024" in r.output and "ffn-hidden-size 4096 derived" in r.output


def test_hf_config_of_any_name_or_a_directory(tmp_path):
    cfg = json.load(open(os.path.join(os.path.dirname(P.__file__), "hf", "configs", "qwen2.5-0.5b.json")))
    f = tmp_path / "my-qwen.json"
    f.write_text(json.dumps(cfg))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    for path in (str(f), str(tmp_path / "model")):
        r = _run("estimate", "--hf-config", path, "--stage", "2", "--format", "json")
        assert r.exit_code == 0, r.output
        assert '"num_params": 494032768' in r.output


def test_unknown_model_type_without_the_extra_says_how_to_get_an_answer(tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_trace(name, *a, **k):
        if name == "zerocalc.hf" or name.startswith("zerocalc.hf."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_trace)
    f = tmp_path / "cfg-xyz.json"
    f.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}))
    r = _run("estimate", "--hf-config", str(f))
    assert r.exit_code == 2
    assert str(f) in r.output and "pip install 'zerocalc[trace]'" in r.output and "--params" in r.output
    assert "Traceback" not in r.output


def test_a_llama_configs_biases_are_counted(tmp_path):
    """Llama with attention_bias and mlp_bias (h 64, 2 layers, 4 heads, 2 KV heads of 16, FFN 160,
    vocab 1000, untied): each projection gains a bias of its output width."""
    h, kv, f, v, layers = 64, 2 * 16, 160, 1000, 2
    cfg = {"model_type": "llama", "vocab_size": v, "hidden_size": h, "num_hidden_layers": layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": f, "tie_word_embeddings": False}
    plain = (h * h + 2 * kv * h + h * h) + 3 * h * f + 2 * h       # q, k, v, o; gate, up, down; two norms
    biases = {"attention_bias": h + 2 * kv + h, "mlp_bias": 2 * f + h}
    for flags in ({}, {"attention_bias": True}, {"mlp_bias": True}, {"attention_bias": True, "mlp_bias": True}):
        f_ = tmp_path / "c.json"
        f_.write_text(json.dumps({**cfg, **flags}))
        r = _run("estimate", "--hf-config", str(f_), "--stage", "0", "--format", "json")
        assert r.exit_code == 0, r.output
        per_layer = plain + sum(biases[k] for k in flags)
        assert json.loads(r.stdout)["inputs"]["num_params"] == v * h + layers * per_layer + h + v * h


def test_a_traced_models_layer_activations_by_hand():
    """Qwen2.5-7B's layers (h 3584, 4 KV heads of 128, FFN 18944, 28 heads), bf16, per token and layer,
    as the trace keeps them: two RMSNorms (fp32 input 4h, cast and product 2·2h, rsqrt 4), rotated q and
    the attention output 2·2h, v and rotated k 2·2kv, gate/SiLU/up/product 4·2f, SDPA's log-sum-exp
    4·heads: the transcribed Llama layer's 10h + 2kv + 4f in bf16 units, plus 4·heads + 2·4."""
    from zerocalc import activations
    from zerocalc.training import Setup
    h, kv, f, heads, layers = 3584, 512, 18944, 28, 28
    per_token = 2 * (10 * h + 2 * kv + 4 * f) + 4 * heads + 2 * 4
    spec = P.to_model_spec(P.shipped_profile("qwen2.5-7b"))
    assert not spec.transcribed
    act = activations.breakdown(spec, Setup(seq_len=4096, micro_batch=2))
    assert act.layers_bytes == layers * per_token * 2 * 4096
    # the head: the final RMSNorm's fp32 input 4h, rsqrt 4, cast and product 2·2h; and the fp32
    # log-probabilities over the vocabulary (152064)
    assert act.logprobs_bytes == (4 * h + 4 + 2 * 2 * h + 4 * 152064) * 2 * 4096


def test_every_shipped_profile_is_a_trace_of_its_config_by_this_tracer():
    """Each zerocalc/profiles/NAME.json was traced from zerocalc/hf/configs/NAME.json (the digest of its
    values) at the tracer's TRACE_VERSION: a tracer change that bumps it fails here until the profiles
    are traced again (`python -m zerocalc.hf.ship`)."""
    from zerocalc.hf import ship
    from zerocalc.hf import trace as T
    configs = ship.configs()
    assert set(P.shipped()) == set(configs)
    for name, path in P.shipped().items():
        with open(path) as f:
            source = json.load(f)["source"]
        with open(configs[name]) as f:
            digest = T.config_digest(json.load(f))
        assert (name, source["trace_version"], source["config_sha256"]) == (name, T.TRACE_VERSION, digest)
