"""The allocation stream recorded on fake tensors (`zerocalc.hf.memtrace`) against the transcribed
Llama layer (`tests/transcribed_sequence.py`: `_llama_forward`, written from the H200 allocator histories)."""
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerocalc import arch as A  # noqa: E402
from zerocalc import sequence  # noqa: E402
from zerocalc.hf import memtrace, optrace, trace  # noqa: E402
from zerocalc.training import Setup  # noqa: E402

import transcribed_sequence  # noqa: E402  (tests/: the hand-written layers, the oracle)

B, S, H, LAYERS, HEADS, KV_HEADS, F, V = 2, 64, 64, 2, 4, 2, 160, 128


def _traced_layer_kept():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, intermediate_size=F, max_position_embeddings=S)
    cfg._attn_implementation = "sdpa"
    model, mode = trace.build(cfg)
    with mode:
        ids = torch.zeros(B, S, dtype=torch.long)
    events = memtrace.record(model, mode, ids)
    live = {}
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e
        elif e[0] == "free":
            live.pop(e[1], None)
        elif e[0] == "exit" and e[1] == "model.layers.1":
            break
    return Counter(e[2] for e in live.values() if e[3].startswith("model.layers.1"))


def _transcribed_layer_kept():
    a = A.Architecture("hf-llama", V, H, LAYERS, HEADS, KV_HEADS, F, False, S)
    t = sequence._Trace()
    z = transcribed_sequence._LlamaSizes(a, Setup(seq_len=S, micro_batch=B, dtype="bf16"))
    out, kept = transcribed_sequence._llama_forward(t, z, t.alloc(z.h), keep_input=False)
    size = {e[1]: e[2] for e in t.events if e[0] == "alloc"}
    return Counter(size[h] for h in list(kept.values()) + [out])


def test_a_traced_llama_layer_keeps_the_transcribed_tensors_and_rmsnorms_rsqrt():
    """What one Llama layer keeps for backward (and its output), traced on fake tensors, equals the
    transcribed layer's, plus each RMSNorm's rsqrt: [tokens, 1] in fp32, 4 bytes per token, saved for
    the product's backward. The H200 histories have it (8192-byte blocks at 2 x 1024 tokens: 634 in
    `t4-warmup/hf-llama-h2048-l22-s2-...-60a8b990aa`); the transcription leaves it out."""
    tokens = B * S
    rsqrt = 4 * tokens
    assert _traced_layer_kept() == _transcribed_layer_kept() + Counter({rsqrt: 2})
    # by hand: fp32 norm input 4·T·h and its bf16 cast and product 2·2·T·h, twice; v and rotated k
    # 2·T·kv each; rotated q, attention output and the layer's output 2·T·h; SDPA's log-sum-exp 4·T·heads;
    # gate, SiLU, up, product 2·T·f each
    kv = KV_HEADS * H // HEADS
    by_hand = Counter()
    for n, count in ((4 * tokens * H, 2), (2 * tokens * H, 4 + 3), (2 * tokens * kv, 2), (4 * tokens * HEADS, 1),
                     (2 * tokens * F, 4), (rsqrt, 2)):
        by_hand[n] += count
    assert _traced_layer_kept() == by_hand


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_layers_kept_bytes_by_hand(attention):
    """Two Llama layers (h 64, 4 heads, 2 KV heads of 16, FFN 160), bf16, per token: each RMSNorm keeps
    its fp32 input 4h, bf16 cast and product 2·2h and rsqrt 4 (two norms); rotated q and the attention
    output 2·2h; v and rotated k 2·2kv; gate, SiLU, up, product 4·2f; SDPA its log-sum-exp 4·heads.
    Eager attention keeps rotated q 2h, K and V repeated to every head 2·2h (not the kv-wide ones),
    the softmax in fp32 and its bf16 copy, 6 bytes per head per query-key pair (B·s² per head), and
    the attention output made contiguous for o_proj 2h; no log-sum-exp."""
    h, kv, f, heads = 64, 32, 160, 4
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=h, num_hidden_layers=2, num_attention_heads=heads,
                                   num_key_value_heads=2, intermediate_size=f, max_position_embeddings=128)
    cfg._attn_implementation = attention
    model, mode = trace.build(cfg)
    got = memtrace.layer_activations(model, mode)
    norms = 2 * (4 * h + 2 * 2 * h + 4)
    mlp = 4 * 2 * f
    if attention == "sdpa":
        per_token = norms + 2 * 2 * h + 2 * 2 * kv + 4 * heads + mlp
        per_s2 = 0
    else:
        per_token = norms + 2 * h + 2 * 2 * h + 2 * h + mlp     # rotated q, K and V repeated, output
        per_s2 = 6 * heads
    assert got["bytes_per_token"] == 2 * per_token
    assert got["bytes_per_sequence_squared"] == 2 * per_s2


def test_two_shallow_copies_give_the_whole_stacks_kept_bytes():
    d = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=160, max_position_embeddings=128).to_dict()
    model, mode = trace.build(trace.hf_config(d))
    whole = memtrace.layer_activations(model, mode)
    shallow = memtrace.config_activations(d, 5)
    assert shallow["bytes_per_token"] == whole["bytes_per_token"] > 0
    assert shallow["bytes_per_sequence_squared"] == whole["bytes_per_sequence_squared"]


def test_a_shallow_copy_cuts_what_the_config_says_per_layer():
    """`memtrace._shallow` to 2 layers of a 4-layer config: the lists with one entry per layer (Cohere2-MoE's
    `layer_types` and `mlp_layer_types`, which its config class checks against the layer count, refusing
    a copy left at 4) and a table keyed by layer index cut to the first 2; the token ids, though as many
    as the layers, and lists of another length kept whole; a multimodal file's `text_config` cut."""
    small = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    d = transformers.Cohere2MoeConfig(**small, num_hidden_layers=4).to_dict()
    d.update(eos_token_id=[1, 2, 3, 4], per_layer_scale={"0": 1.0, "1": 2.0, "3": 4.0}, norm_layers=[0, 3])
    with pytest.raises(ValueError):
        trace.hf_config({**d, "num_hidden_layers": 2})
    cut = memtrace._shallow(d, 2)
    assert cut["num_hidden_layers"] == 2 and cut["layer_types"] == d["layer_types"][:2]
    assert cut["mlp_layer_types"] == d["mlp_layer_types"][:2] and trace.hf_config(cut).num_hidden_layers == 2
    assert cut["per_layer_scale"] == {"0": 1.0, "1": 2.0} and cut["eos_token_id"] == [1, 2, 3, 4]
    assert cut["norm_layers"] == [0, 3]
    both = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 4,
                                                     "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}}
    assert memtrace._shallow(both, 2)["text_config"]["layer_types"] == ["sliding_attention"] * 2
    assert "num_hidden_layers" not in memtrace._shallow(both, 2)


def test_the_heads_kept_bytes_by_hand():
    """Per token: Llama's final RMSNorm keeps its fp32 input 4h, rsqrt 4, cast and product 2·2h (the
    product is lm_head's input); Gemma-2's norm computes in fp32 (fp32 input 4h, rsqrt 4, the fp32
    normalised 4h, its bf16 output 2h) and the soft-capping keeps tanh over the vocabulary 2V; the
    fp32 (1 + weight) of h is a per-model constant: 4h bytes over the 64 traced tokens."""
    h, v, tokens = 64, 128, 64
    d = transformers.LlamaConfig(vocab_size=v, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=160, max_position_embeddings=128).to_dict()
    assert memtrace.config_activations(d, 2)["head_bytes_per_token"] == 4 * h + 4 + 2 * 2 * h
    d = transformers.Gemma2Config(vocab_size=v, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=160, max_position_embeddings=128,
                                  final_logit_softcapping=30.0).to_dict()
    assert memtrace.config_activations(d, 2)["head_bytes_per_token"] == 4 * h + 4 + 4 * h + 2 * h + 2 * v + 4 * h / tokens


def test_a_tied_embeddings_two_gradients_are_summed_into_a_new_tensor():
    """A tied Llama (vocabulary 100, hidden 64: 12,800 bytes a bf16 [V, h] gradient, a size no other
    tensor of the step has): in backward three
    vocabulary-sized tensors are made, the head's weight gradient (the output projection's, arriving
    through the weight's transpose: a view), the embedding's, and their sum, new because the first is a
    view (its base also holds the storage, so `InputBuffer` cannot add in place); both inputs die and
    the sum is handed on once. Untied, each weight's one gradient is handed on as it is: two made."""
    vocab = 100
    vh = vocab * H * 2
    for tied, made in ((True, 3), (False, 2)):
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                                       num_key_value_heads=KV_HEADS, intermediate_size=F, max_position_embeddings=S,
                                       tie_word_embeddings=tied)
        cfg._attn_implementation = "sdpa"
        model, mode = trace.build(cfg)
        events = memtrace.record_step(model, mode, B, S)
        back = events[events.index(("phase", "backward")):]
        made_vh = [e[1] for e in back if e[0] == "a" and e[2] == vh]
        assert len(made_vh) == made, tied
        handed = {e[1]: e[2] for e in back if e[0] == "g" and e[2] in made_vh}   # parameter -> handle
        freed = {e[1] for e in back if e[0] == "f"}
        if tied:    # the embedding (parameter 0, the head's weight too) gets the sum; its two inputs die
            assert handed == {0: made_vh[2]} and set(made_vh[:2]) <= freed
        else:       # the head (the last parameter) first, then the embedding
            assert handed == {len(list(model.parameters())) - 1: made_vh[0], 0: made_vh[1]}


def test_a_model_without_sdpa_is_traced_under_sdpa_as_its_modules_dispatch_it():
    """Gemma-2's class refuses SDPA here (its soft-capping); transformers 5.17 ran it when asked, the
    soft-cap ignored, and the H200 rows so measured kept no attention probabilities. Traced under
    SDPA (`memtrace.dispatching`) its layers keep nothing that grows as s² per sequence, where the
    eager trace keeps the probabilities; the model's own attention is restored after."""
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "zerocalc", "hf", "configs", "gemma-2-2b.json")) as f:
        d = json.load(f)
    d.update(vocab_size=V, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16,
             query_pre_attn_scalar=16, intermediate_size=F, num_hidden_layers=1)
    eager = memtrace.config_activations(d, 1)
    sdpa = memtrace.config_activations(d, 1, attention="sdpa")
    assert eager["bytes_per_sequence_squared"] > 0 and sdpa["bytes_per_sequence_squared"] == 0
    assert sdpa["bytes_per_token"] < eager["bytes_per_token"] + eager["bytes_per_sequence_squared"] * 64
    model, mode = trace.build(trace.hf_config(d))
    with memtrace.dispatching(model, "sdpa"):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager"


# A Phi-3.5-style config: LongRoPE's rotary embedding with head dim 64 / 4 = 16 (8 frequencies)
LONGROPE = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256,
            "original_max_position_embeddings": 32, "pad_token_id": 0,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}


def test_the_step_recorded_is_one_after_the_first():
    """LongRoPE's rotary embedding (Phi-3.5-mini, Phi-4-mini) makes its long inverse frequencies on its
    first forward and keeps them (transformers' `longrope_frequency_update`): that step allocates 8
    tensors more than every later one, the long factor (8 fp32, 32 B), arange(0, 16, 2) (8 int64,
    64 B), its fp32 cast, the division by the head dim, the base's power, the factor times it, its
    reciprocal and the frequencies (32 B each), and frees all but the frequencies: 8 allocations and
    7 frees. Fitted over `STREAM_SHAPES`, the first shape's step alone would hold them and the stream
    would not fit; the operator counts would differ between the plain forward (first) and the
    checkpointed one (second). Each recorder runs a step it does not record first (`WARM_UP`)."""
    model, mode = trace.build(trace.hf_config(LONGROPE))
    steps = [memtrace.record_step(model, mode, 2, 16) for _ in range(3)]
    sizes = [Counter(e[2] for e in events if e[0] == "a") for events in steps]
    assert sizes[0] - sizes[1] == Counter({32: 7, 64: 1}) and not sizes[1] - sizes[0]
    assert len(steps[0]) - len(steps[1]) == 8 + 7
    assert steps[1] == steps[2]                 # from the second step on, every step is alike
    assert memtrace.step_stream(LONGROPE)["layers"] == 2
    counts = optrace.config_steps(LONGROPE, 2)
    assert counts["sdpa"]["forward"]["ops"][0] > 0
