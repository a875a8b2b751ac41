"""The step time's inputs read from the model's own code (`zerocalc.hf.optrace`): operators dispatched
and FLOPs per phase, against the counts made by hand before the trace existed, and what
`zerocalc.timing` does with them."""
import json

import pytest

from zerocalc import timing
from zerocalc.arch import Architecture
from zerocalc.model import from_architecture, from_profile
from zerocalc.training import Setup, Stage

# The host-side operator counts the time model was fitted with, counted by hand with a TorchDispatchMode on
# real CPU tensors (torch 2.13, transformers 5.24; tests/test_validate_models.py counts them again), views
# and metadata reads left out: per (family, attention) a layer's forward, its backward, its backward when
# checkpointed (the recomputation, stopped early, included), and outside the layers the forward (embedding,
# final norm, head; Llama's rotary tables; transformers' packed-sequence check on the position ids) and
# backward. The loss is the validator's, not the model's, and is left out.
HAND_COUNTS = {
    ("seed-gpt", "eager"): (25, 43, 66, 3, 4),      # nn.MultiheadAttention whatever --attention says
    ("seed-gpt", "sdpa"): (25, 43, 66, 3, 4),
    ("hf-llama", "eager"): (48, 82, 128, 40, 19),
    ("hf-llama", "sdpa"): (38, 71, 107, 30, 19),
    ("hf-gpt2", "eager"): (25, 37, 60, 25, 6),
    ("hf-gpt2", "sdpa"): (17, 29, 44, 15, 6),
}


def _as_hand_counts(c: dict) -> tuple:
    """[1-layer model, per layer] per phase as the hand table has them: per layer, then outside."""
    f, b, ck = (c[p]["ops"] for p in ("forward", "backward", "backward_checkpointed"))
    assert c["base_layers"] == 1
    return f[1], b[1], ck[1], f[0] - f[1], b[0] - b[1]


@pytest.mark.parametrize("family,attention", sorted(HAND_COUNTS))
def test_shipped_family_counts_are_the_hand_counts(family, attention):
    """What timing reads for the transcribed families (family_steps.json, written by the trace) equals
    the hand counts; checkpointing changes nothing outside the layers."""
    c = timing.family_steps()[f"{family}/{attention}"]
    assert _as_hand_counts(c) == HAND_COUNTS[(family, attention)]
    assert c["backward_checkpointed"]["ops"][0] - c["backward_checkpointed"]["ops"][1] == HAND_COUNTS[(family, attention)][4]


def test_timing_counts_operators_from_the_traced_counts():
    # Llama-2-7B's shape, 32 layers, SDPA: forward 32·38 + 30 = 1246, backward 32·71 + 19 = 2291,
    # checkpointed 32·107 + 19 = 3443; eager forward 32·48 + 40 = 1576
    spec = from_architecture(Architecture("hf-llama", 32000, 4096, 32, 32, 32, 11008, False))
    s = Setup(stage=Stage.DISABLED, dp=1, micro_batch=1, seq_len=128)
    assert timing.dispatched_ops(spec, s) == (1246, 2291)
    assert timing.dispatched_ops(spec, Setup(stage=Stage.DISABLED, dp=1, micro_batch=1, seq_len=128,
                                             activation_checkpointing=True)) == (1246, 3443)
    assert timing.dispatched_ops(spec, Setup(stage=Stage.DISABLED, dp=1, micro_batch=1, seq_len=128,
                                             attention="eager"))[0] == 1576


def _profile_with(steps):
    from dataclasses import replace

    from zerocalc import profile
    return replace(profile.shipped_profile("qwen2.5-0.5b"), steps=steps)


def test_a_profiles_own_counts_set_its_operators_and_flops():
    """A profile's `steps` are read as base (its first n layers) + (L - n) per further layer; FLOPs per
    token times T = B·s, attention's per token per position times T·s."""
    from zerocalc import profile
    steps = {"base_layers": 2,
             "forward": {"ops": [100, 10], "flops_per_token": [1000, 100], "attention_flops_per_token_seq": [8, 4],
                         "bytes_per_token": [0, 0]},
             "backward": {"ops": [200, 20], "flops_per_token": [2000, 200], "attention_flops_per_token_seq": [16, 8],
                          "bytes_per_token": [0, 0]},
             "backward_checkpointed": {"ops": [300, 30], "flops_per_token": [3000, 300],
                                       "attention_flops_per_token_seq": [24, 12], "bytes_per_token": [0, 0]}}
    p = _profile_with({"sdpa": steps, "eager": steps})
    spec = from_profile(p)
    layers = p.dims["num_layers"]                  # 24
    s = Setup(stage=Stage.DISABLED, dp=1, micro_batch=2, seq_len=16)
    t = 2 * 16
    assert timing.dispatched_ops(spec, s) == (100 + (layers - 2) * 10, 200 + (layers - 2) * 20)
    fwd, bwd = timing.flops_per_micro_step(spec, s)
    assert fwd == (1000 + 22 * 100) * t + (8 + 22 * 4) * t * 16
    assert bwd == (2000 + 22 * 200) * t + (16 + 22 * 8) * t * 16
    ck = Setup(stage=Stage.DISABLED, dp=1, micro_batch=2, seq_len=16, activation_checkpointing=True)
    assert timing.dispatched_ops(spec, ck)[1] == 300 + 22 * 30
    assert timing.flops_per_micro_step(spec, ck)[1] == (3000 + 22 * 300) * t + (24 + 22 * 12) * t * 16


def test_shipped_profiles_carry_the_counts():
    """`--model qwen2.5-7b` times the step from its own counts, without torch: 28 layers, SDPA, per layer
    (by hand from its config: h 3584, 4 key/value heads of 128, FFN 18944, q/k/v biases) forward
    2·(h·h + 2·h·512 + h·h + 3·h·18944) = 2·(12,845,056 + 3,670,016 + 12,845,056 + 203,685,888)
    = 466,092,032 FLOPs per token, attention 4·28·128 = 14,336 per token per position; the biases are
    additions, not FLOPs."""
    from zerocalc import profile
    p = profile.shipped_profile("qwen2.5-7b")
    c = p.steps["sdpa"]
    assert c["forward"]["flops_per_token"][1] == 2 * (3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + 3 * 3584 * 18944)
    assert c["forward"]["attention_flops_per_token_seq"][1] == 4 * 28 * 128
    # the head (untied, V = 152,064) is the only matmul outside the layers
    assert c["forward"]["flops_per_token"][0] - c["forward"]["flops_per_token"][1] == 2 * 3584 * 152064
    assert c["backward"]["flops_per_token"][1] == 2 * c["forward"]["flops_per_token"][1]


def test_mixtral_counts_its_routed_experts_not_all():
    """Mixtral-8x7B (top-2 of 8 experts, FFN 14336): per layer per token q, o 4096² each, k, v 4096·1024,
    router 4096·8, two experts' gate, up and down 3·4096·14336 each, 2 FLOPs per multiply-add:
    2·(2·16,777,216 + 2·4,194,304 + 32,768 + 2·176,160,768) = 788,594,688. All eight experts (the
    parameter count's 2·P·T) would be 2,902,523,904."""
    from zerocalc import profile
    c = profile.shipped_profile("mixtral-8x7b").steps["sdpa"]
    assert c["forward"]["flops_per_token"][1] == 2 * (2 * 4096 ** 2 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 3 * 4096 * 14336)


# ---------------------------------------------------------------- the trace itself (torch)

def _tiny_llama(**kw):
    return {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
            "max_position_embeddings": 64, "tie_word_embeddings": False, **kw}


def test_the_trace_reproduces_the_llama_hand_counts_and_its_flops():
    """The validator's Llama (2 of 4 heads for key/value) traced from its config on fake tensors: the hand
    counts, and its FLOPs by hand per token (h 64, kv width 32, FFN 160, V 128): a layer's forward
    2·(q 64·64 + k, v 2·64·32 + o 64·64 + gate, up, down 3·64·160) = 2·(4096 + 4096 + 4096 + 30720)
    = 86,016; attention 4·64 = 256 per position; the head 2·64·128 = 16,384; backward twice; the
    recomputation all but the down projection, 86,016 - 2·64·160 = 65,536, and its attention 256."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zerocalc.hf import optrace
    c = optrace.config_steps(_tiny_llama(), 2, attentions=("sdpa",))["sdpa"]
    assert _as_hand_counts(c) == HAND_COUNTS[("hf-llama", "sdpa")]
    f, b, ck = (c[p] for p in ("forward", "backward", "backward_checkpointed"))
    assert f["flops_per_token"] == [86016 + 16384, 86016]
    assert f["attention_flops_per_token_seq"] == [256, 256]
    assert b["flops_per_token"] == [2 * (86016 + 16384), 2 * 86016]
    assert ck["flops_per_token"][1] == 2 * 86016 + 65536
    assert ck["attention_flops_per_token_seq"][1] == 2 * 256 + 256


def test_experts_dispatch_as_many_operators_whatever_their_number():
    """Under transformers' default experts implementation (grouped_mm) an MoE layer runs all its
    experts in one operator per projection: 4 or 8 experts, the same operators; the FLOPs are the
    top-2 experts' for each token (2 · 2 · 3·64·96 = 73,728) whatever the number. One layer (the model
    of `base_layers` layers is all there is): the layer's attention and router, the experts, the head."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zerocalc.hf import optrace
    counts = {}
    for experts in (4, 8):
        d = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
             "num_local_experts": experts, "num_experts_per_tok": 2, "max_position_embeddings": 64}
        counts[experts] = optrace.config_steps(d, 1, attentions=("sdpa",))["sdpa"]["forward"]
    assert counts[4]["ops"] == counts[8]["ops"]
    attention, head = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64), 2 * 64 * 128
    for experts, c in counts.items():
        assert c["flops_per_token"][0] == attention + 2 * 64 * experts + 2 * 2 * 3 * 64 * 96 + head


@pytest.mark.slow
def test_the_trace_reproduces_every_hand_count():
    """The committed family counts are what the trace of the validator's models gives now
    (`python -m zerocalc.hf.optrace` regenerates them)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from zerocalc.hf import optrace
    traced = optrace.family_steps()
    with open(optrace.FAMILY_STEPS) as f:
        committed = json.load(f)
    for key, c in traced.items():
        assert c == committed[key]
        family, attention = key.split("/")
        assert _as_hand_counts(c) == HAND_COUNTS[(family, attention)]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_neox", "olmo2",
                                        "stablelm", "qwen2_moe", "qwen3_moe", "deepseek_v3", "mixtral"])
def test_every_family_is_counted(model_type):
    """The counts come out for the families people train: both attentions where the model supports
    them (Gemma-2: eager only), a layer dispatching operators and doing FLOPs in every phase, the
    checkpointed backward more than the plain one (the recomputation)."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from zerocalc.hf import optrace
    kv_heads = 4 if model_type == "deepseek_v3" else 2      # MLA's SDPA call wants as many key heads as heads
    # DeepSeek-V3's first 3 layers are dense by default: a 2-layer config would have no MoE layer to count.
    extra = {"first_k_dense_replace": 0} if model_type == "deepseek_v3" else {}
    d = CONFIG_MAPPING[model_type](vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, intermediate_size=96, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra).to_dict()
    steps = optrace.config_steps(d, 2)
    assert "eager" in steps and ("sdpa" in steps or model_type == "gemma2")
    for attention in ("sdpa", "eager"):
        if attention not in steps:
            continue
        c = steps[attention]
        for phase in ("forward", "backward", "backward_checkpointed"):
            assert c[phase]["ops"][1] > 0 and c[phase]["flops_per_token"][1] > 0
        assert c["backward_checkpointed"]["ops"][1] > c["backward"]["ops"][1]
