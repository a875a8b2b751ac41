"""The validator's families as traced profiles of any size (`zerocalc.family`, `zerocalc/family_profiles.json`)
against arch.py's hand-written lists (`tests/hand_spec.py`), tensor by tensor and call by call; the
description a shipped model of a family's shape takes; the shape P alone is given."""
import json
import os
import random
import sys
from dataclasses import replace

import pytest

from zerocalc import arch as A
from zerocalc import family, profile as P, sequence
from zerocalc.model import from_architecture, from_profile
from zerocalc.training import Setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hand_spec import hand_spec, same_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _random_architectures(n: int, seed: int = 0):
    """Every family variant (tied or not, Llama's bias flags, grouped-query or not), 1 to 5 layers."""
    rng = random.Random(seed)
    for i in range(n):
        fam = ("seed-gpt", "hf-gpt2", "hf-llama")[i % 3]
        heads = rng.choice([1, 2, 3, 4, 6, 8])
        kv = heads if fam != "hf-llama" else rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
        head_dim = 2 * rng.randint(3, 12)   # a rotary table of d/2 > 2 elements: one of 8 bytes or less is
                                            # left out of the states, as the validator measures them
        yield A.Architecture(fam, rng.randint(5, 300), heads * head_dim, rng.randint(1, 5), heads, kv,
                             rng.randint(1, 200), rng.random() < 0.5, rng.randint(1, 300),
                             fam == "hf-llama" and rng.random() < 0.5, fam == "hf-llama" and rng.random() < 0.5)


@pytest.mark.parametrize("a", list(_random_architectures(60)), ids=str)
def test_a_family_profile_is_the_hand_transcription(a):
    assert same_model(from_architecture(a), hand_spec(a))


@pytest.mark.parametrize("name", ["seed-gpt", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b",
                                  "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "mistral-7b"])
def test_each_former_preset_is_its_shipped_profile_and_the_family(name):
    """The hand presets' sizes (arch.PRESETS) give the shipped profile's tensors and calls, and the
    shipped profile holds its family's data (stream, activations' formula). GPT-2 as published keeps its
    dropouts' masks: its checkpointed backward is recomputed from its last dropout (test_stage3_order.py),
    the dropout-free family's from its last module with parameters."""
    spec = from_profile(P.shipped_profile(name), name)
    want = hand_spec(A.PRESETS[name], name)
    if name.startswith("gpt2"):
        assert spec.checkpointed_backward_trace != want.checkpointed_backward_trace
        spec = replace(spec, checkpointed_backward_trace=want.checkpointed_backward_trace,
                       checkpointed_recomputed=want.checkpointed_recomputed)
    assert same_model(spec, want)
    assert spec.profile.source[family.FAMILY] == family.key(A.PRESETS[name])
    assert spec.profile.activations is None


def test_a_shipped_profile_is_recognised_as_its_familys_without_building_it_only_when_it_is():
    """`described` first compares the profile's JSON written out with the family's (`_written_alike`):
    that says "the same" only where the full comparison of tensors and traces does, and it says so for
    the Llama-2/3 and Mistral profiles (names of classes aside: MistralAttention is LlamaAttention)."""
    quick, full = set(), set()
    for name in P.shipped():
        p = P.shipped_profile(name)
        try:
            a = P.architecture(p)
            d = family._profile_json(a)
        except (ValueError, KeyError):
            continue
        if family._written_alike(p, d, P.expanded(d)):
            quick.add(name)
        if family._same_model(p, P.from_json(d)):
            full.add(name)
    assert quick <= full
    assert {"llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3.1-8b", "mistral-7b", "codestral-22b"} <= quick
    assert "gpt2" in full - quick            # its dropouts' masks: the traces decide (`_same_model`)


def test_a_profile_differing_from_its_family_only_in_a_class_name_or_a_shape_is_told_apart_rightly():
    """One module's class renamed: still the family's (no trace reads a class name). One tensor made a
    row longer: not (its parameter count differs), and the written-out comparison says so as well."""
    p = P.shipped_profile("llama-2-7b")
    a = P.architecture(p)
    d = family._profile_json(a)
    renamed = replace(p, modules=(p.modules[0]._replace(cls="SomeOtherModel"),) + p.modules[1:])
    assert family._written_alike(renamed, d, P.expanded(d))
    assert family.described(renamed).source[family.FAMILY] == family.key(a)
    first = p.params[0]
    longer = replace(p, params=(first._replace(shape=(first.shape[0] + 1, first.shape[1])),) + p.params[1:])
    assert not family._written_alike(longer, d, P.expanded(d))
    assert family.described(longer) is longer


def test_a_profile_written_out_is_its_json_expanded():
    for name in ("llama-2-7b", "mixtral-8x7b", "gpt2", "qwen3-8b"):
        p = P.shipped_profile(name)
        assert P.expanded(P.to_json(p)) == P.written_out(p)
        assert P.from_json(P.to_json(p)) == p


def test_a_model_no_family_builds_keeps_its_own_trace():
    """Qwen2.5-7B's q, k, v biases without o's are no family's: its traced stream and activations."""
    p = P.shipped_profile("qwen2.5-7b")
    spec = from_profile(p)
    assert family.FAMILY not in spec.profile.source and spec.profile is p
    assert sequence.step_stream(spec, Setup(seq_len=512)) is p.stream


def test_a_llama_shaped_profile_plays_the_familys_stream_and_gemma_2b_its_own():
    """Llama-3.1-8B: the family's polynomial stream (its stage-3 variant included); Gemma-2B, whose single
    key/value head no family stream covers, its own traced one; neither under eager (none traced)."""
    llama = from_profile(P.shipped_profile("llama-3.1-8b"))
    played = sequence.step_stream(llama, Setup(seq_len=512))
    assert played is family.streams()["hf-llama/sdpa/untied/grouped"] and "plain_zero3" in played
    assert sequence.step_stream(llama, Setup(seq_len=512, attention="eager")) is None
    gemma = P.shipped_profile("gemma-2b")
    spec = from_profile(gemma)
    assert spec.profile.source[family.FAMILY] == "hf-llama/tied"
    assert sequence.step_stream(spec, Setup(seq_len=512)) is gemma.stream


def test_the_seed_gpt_plays_its_eager_stream_whatever_the_attention():
    """nn.MultiheadAttention takes no attention setting: the seed's stream is its eager one under each."""
    spec = from_profile(P.shipped_profile("seed-gpt"))
    for attention in ("eager", "sdpa", "flash"):
        assert sequence.step_stream(spec, Setup(seq_len=512, attention=attention)) is \
            family.streams()["seed-gpt/eager/untied"]


def test_a_model_shallower_than_the_traced_stack_plays_its_own_depth():
    a = A.Architecture("hf-llama", 100, 64, 1, 4, 4, 96, False)
    assert family.stream(a, "sdpa") is family.streams()["hf-llama/sdpa/untied/1-layer"]
    assert family.stream(A.Architecture("hf-llama", 100, 64, 2, 4, 4, 96, True), "sdpa") is None   # none traced


def test_the_seed_gpts_attention_fetches_its_out_projection():
    """nn.MultiheadAttention reads out_proj's weight and bias without calling it; DeepSpeed fetches them
    with the attention (`trace.record`'s external reads): in_proj w, b and out_proj w, b in one step."""
    p = P.shipped_profile("seed-gpt")
    attn = next(m for m in p.modules if m.name == "blocks.0.attn")
    names = [p.params[i].name for i in attn.params + attn.external]
    assert names == ["blocks.0.attn.in_proj_weight", "blocks.0.attn.in_proj_bias",
                     "blocks.0.attn.out_proj.weight", "blocks.0.attn.out_proj.bias"]


def test_the_templates_name_each_size_by_one_expression():
    """Traced at V 1009, h 200, f 237, kv 40, d 8, P 67, 3 layers: every size is one of those, three
    times h (fused q, k, v) or d/2 (the rotary tables); the layers repeat "L" times."""
    with open(os.path.join(ROOT, "zerocalc", "family_profiles.json")) as f:
        templates = json.load(f)["families"]
    seen = set()

    def walk(items):
        for it in items:
            if isinstance(it, dict):
                assert it["repeat"] == "L"
                walk(it["items"])
            else:
                seen.update(it[1])
    for t in templates.values():
        walk(t["params"])
        walk(t["buffers"])
    assert seen == {"V", "h", "f", "kv", "3*h", "P", "d/2"}


@pytest.mark.parametrize("num_params", [2e5, 1e6, 7e7, 1.3e9, 7e9, 13e9, 70e9, 175e9, 1e12])
def test_the_shape_for_p_alone_is_the_hand_ones(num_params):
    assert family.generic(int(num_params)) == A.generic(int(num_params))


def test_the_shape_for_p_alone_by_hand():
    """7e9: L = round((7e9 / 196608)^(1/3)) = 33, h = 128·round(sqrt(7e9 / 396) / 128) = 4224, 33 heads,
    V 32000; P = 2·V·h + h + L·(4h² + 2h) + L·3h·f: 2,625,786,240 + 418,176·f, so f = 4,374,213,760 //
    418,176 = 10460, short of 7e9 by < 3·L·h."""
    a = family.generic(7_000_000_000)
    assert (a.num_layers, a.hidden_size, a.num_heads, a.vocab_size, a.ffn_hidden_size) == (33, 4224, 33, 32000, 10460)
    h, L, V, f = 4224, 33, 32000, 10460
    total = 2 * V * h + h + L * (4 * h * h + 2 * h) + L * 3 * h * f
    assert 0 <= 7_000_000_000 - total < 3 * L * h
    assert from_architecture(a).num_params == total


def test_a_familys_parameter_count_without_building_its_profile():
    """Llama, untied, V 32000, h 512, 4 layers, 8 heads of 64, 2 key/value heads (kv 128), FFN 1408:
    embeddings 32000·512 = 16,384,000 twice; a layer 2·512² + 2·512·128 + 3·512·1408 + 2·512 = 2,819,072;
    the final norm 512: 44,044,800. Every template gives what its built profile counts."""
    a = A.Architecture("hf-llama", 32000, 512, 4, 8, 2, 1408, False)
    assert family.param_count(a) == 2 * 16_384_000 + 4 * 2_819_072 + 512 == 44_044_800
    for key in family.templates():
        kind, *flags = key.split("/")
        b = A.Architecture(kind, 1000, 256, 3, 4, 4 if kind != "hf-llama" else 2, 700, flags[0] == "tied",
                           attention_bias="attention_bias" in flags, mlp_bias="mlp_bias" in flags)
        assert family.param_count(b) == family.profile(b).num_params, key


@pytest.mark.parametrize("path", sorted(p for p in os.listdir(os.path.join(ROOT, "tests", "data", "hub-configs"))))
def test_a_config_a_family_reads_is_read_as_by_hand(path):
    with open(os.path.join(ROOT, "tests", "data", "hub-configs", path)) as f:
        d = json.load(f)
    if not family.reads(d):
        return
    assert family.from_config(d) == A.from_hf_config(d)


def test_a_family_profile_has_no_traced_data_and_a_familys_key():
    p = family.profile(A.Architecture("hf-llama", 100, 64, 5, 4, 2, 96, False))
    assert p.activations is None and p.stream is None and p.steps is None
    assert p.source[family.FAMILY] == "hf-llama/untied"
    assert set(p.attentions) == {"sdpa"}          # the family's stream is traced under SDPA only
    assert p.dims["num_kv_heads"] == 2 and p.attentions["sdpa"]["stream"] is family.streams()[
        "hf-llama/sdpa/untied/grouped"]


@pytest.mark.parametrize("name, overrides", [("llama-2-7b", {"hidden_size": 2048}), ("seed-gpt", {"hidden_size": 1024}),
                                             ("gpt2", {"num_layers": 4, "tie_embeddings": False}),
                                             ("mistral-7b", {"num_kv_heads": 4, "ffn_hidden_size": 4096})])
def test_a_family_model_with_shape_flags_is_the_family_at_the_new_sizes(name, overrides):
    """Without torch, as the hand presets re-derived them (a new hidden size keeps FFN/hidden)."""
    from zerocalc import resolve
    spec = resolve.preset_spec(name, overrides)
    assert same_model(spec, hand_spec(A.preset(name, **overrides)))
    assert spec.profile.source[family.FAMILY] == family.key(A.preset(name, **overrides))
