"""A traced model's allocation stream (`zerocalc.hf.memtrace.step_stream`, played by
`zerocalc.sequence._TracedStep`) against the hand-written Llama sequence (`tests/transcribed_sequence.py`) and
the recorded H200 allocator histories (`data/snapshots/`): the transcription is the oracle."""
import os
from dataclasses import asdict, replace
from functools import lru_cache
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerocalc import allocator, sequence  # noqa: E402
from zerocalc import arch as A  # noqa: E402
from zerocalc.hf import memtrace, trace  # noqa: E402
from zerocalc.training import Setup, Stage  # noqa: E402

import history_jobs  # noqa: E402
import played_step  # noqa: E402
import transcribed_sequence  # noqa: E402  (tests/: the hand-written layers, the oracle)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S, H, HEADS, KV_HEADS, F, V = 2, 64, 64, 4, 2, 160, 128


def _tiny_llama(layers):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, intermediate_size=F, max_position_embeddings=S)
    cfg._attn_implementation = "sdpa"
    return cfg


def _segments(layers, checkpointing):
    """The raw stream of a tiny Llama at B x S, cut into segments (`memtrace._canonical`)."""
    model, mode = trace.build(_tiny_llama(layers))
    from transformers.modeling_layers import GradientCheckpointingLayer
    params = list(model.parameters())
    pid = {id(p): i for i, p in enumerate(params)}
    lp = [[pid[id(p)] for p in m.parameters()] for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    events = memtrace.record_step(model, mode, B, S, checkpointing)
    return memtrace._canonical(events, layers, {p: i for i, ps in enumerate(lp) for p in ps}, len(params),
                               lp[0][0], len(lp[0]))


def _as_sizes(segs, name):
    """A segment's allocations and frees as ("a", bytes) / ("f", bytes of the freed tensor)."""
    sizes = {}
    for seg, evs in segs.items():
        j = 0
        for e in evs:
            if e[0] == "a":
                sizes[(seg, j)] = e[1]
                j += 1
    out = []
    for e in segs[name]:
        if e[0] == "a":
            out.append(("a", e[1]))
        elif e[0] == "f":
            where, j = e[1].rsplit(":", 1)
            if "~" in where:
                kind, delta = where.split("~")
                where = f"{kind}{int(name[1:]) + int(delta)}"
            out.append(("f", sizes[(where, int(j))]))
    return out


def _transcribed(checkpointing):
    a = A.Architecture("hf-llama", V, H, 4, HEADS, KV_HEADS, F, False, S)
    t = sequence._Trace()
    z = transcribed_sequence._LlamaSizes(a, Setup(seq_len=S, micro_batch=B, dtype="bf16"))
    x = t.alloc(z.h)
    start = len(t.events)
    if checkpointing:
        transcribed_sequence._llama_forward_unsaved(t, z, x)
    else:
        transcribed_sequence._llama_forward(t, z, x, keep_input=False)
    sizes = {e[1]: e[2] for e in t.events if e[0] == "alloc"}
    return [("a", e[2]) if e[0] == "alloc" else ("f", sizes[e[1]]) for e in t.events[start:]]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_traced_llama_layers_forward_is_the_transcribed_one_and_its_rmsnorms_per_token_scalars(checkpointing):
    """A middle layer's forward (F1: from its call to the next layer's; the layer's input freed when
    it returns, as `_llama_forward` frees it) allocates and frees exactly what the transcription does,
    in its order, plus three fp32 scalars per token in each RMSNorm (4·T bytes each: the mean of
    squares, it plus eps, the rsqrt, which is kept without checkpointing): 512 B at 2 x 64 tokens. On
    the GPU they are small-pool blocks (4·T ≤ 1 MiB up to 262,144 tokens); the transcription leaves
    them out."""
    scalar = 4 * B * S
    traced = _as_sizes(_segments(4, checkpointing), "F1")
    assert [e for e in traced if e[1] != scalar] == _transcribed(checkpointing)
    # the scalars: two RMSNorms, each makes three and frees two in forward (checkpointed: all three)
    assert sum(1 for e in traced if e == ("a", scalar)) == 2 * 3
    assert sum(1 for e in traced if e == ("f", scalar)) == 2 * (3 if checkpointing else 2)


def test_sizes_are_solved_as_integer_polynomials():
    """k·(1, s, B·s, B·s², B, s²) at B = 2, 3 and s = 16, 32, 48: 7 + 3s + 5Bs + 2Bs² + 8B + s² is
    1511, 5559, 12167, 2111, 7775 and 17023 there, solved back to (7, 3, 5, 2, 8, 1); an fp32 [B, s]
    tensor to (0, 0, 4); a bool [1, 1, s, s] mask to (0, 0, 0, 0, 0, 1); a size that is no such
    polynomial fails."""
    assert [7 + 3 * s + 5 * b * s + 2 * b * s * s + 8 * b + s * s for b, s in memtrace.STREAM_SHAPES] == \
        [1511, 5559, 12167, 2111, 7775, 17023]
    assert memtrace._fit([1511, 5559, 12167, 2111, 7775, 17023]) == [7, 3, 5, 2, 8, 1]
    assert memtrace._fit([4 * b * s for b, s in memtrace.STREAM_SHAPES]) == [0, 0, 4]
    assert memtrace._fit([s * s for b, s in memtrace.STREAM_SHAPES]) == [0, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        memtrace._fit([1, 2, 4, 3, 5, 7])


@lru_cache(maxsize=None)
def _stream(layers_key):
    return memtrace.step_stream(_tiny_llama(4).to_dict(), "sdpa")


@pytest.mark.slow   # traces the stream (8 fake-tensor steps) and a 6-layer model
@pytest.mark.xdist_group("tiny-llama-stream")   # both on one worker, which traces the stream once
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_deeper_model_plays_the_middle_layers_again_event_for_event(checkpointing):
    """The 4-layer stream played for 6 layers at another shape (B 2, s 24) is the 6-layer model's own
    trace: every allocation's bytes, every free, every gradient handed to the optimizer, in order."""
    _assert_plays_as_traced(_stream(4), _tiny_llama(6), 6, checkpointing)


@pytest.mark.slow   # traces the stream (8 fake-tensor steps)
@pytest.mark.xdist_group("tiny-llama-stream")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_what_a_layer_keeps_beyond_the_trace_is_held_from_its_forward_to_its_backwards_end(checkpointing):
    """A stream's `kept_bytes_per_token_beyond_trace` (`memtrace.at_length`), 1001 B a token at B 2,
    s 24, is one allocation of 48,048 B (a size no tensor of the tiny Llama has) a layer: made after the
    layer's forward and freed after its backward, every layer's alive at once at the end of forward;
    checkpointed, made before the layer's backward (its recompute) and freed after it, one at a time.
    Every other event, and the gradients, are the stream's without it."""
    stream = _stream(4)
    spec = SimpleNamespace(profile=SimpleNamespace(stream=stream), architecture=SimpleNamespace(num_layers=6),
                           param_numels=(1,) * 100)
    setup = SimpleNamespace(activation_checkpointing=checkpointing, micro_batch=2, seq_len=24, attention="sdpa",
                            stage=Stage.GRADIENTS)
    plain, grads = played_step.played(spec, setup, stream)
    more, more_grads = played_step.played(spec, setup, {**stream, "kept_bytes_per_token_beyond_trace": 1001})
    extra = 1001 * 2 * 24
    assert ("a", extra) not in plain

    def numbered(events):     # allocation n has handle n (`sequence._Trace`): frees named by their allocation
        handles = [n + 1 for n, e in enumerate(x for x in events if x[0] == "a")]
        return [("a", e[1], handles.pop(0)) if e[0] == "a" else e for e in events]
    more = numbered(more)
    held = {e[2] for e in more if e[:2] == ("a", extra)}
    order = [e for e in more if e[0] == "a" and e[2] in held or e[0] == "f" and e[1] in held]
    if checkpointing:
        assert [e[0] for e in order] == ["a", "f"] * 6
    else:
        assert [e[0] for e in order] == ["a"] * 6 + ["f"] * 6
        assert [e[1] for e in order[6:]] == [e[2] for e in order[:6]][::-1]     # the last layer's first
    rest = [e for e in more if e not in order]
    kept = [e[2] for e in rest if e[0] == "a"]
    assert [("a", e[1]) if e[0] == "a" else ("f", kept.index(e[1]) + 1) for e in rest] == plain
    assert sorted((kept.index(h) + 1, p) for h, p in more_grads) == grads


def _assert_plays_as_traced(stream, config, layers: int, checkpointing: bool) -> None:
    """`stream` played for `layers` layers at B 2, s 24 is the `config` model's own trace, event for event."""
    model, mode = trace.build(config)
    raw = memtrace.record_step(model, mode, 2, 24, checkpointing)
    spec = SimpleNamespace(profile=SimpleNamespace(stream=stream), architecture=SimpleNamespace(num_layers=layers),
                           param_numels=(1,) * len(list(model.parameters())))
    setup = SimpleNamespace(activation_checkpointing=checkpointing, micro_batch=2, seq_len=24, attention="sdpa",
                            stage=Stage.GRADIENTS)
    assert played_step.played(spec, setup) == played_step.recorded(raw)


def _tiny_deepseek(layers):
    """DeepSeek-V3 at toy size: latent attention (query and key head dims 12, value 8), one leading
    dense layer, then MoE layers of 4 experts (top 2) and a shared one."""
    return transformers.DeepseekV3Config(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
                                         num_key_value_heads=HEADS, intermediate_size=F, moe_intermediate_size=32,
                                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                                         qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=S)


@pytest.mark.slow   # traces the stream (12 fake-tensor steps of 5 layers) and a 7-layer model
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_leading_dense_layer_is_traced_beside_the_repeated_ones(checkpointing):
    """A stack whose first layer is dense and the rest MoE (`first_k_dense_replace`) is traced at 1 + 4
    layers (`leading_layer_params`: the dense layer's parameter count); played for 7 layers at another
    shape it is the 7-layer model's own trace, event for event, every gradient handed for its own
    parameter. Its attention, query and value head dims unequal, runs as the fused kernel
    (`cudaops`), not the CPU's math path."""
    stream = memtrace.step_stream(_tiny_deepseek(7).to_dict(), "sdpa")
    assert stream["layers"] == 5 and len(stream["leading_layer_params"]) == 1
    _assert_plays_as_traced(stream, _tiny_deepseek(7), 7, checkpointing)


def _tiny_afmoe(layers, dense=1, full_every=100):
    """AFMoE (Arcee) at toy size: its leading dense layers under its own key (`num_dense_layers`), MoE
    layers of 4 experts (top 2) and a shared one, sliding-window attention but every `full_every`-th
    layer."""
    return transformers.AfmoeConfig(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
                                    num_key_value_heads=KV_HEADS, head_dim=H // HEADS, intermediate_size=F,
                                    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                    num_dense_layers=dense, global_attn_every_n_layers=full_every, sliding_window=S,
                                    max_position_embeddings=S)


@pytest.mark.slow   # traces the stream (12 fake-tensor steps of 5 layers) and a 7-layer model
def test_the_dense_layers_an_moe_stack_leads_with_are_read_from_the_model_whatever_their_key():
    """`memtrace.stack` counts the layers before the first with an MoE block, as built: DeepSeek's
    `first_k_dense_replace` 1, AFMoE's `num_dense_layers` 1 and 2, none in a dense Llama. With 2 dense
    layers the kept bytes are traced on copies of 3 and 4 layers and equal the whole 7-layer model's
    (read from copies of 1 and 2 layers, both dense, they would be 1.5% short); the stream, traced at 1 + 4 layers,
    plays for 7 layers as the 7-layer model's own trace, event for event."""
    assert memtrace.stack(_tiny_deepseek(7).to_dict()) == (7, 1)
    assert memtrace.stack(_tiny_afmoe(7).to_dict()) == (7, 1)
    assert memtrace.stack(_tiny_afmoe(7, dense=2).to_dict()) == (7, 2)
    assert memtrace.stack(_tiny_llama(7).to_dict()) == (7, 0)
    model, mode = trace.build(_tiny_afmoe(7, dense=2))
    whole = memtrace.layer_activations(model, mode)
    shallow = memtrace.config_activations(_tiny_afmoe(7, dense=2).to_dict(), 7)
    assert shallow["traced_layers"] == [3, 4]
    for key in ("bytes_per_token", "bytes_per_sequence_squared"):
        assert shallow[key] == pytest.approx(whole[key], abs=0.01)
    stream = memtrace.step_stream(_tiny_afmoe(7).to_dict(), "sdpa")
    assert stream["layers"] == 5 and len(stream["leading_layer_params"]) == 1
    _assert_plays_as_traced(stream, _tiny_afmoe(7), 7, checkpointing=True)


@pytest.mark.slow   # traces an 8-layer model's stream, activations and operators
def test_a_stream_that_does_not_play_as_the_whole_model_is_left_out_with_the_reason(monkeypatch):
    """Where the stream is traced on a copy whose middle layer is not every layer's (AFMoE's every
    fourth layer attends to the whole sequence, the others within a window; here the layers' period
    forced to 1, as if it were not read) it cannot be played as the whole model: the trace finds that
    by playing the stream at stages 2 and 3 (`trace._unplayable`) and leaves it out, saying why; the
    estimate takes the calibrated ratio and says so, rather than failing."""
    from click.testing import CliRunner
    from zerocalc import resolve
    from zerocalc.cli import main
    from zerocalc.model import from_profile
    monkeypatch.setattr(memtrace, "period", lambda d, attention=None: 1)
    d = _tiny_afmoe(8, full_every=4).to_dict()
    p = trace.trace(d)
    assert p.stream is None and p.source["untraced"]["stream"].startswith("it does not play as the whole model (")
    assert p.activations and p.steps and all(v["stream"] is None for v in (p.attentions or {}).values())
    spec = from_profile(p)
    assert sequence.step_stream(spec, Setup(seq_len=64)) is None
    assert "reserved: the calibrated ratio (its allocation stream could not be traced: it does not play" \
        in " ".join(resolve.notes(spec, [Setup(seq_len=64)]))


def test_a_deeper_model_plays_each_layer_as_a_traced_one_of_its_kind():
    """Hand-worked: a stream traced on 10 layers of a model of 22 whose layers repeat a pattern of 4
    (Qwen3-Next: layers 3, 7, 11, ... attend to the whole sequence, the others are linear): layers 0-3
    as traced (the first of each kind), 4-19 as traced layers 4-7 by their place in the pattern (19,
    a full-attention layer, as 7), 20 and 21 as the copy's last two, 8 and 9. The copy is 10 layers
    deep (the least past 2 periods and the last two, `STREAM_LAYERS`) for 22 (22 - 10 = 3 periods),
    12 for 48 (its last layer, 47, full-attention as the copy's 11); of 48 layers, 4-45 are played as
    the copy's 6-9, the period before its last two, by their place (4 as 8; 7, full-attention, as 7;
    45 as 9). Period 1 keeps the rule:
    layers 0, 1 as traced, the middle as layer 1, the last two as the copy's."""
    assert memtrace.stream_depth(22, 0, 4) == 10 and memtrace.stream_depth(48, 0, 4) == 12
    assert memtrace.stream_depth(30, 1, 1) == 5 and memtrace.stream_depth(8, 0, 8) == 8
    assert [sequence.played_as(i, 22, 10, 0, 4) for i in range(22)] == \
        [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9]
    assert [sequence.played_as(i, 48, 12, 0, 4) for i in (3, 4, 5, 6, 7, 44, 45, 46, 47)] == [3, 8, 9, 6, 7, 8, 9, 10, 11]
    assert [sequence.played_as(i, 9, 5, 1, 1) for i in range(9)] == [0, 1, 2, 2, 2, 2, 2, 3, 4]


def test_a_shallow_copy_ends_with_a_layer_like_the_model_s_last():
    """Hand-worked (`memtrace._ending_alike`): a 30-layer config whose every sixth layer attends to the
    whole sequence with wider heads (Gemma 4's `layer_types` and per-layer table: layers 5, 11, ..., 29)
    is copied at most 24 deep to 24 (layer 23 full, as 29), at most 20 deep to 18, at most 8 deep to 6;
    one without per-layer lists at the depth asked."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    d = {"num_hidden_layers": 30, "layer_types": types, "per_layer_config": {f"{i:02d}": {"head_dim": 512} for i in range(5, 30, 6)}}
    assert [memtrace._ending_alike(d, n, 30) for n in (24, 20, 8)] == [24, 18, 6]
    assert memtrace._ending_alike({"num_hidden_layers": 30}, 20, 30) == 20


def _tiny_qwen3_next(layers):
    """Qwen3-Next at toy size: three linear-attention (gated delta rule) layers to one full-attention
    layer, each with an MoE block of 4 experts (top 2) and a shared one; the two kinds hold different
    parameters."""
    return transformers.Qwen3NextConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=16, intermediate_size=F, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=S)


@pytest.mark.slow   # traces a 16-layer model's stream (14 fake-tensor steps of 12 layers) and itself
@pytest.mark.parametrize("checkpointing", [False, True])
def test_layers_of_two_kinds_are_traced_a_pattern_at_a_time(checkpointing):
    """Qwen3-Next's layers repeat a pattern of 4 (`memtrace.period`, read from their events), so a
    16-layer model is traced on copies that hold whole periods: its kept bytes from copies of 4 and 8
    layers (the last layer full-attention in both, as in the model) equal the whole model's, and its
    stream, traced on 12 layers (the first period as traced, two more layers to put the copy's last
    where the model's is, the period played for every middle layer, the last two), plays for 16 at
    another shape as the 16-layer model's own trace, event for event, every gradient handed for its
    own parameter (linear-attention layers hold more tensors than full ones). Repeating one middle
    layer, as for layers all alike, the kept bytes came out 5% over on the default config cut to 8
    layers (every layer counted as a linear one)."""
    d = _tiny_qwen3_next(16).to_dict()
    assert memtrace.period(d) == 4
    model, mode = trace.build(_tiny_qwen3_next(16))
    whole = memtrace.layer_activations(model, mode)
    shallow = memtrace.config_activations(d, 16)
    assert shallow["traced_layers"] == [4, 8]
    for key in ("bytes_per_token", "bytes_per_sequence_squared"):
        assert shallow[key] == pytest.approx(whole[key], abs=0.01)
    stream = memtrace.step_stream(d, "sdpa")
    assert stream["layers"] == 12 and stream["period"] == 4 and len(set(stream["period_params"])) == 2
    _assert_plays_as_traced(stream, _tiny_qwen3_next(16), 16, checkpointing)


@pytest.mark.slow   # fake-tensor forwards of a 16-layer model at up to 1536 tokens
def test_a_chunked_kernels_kept_bytes_are_read_past_one_chunk():
    """Qwen3-Next's gated delta rule pads a sequence to whole 64-token chunks, so at 32 and 64 tokens
    (one chunk, as the stream's 16-48) its chunk-shaped tensors look constant and the layers seem to
    keep less per token. `memtrace.at_length` reads them at 512 and 1024 tokens: that slope gives the
    kept bytes at 1536 tokens (24 chunks, measured here on the model itself) where the short one falls
    more than 10% short, and the difference per layer is what the stream is told to add. A Llama keeps
    as much per token at every length: its activations and stream are left as they were."""
    cfg = _tiny_qwen3_next(16)
    d = cfg.to_dict()
    short = memtrace.config_activations(d, 16)
    acts, stream = memtrace.at_length(d, 16, short, {"layers": 12})
    model, mode = trace.build(cfg)
    memtrace.layers_kept_bytes(model, mode, 1, 32)          # the first forward, not counted
    at_1536 = memtrace.layers_kept_bytes(model, mode, 1, 1536)
    assert acts["bytes_per_token"] * 1536 == pytest.approx(at_1536, rel=0.01)
    assert short["bytes_per_token"] * 1536 < 0.9 * at_1536
    assert stream == {"layers": 12, "kept_bytes_per_token_beyond_trace":
                      pytest.approx((acts["bytes_per_token"] - short["bytes_per_token"]) / 16, abs=0.001)}
    llama = _tiny_llama(4).to_dict()
    plain = memtrace.config_activations(llama, 4)
    assert memtrace.at_length(llama, 4, plain, {"layers": 4}) == (plain, {"layers": 4})


LLAMA_HISTORIES = [   # tests/test_sequence.py's FRESH_HISTORIES of hf-llama, and what they reserved (GiB)
    ("t4-warmup/hf-llama-h768-l12-s2-bf16-n1-b1x2048-gas1-0d2548528e", 3.455),
    ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n2-b2x1024-gas1-a948bae5f0", 18.561),
    ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n1-b8x2048-gas1-0729e40f46", 28.691),
    ("t4-warmup/hf-llama-h2048-l22-s3-bf16-n2-b2x1024-gas1-5cba866319", 20.037),
    ("t6-overlap/hf-llama-h2048-l22-s2-bf16-n2-b2x1024-gas1-6e214b72b6", 18.363),
    ("t6-overlap/hf-llama-h2048-l22-s1-bf16-n2-b4x1024-gas1-e2b1e2817c", 21.660),
]


@lru_cache(maxsize=None)
def _llama_stream(arch):
    _, cfg, _ = __import__("zerocalc.hf.families", fromlist=["_hf_config"])._hf_config(asdict(arch), "sdpa")
    return memtrace.step_stream(cfg.to_dict(), "sdpa")


@pytest.mark.slow   # traces two Llamas and replays full-size jobs
@pytest.mark.xdist_group("committed")   # with the other readers of the committed rows: one worker reads and traces once
@pytest.mark.parametrize("name, recorded_gib", LLAMA_HISTORIES)
def test_the_traced_llama_reproduces_the_recorded_histories(name, recorded_gib):
    """The Llama histories the transcription reproduces to 0.1% (`tests/test_sequence.py`), generated
    from the traced stream of the same model in place of the transcribed layer: the same to 0.1%."""
    from validate import snapshot
    from validate.jobs import to_zerocalc
    job = history_jobs.job(name)
    job["arch"] = {k: (False if v is None and k.endswith("_bias") else v) for k, v in job["arch"].items()}
    spec, s = to_zerocalc(job)
    own = _llama_stream(spec.architecture)
    traced = replace(spec, profile=replace(spec.profile, attentions={"sdpa": {"activations": None, "stream": own}}))
    assert sequence.step_stream(traced, s) is own and sequence.generated(traced, s)
    snap = snapshot.load(os.path.join(ROOT, "data", "snapshots", name + ".json.gz"))
    history = snap["device_traces"][0]
    recorded = allocator.replay(snapshot.allocator_events(history),
                                segment_addresses=snapshot.segment_addresses(history)).peak_reserved_bytes
    assert recorded / 2**30 == pytest.approx(recorded_gib, abs=0.001)
    generated = allocator.replay(sequence.events(traced, s, steps=2)).peak_reserved_bytes
    assert abs(generated / recorded - 1) <= 0.001
