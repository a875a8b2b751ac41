"""Shipped profiles (torch-free): published parameter counts, the hand-transcribed presets reproduced
by their traced profiles, the compact JSON, MoE at stage 3, and --model / --hf-config input."""
import json
import os
import sys

import pytest
from click.testing import CliRunner

from zerocalc import arch as A
from zerocalc import family
from zerocalc import profile as P
from zerocalc.cli import main
from zerocalc.model import from_profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hand_spec import hand_spec  # noqa: E402

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
    # Qwen3-Next-80B-A3B: the Hub's safetensors total, 81,324,862,720, less the multi-token-prediction
    # module transformers does not build (its fc, one full-attention layer and three norms,
    # 1,650,471,424); the same count Qwen3-Coder-Next, this architecture without that module, publishes
    "qwen3-next-80b-a3b": 79_674_391_296,
    "gemma-2-2b": 2_614_341_888,
    "phi-3-mini": 3_821_079_552,
    "deepseek-v2-lite": 15_706_484_224,
    "pythia-6.9b": 6_857_302_016,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_profiles_have_the_published_parameter_counts(name):
    assert P.shipped_profile(name).num_params == PUBLISHED[name]


# Published parameter counts as their publishers print them, rounded: the model card's or paper's
# figure, or the Hub's own count of the publisher's upload (the model page's "params", the safetensors
# total). A figure matches within half a unit of its last digit ("7.61B": ±0.005B), and never closer
# than 1%: publishers round loosely (Qwen2.5-32B's card says 32.5B of a 32.76B model). Left out where the figure counts another model than the one built:
# the Hub's count of a tied-embedding checkpoint that stores the head twice (Qwen1.5-1.8B's 1.84B,
# Falcon-40B's 41.8B), DeepSeek-V3's 685B (with the multi-token-prediction layer transformers does
# not build: 671B without); names that round down past their own last digit (GPT-2 XL's "1.5B" of
# 1.56B; StarCoder2-15B's "15B" of 15.96B), and StarCoderBase-1B's "1B" (±50% says nothing).
FIGURES = {
    # EleutherAI/pythia README, "Models" table, total parameters (exact)
    "pythia-14m": "14,067,712", "pythia-160m": "162,322,944", "pythia-1.4b": "1,414,647,808", "pythia-70m": "70,426,624", "pythia-410m": "405,334,016",
    "pythia-1b": "1,011,781,632", "pythia-2.8b": "2,775,208,960", "pythia-12b": "11,846,072,320",
    # BigScience model cards, "Number of parameters" (exact)
    "bloom-560m": "559,214,592", "bloom-1b1": "1,065,314,304", "bloom-1b7": "1,722,408,960",
    "bloom-3b": "3,002,557,440", "bloom-7b1": "7,069,016,064", "bloom-176b": "176,247,271,424",
    # OpenAI gpt-oss model card, table 1 (total parameters)
    "gpt-oss-20b": "20.91B", "gpt-oss-120b": "116.83B",
    # DeepSeek cards: V3/R1 "671B total" (main model), V2 "236B", Coder-V2-Lite "16B", LLM and Coder names
    "deepseek-v3": "671B", "deepseek-r1": "671B", "deepseek-v2": "236B", "deepseek-coder-v2-lite": "16B",
    "deepseek-llm-7b": "7B", "deepseek-llm-67b": "67B", "deepseek-coder-1.3b": "1.3B",
    "deepseek-coder-6.7b": "6.7B", "deepseek-coder-33b": "33B",
    # the Hub's count of the R1 distills (Qwen2.5 and Llama-3.x tensors)
    "deepseek-r1-distill-qwen-1.5b": "1.78B", "deepseek-r1-distill-qwen-7b": "7.62B",
    "deepseek-r1-distill-qwen-14b": "14.8B", "deepseek-r1-distill-qwen-32b": "32.8B",
    "deepseek-r1-distill-llama-8b": "8.03B", "deepseek-r1-distill-llama-70b": "70.6B",
    # Qwen: the Qwen2 release table, the Qwen2.5-Coder and Qwen3 cards ("Number of Parameters"),
    # the Hub's count of the Qwen2.5-Math base models
    "qwen2-0.5b": "0.49B", "qwen2-1.5b": "1.54B", "qwen2-72b": "72.71B", "qwen2-57b-a14b": "57.41B",
    "qwen2-7b": "7.62B", "qwen2.5-coder-0.5b": "0.49B", "qwen2.5-coder-1.5b": "1.54B", "qwen2.5-coder-3b": "3.09B",
    "qwen2.5-coder-7b": "7.61B", "qwen2.5-coder-14b": "14.7B", "qwen2.5-coder-32b": "32.5B",
    "qwen2.5-math-1.5b": "1.54B", "qwen2.5-math-7b": "7.62B", "qwen2.5-math-72b": "72.7B",
    "qwen3-1.7b": "1.7B", "qwen3-14b": "14.8B", "qwen3-235b-a22b": "235B", "qwen3-0.6b": "0.6B", "qwen3-4b": "4.0B",
    "qwen3-32b": "32.8B", "qwen2.5-1.5b": "1.54B", "qwen2.5-3b": "3.09B", "qwen2.5-14b": "14.7B",
    "qwen2.5-32b": "32.5B", "qwen1.5-moe-a2.7b": "14.3B",
    # Mistral AI cards and the Hub's counts
    "mistral-7b-v0.2": "7.24B", "mistral-7b-v0.3": "7.25B", "mistral-nemo-12b": "12.2B", "mistral-small-22b": "22.2B",
    "mistral-small-24b": "23.6B", "ministral-8b": "8.02B", "mistral-large-2407": "123B", "codestral-22b": "22.2B",
    # Meta's Llama cards and the Hub's counts (Llama-2-70B's card says 70B of 69.0B: the Hub's 69B)
    "llama-2-13b": "13B", "llama-2-70b": "69B", "llama-3-70b": "70.6B", "llama-3.1-8b": "8.03B",
    "llama-3.1-70b": "70.6B", "llama-3.3-70b": "70.6B", "llama-3.2-3b": "3.21B",
    # Meta's Code Llama and TinyLlama on the Hub
    "codellama-7b": "6.74B", "codellama-13b": "13.0B", "codellama-34b": "33.7B", "tinyllama-1.1b": "1.1B",
    # Gemma reports: embedding + non-embedding parameters (Gemma 1 table 2; Gemma 3 table 1, text only)
    "gemma-2b": "2.51B", "gemma-7b": "8.54B", "gemma-3-270m": "268M", "gemma-3-4b": "3,884M",
    "gemma-3-12b": "11,771M", "gemma-3-27b": "27,016M", "gemma-3-1b": "1,000M",
    # Gemma 2 on the Hub
    "gemma-2-9b": "9.24B", "gemma-2-27b": "27.2B",
    # Microsoft cards and the Hub's counts
    "phi-1": "1.42B", "phi-1.5": "1.42B", "phi-2": "2.78B", "phi-3-medium": "14B", "phi-3.5-mini": "3.8B",
    "phi-4-mini": "3.8B", "phi-3.5-moe": "41.9B", "phi-4": "14.7B",
    # AI2 (OLMo, OLMo 2, OLMoE), IBM Granite 3.1, Hugging Face SmolLM, BigCode StarCoder2 on the Hub
    "olmo-2-7b": "7.3B", "olmo-2-13b": "13.7B", "olmo-1b": "1.18B", "olmo-7b": "6.89B", "olmo-2-1b": "1.48B", "olmo-2-32b": "32.2B", "olmoe-1b-7b": "6.92B",
    "granite-3.1-2b": "2.53B", "granite-3.1-8b": "8.17B", "granite-3.1-1b-a400m": "1.33B",
    "granite-3.1-3b-a800m": "3.3B", "granite-3.0-2b": "2.53B", "granite-3.0-1b-a400m": "1.33B", "smollm2-135m": "135M", "smollm2-360m": "362M", "smollm2-1.7b": "1.71B",
    "smollm3-3b": "3.08B", "starcoder2-3b": "3.03B", "starcoder2-7b": "7.17B",
    # TII (Falcon-7B card's name; Falcon-RW-1B and Falcon3 on the Hub), Stability AI and BigCode on the
    # Hub, NVIDIA's, Cohere's and 01.AI's names
    "falcon-7b": "7B", "falcon-rw-1b": "1.31B", "falcon3-1b": "1.67B", "falcon3-3b": "3.23B", "falcon3-7b": "7.46B", "falcon3-10b": "10.3B",
    "stablelm-2-1.6b": "1.64B", "nemotron-mini-4b": "4B", "command-r": "35B", "command-r-plus": "104B", "aya-23-8b": "8B", "yi-6b": "6B", "yi-9b": "9B", "yi-34b": "34B",
    # OpenAI GPT-2 and DistilGPT2 cards; Meta's OPT (names, the Hub's 331M for OPT-350M)
    "gpt2": "124M", "gpt2-medium": "355M", "gpt2-large": "774M", "distilgpt2": "82M",
    "opt-125m": "125M", "opt-350m": "331M", "opt-1.3b": "1.3B", "opt-2.7b": "2.7B", "opt-6.7b": "6.7B",
    "opt-13b": "13B", "opt-30b": "30B", "opt-66b": "66B",
}


def published(figure: str) -> tuple[float, float]:
    """(count, tolerance) of a published figure: "14,067,712" exact; "7.61B" ±0.005B, at least 1%."""
    if figure[-1] not in "MB":
        return float(figure.replace(",", "")), 0.0
    digits, scale = figure[:-1].replace(",", ""), {"M": 1e6, "B": 1e9}[figure[-1]]
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    count = float(digits) * scale
    return count, max(0.5 * 10 ** -decimals * scale, 0.01 * count)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_shipped_profiles_have_their_publishers_parameter_counts(name):
    count, tolerance = published(FIGURES[name])
    assert abs(P.shipped_profile(name).num_params - count) <= tolerance, (name, FIGURES[name])


def test_published_figures_by_hand():
    assert published("14,067,712") == (14_067_712, 0)
    assert published("7.61B") == (7.61e9, 0.01 * 7.61e9)            # 1% is wider than ±0.005B
    assert published("7B") == (7e9, 0.5e9)                           # a name: ±0.5B
    assert published("3,884M") == (3.884e9, 0.01 * 3.884e9)


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


@pytest.mark.parametrize("name", sorted(A.PRESETS))
def test_traced_profiles_of_the_presets_equal_the_transcribed_tensors_and_traces(name):
    spec = from_profile(P.shipped_profile(name))
    want = hand_spec(A.PRESETS[name])
    # GPT-2 as published keeps its dropouts' masks (p = 0.1), so DeepSpeed recomputes a checkpointed block
    # from its last dropout on (tests/test_stage3_order.py), where the hand lists, the validator's
    # dropout-free GPT-2, start at the last module with parameters.
    dropout = any(m.saves for m in spec.profile.modules)
    assert dropout == name.startswith("gpt2")
    assert family.FAMILY in spec.profile.source
    assert spec.param_numels == want.param_numels
    assert spec.trace == want.trace
    assert spec.backward_trace == want.backward_trace
    assert (spec.checkpointed_backward_trace == want.checkpointed_backward_trace) != dropout
    assert spec.buffer_numels == want.buffer_numels


# The shipped profiles together (160: 1.8 MB, half of it the allocation streams; the repeated layers
# of each stored once, a hybrid model's pattern of layers once): a bound that fails before the package
# outgrows a couple of MB. One profile: at most 48 kB (a hybrid model's stream holds a segment for each
# kind of layer: Qwen3-Next's 42 kB, 24 of them the stream; the largest of one kind, DeepSeek-V3's, 27 kB).
SIZE_BOUND = 2_000_000
PROFILE_BOUND = 48_000


def test_shipped_profiles_are_small_and_cover_the_families():
    files = P.shipped()
    assert len(files) >= 158
    sizes = [os.path.getsize(f) for f in files.values()]
    assert max(sizes) < PROFILE_BOUND and sum(sizes) < SIZE_BOUND
    kinds = {P.shipped_profile(n).model_type for n in files}
    assert {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
            "gemma3_text", "phi", "phi3", "phimoe", "olmo", "olmo2", "olmoe", "granite", "granitemoe", "smollm3",
            "starcoder2", "falcon", "gpt_oss", "cohere", "deepseek_v2", "deepseek_v3", "gpt_neox", "gpt2", "opt",
            "bloom", "gpt_bigcode", "stablelm", "nemotron"} <= kinds


def test_a_pattern_of_layers_is_stored_once():
    """Hand-made: 6 layers alternating two kinds (a linear-attention layer of 2 tensors, a full one of
    1) are one repeat of a 2-index block (`step` 2, "{i}" and "{i+1}"), and expand back to the same
    items; 10 and 11 are not confused with 1 (`GROUP_INDICES`)."""
    items = [["embed", [4]]]
    for i in range(0, 12, 2):
        items += [[f"layers.{i}.linear.a", [2]], [f"layers.{i}.linear.b", [3]], [f"layers.{i + 1}.attn.q", [5]]]
    items += [["norm", [4]]]
    packed = P._compress(items)
    assert packed == [["embed", [4]],
                      {"repeat": 6, "prefix": "layers.", "from": 0, "step": 2,
                       "items": [["layers.{i}.linear.a", [2]], ["layers.{i}.linear.b", [3]], ["layers.{i+1}.attn.q", [5]]]},
                      ["norm", [4]]]
    assert P._expand(packed) == items


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
    leaf = from_profile(p)
    moe = 8 * h + 8 * 2 * f * h + 8 * h * f
    steps = [sum(leaf.param_numels[i] for i in step) for step in leaf.trace]
    assert steps.count(moe) == 32
    plain = from_profile(p, z3_leaf_moe=False)
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
    spec = from_profile(P.shipped_profile("qwen2.5-7b"))
    assert family.FAMILY not in spec.profile.source
    act = activations.breakdown(spec, Setup(seq_len=4096, micro_batch=2))
    assert act.layers_bytes == layers * per_token * 2 * 4096
    # the head: the final RMSNorm's fp32 input 4h, rsqrt 4, cast and product 2·2h; and the fp32
    # log-probabilities over the vocabulary (152064)
    assert act.logprobs_bytes == (4 * h + 4 + 2 * 2 * h + 4 * 152064) * 2 * 4096


def test_every_shipped_profile_is_a_trace_of_its_config_by_this_tracer():
    """Each zerocalc/profiles/NAME.json was traced from zerocalc/hf/configs/NAME.json (the digest of its
    values) at the tracer's TRACE_VERSION: a tracer change that bumps it fails here until the profiles
    are traced again (`python -m zerocalc.hf.ship`). The seed's GPT has no config.json: its profile is
    the validator's model read at its size (`python -m zerocalc.hf.familyprofile`)."""
    from zerocalc.hf import ship
    from zerocalc.hf import trace as T
    configs = ship.configs()
    assert set(P.shipped()) == set(configs) | {"seed-gpt"}
    with open(P.shipped()["seed-gpt"]) as f:
        assert json.load(f)["source"]["trace_version"] == T.TRACE_VERSION
    for name, path in P.shipped().items():
        if name == "seed-gpt":
            continue
        with open(path) as f:
            source = json.load(f)["source"]
        with open(configs[name]) as f:
            digest = T.config_digest(json.load(f))
        assert (name, source["trace_version"], source["config_sha256"]) == (name, T.TRACE_VERSION, digest)


def test_every_shipped_profile_carries_what_its_trace_reads():
    """Each shipped profile read from its config holds its kept tensors, its allocation stream and its
    operator counts, and nothing its trace could not read (`source["untraced"]`): no formula, ratio or
    Llama layer's operators stands in for a shipped model (Phi-3.5-mini and Phi-4-mini had none of the
    stream and counts while their first step, LongRoPE's, was the one traced; OLMo-1B no stream while
    its stream was cut at a head gradient it does not have). The seed's GPT is its family's."""
    missing = {name: [k for k in ("activations", "stream", "steps") if not getattr(P.shipped_profile(name), k)]
               + list(P.shipped_profile(name).source.get("untraced", {}))
               for name in P.shipped() if name != "seed-gpt"}
    assert {name: m for name, m in missing.items() if m} == {}
