"""The transcribed families' streams (`zerocalc/family_streams.json`, `zerocalc.hf.familystream`: sizes
integer polynomials in B, s and the model's dimensions) against the hand-written layers they replaced
(`tests/transcribed_sequence.py`, the oracle, written from the H200 allocator histories) and against a
fresh trace at dimensions they were not solved from. The histories themselves: `tests/test_sequence.py`."""
import random

import pytest

from zerocalc import sequence
from zerocalc.arch import Architecture, preset
from zerocalc.model import from_architecture
from zerocalc.training import OPTIMIZERS, Setup, Stage

import played_step
import transcribed_sequence as oracle

# (family, vocabulary, hidden, heads, kv heads, FFN): the 1.4B GPT and 1.1B Llama of the histories,
# Llama 2 7B's and Llama 3 70B's widths (grouped-query attention), and small odd ones.
DIMS = [("seed-gpt", 50257, 2048, 16, 16, 8192), ("seed-gpt", 97, 40, 5, 5, 136),
        ("hf-llama", 32000, 2048, 32, 4, 5632), ("hf-llama", 32000, 4096, 32, 32, 11008),
        ("hf-llama", 128256, 8192, 64, 8, 28672), ("hf-llama", 101, 48, 6, 3, 100)]


def _arch(dims, layers=4, tie=False):
    family, v, h, heads, kv, f = dims
    return Architecture(family, v, h, layers, heads, kv, f, tie)


def _setup(micro_batch=2, seq_len=1024, **kw):
    return Setup(optimizer=OPTIMIZERS["adamw"], dtype="bf16", seq_len=seq_len, micro_batch=micro_batch,
                 attention="sdpa", **kw)


def _segment(arch, setup, name, variant="plain"):
    """A segment of the family's stream at these dimensions: ("a", bytes) per allocation, ("f", bytes
    of the freed tensor) per free of the segment's own tensors, ("f", "other") of another segment's."""
    st = sequence.step_stream(from_architecture(arch), setup)
    x = sequence.basis_values(st["basis"], setup.micro_batch, setup.seq_len, arch)
    sizes, out = [], []
    for e in sequence._compiled(st, variant, name):
        if e[0] == "a":
            sizes.append(sum(c * v for c, v in zip(e[1], x)))
            out.append(("a", sizes[-1]))
        elif e[0] == "f":
            where, _, _, j = e[1]
            out.append(("f", sizes[j] if where is None else "other"))
    return out


def _as_sizes(t, start):
    """The events from `start` on as `_segment` gives them: a free of a tensor made before `start`
    (the layer's input) as ("f", "other")."""
    sizes = {e[1]: e[2] for e in t.events[start:] if e[0] == "alloc"}
    return [("a", e[2]) if e[0] == "alloc" else ("f", sizes.get(e[1], "other"))
            for e in t.events[start:] if e[0] in ("alloc", "free")]


@pytest.mark.parametrize("dims", [d for d in DIMS if d[0] == "seed-gpt"])
@pytest.mark.parametrize("micro_batch, seq_len", [(2, 1024), (3, 100)])
def test_a_seed_gpt_layers_forward_is_the_transcribed_one(dims, micro_batch, seq_len):
    """A middle layer's forward (F1) at stages 0-2 allocates and frees exactly what the transcription of
    the 1.4B GPT's history does (`_SeedGpt._forward_linear`), in its order, at every width: three
    LayerNorms with fp32 mean and rstd, the projections' contiguous input copies and outputs (the bias
    added in place), the scaled q, the scores and softmax, the context copy, out_proj, the
    need_weights average, the residual, ln2, fc1, GELU, fc2 and the output."""
    arch, setup = _arch(dims), _setup(micro_batch, seq_len)
    t = sequence._Trace()
    layer = oracle._SeedGpt(t, arch, setup)
    x = t.alloc(layer.th)
    layer._forward_linear(x)
    assert _segment(arch, setup, "F1") == _as_sizes(t, 1)


@pytest.mark.parametrize("dims", [d for d in DIMS if d[0] == "hf-llama"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_llama_layers_forward_is_the_transcribed_one_and_its_rmsnorms_per_token_scalars(dims, checkpointing):
    """A middle layer's forward (F1; the layer's input freed when it returns, as `_llama_forward` frees
    it) is the transcription's allocation for allocation at every width, grouped-query or not, plus
    three fp32 scalars per token in each RMSNorm (4·T bytes: the mean of squares, it plus eps, the
    rsqrt, kept without checkpointing), which the transcription leaves out (small-pool blocks up to
    262,144 tokens; the histories have the rsqrt: `tests/test_memtrace.py`)."""
    arch, setup = _arch(dims), _setup(2, 1024, activation_checkpointing=checkpointing)
    scalar = 4 * 2 * 1024
    t = sequence._Trace()
    z = oracle._LlamaSizes(arch, setup)
    x = t.alloc(z.h)
    if checkpointing:
        oracle._llama_forward_unsaved(t, z, x)
    else:
        oracle._llama_forward(t, z, x, keep_input=False)
    got = _segment(arch, setup, "F1", "checkpointed" if checkpointing else "plain")
    want = _as_sizes(t, 1)
    assert [e for e in got if e[1] != scalar] == [e for e in want if e[1] != scalar]
    assert sum(1 for e in got if e == ("a", scalar)) == 2 * 3


def test_every_configuration_the_transcription_generated_is_generated():
    """The families' streams cover what the hand-written layers did: seed-gpt whatever the attention
    setting, the Llama with SDPA, tied or not, at stages 0-3 and with checkpointing (stage 3 plays the
    variant traced with DeepSpeed's linear); a Llama with eager attention or biases, and one head, are
    not (no stream: the calibrated ratio)."""
    for name in ("seed-gpt", "llama-2-7b", "llama-3-8b"):
        for tie in (False, True):
            model = from_architecture(preset(name, tie_embeddings=tie))
            for stage in (0, 1, 2, 3):
                for ckpt in (False, True):
                    s = _setup(1, 512, stage=Stage(stage), activation_checkpointing=ckpt)
                    assert sequence.generated(model, s), (name, tie, stage, ckpt)
    s = _setup(1, 512, stage=Stage(2))
    eager = Setup(optimizer=OPTIMIZERS["adamw"], dtype="bf16", seq_len=512, micro_batch=1, attention="eager")
    assert sequence.generated(from_architecture(preset("seed-gpt")), eager)
    assert not sequence.generated(from_architecture(preset("llama-2-7b")), eager)
    assert not sequence.generated(from_architecture(preset("llama-2-7b", attention_bias=True)), s)
    assert not sequence.generated(from_architecture(preset("seed-gpt", num_heads=1, num_kv_heads=1)), s)


@pytest.mark.slow    # traces the validator's model at new dimensions (a few seconds a family)
@pytest.mark.parametrize("family", ["seed-gpt", "hf-llama"])
@pytest.mark.parametrize("zero3", [False, True])
def test_the_family_stream_is_the_trace_at_dimensions_depth_and_shape_it_was_not_solved_from(family, zero3):
    """At random dimensions (seed 2024, not the generation's), 6 layers and B 2 x s 40, the family's
    stream played (the CUDA rules aside) is the validator's model's own trace: every allocation's
    bytes, every free and every gradient handed to DeepSpeed, in order."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from contextlib import nullcontext

    from zerocalc.hf import familystream, memtrace
    if zero3:
        pytest.importorskip("deepspeed")
    dims = familystream.random_dims(family, random.Random(2024))
    attention = "eager" if family == "seed-gpt" else "sdpa"
    model, mode = familystream._build(family, attention, False, dims, 6)
    with familystream.zero3_linear() if zero3 else nullcontext():
        raw = memtrace.record_step(model, mode, 2, 40, False, **familystream._record_keywords())
    want = played_step.recorded(raw)
    arch = Architecture(family, dims["vocab_size"], dims["hidden_size"], 6, dims["num_heads"], dims["num_kv_heads"],
                        dims["ffn_hidden_size"], False, dims["max_positions"])
    spec = from_architecture(arch)
    setup = _setup(2, 40, stage=Stage.PARAMETERS if zero3 else Stage.GRADIENTS)
    assert played_step.played(spec, setup, sequence.step_stream(spec, setup)) == want



def _played(arch, setup, name, variant="plain"):
    """Segment `name` of the family's stream at these dimensions, with the bytes of every tensor it
    frees (whichever layer's forward made it) and its markers: ("a", bytes, handle), ("f", bytes,
    handle), ("s",) a sum over the tokens (the staging rule), ("g", the parameter's index in its layer)."""
    st = sequence.step_stream(from_architecture(arch), setup)
    x = sequence.basis_values(st["basis"], setup.micro_batch, setup.seq_len, arch)
    size = {}

    def decode(seg):
        out, j = [], 0
        for e in sequence._compiled(st, variant, seg):
            if e[0] == "a":
                size[(seg, j)] = sum(c * v for c, v in zip(e[1], x))
                out.append(("a", size[(seg, j)], (seg, j)))
                j += 1
            elif e[0] == "f":
                where, mode, value, jj = e[1]
                at = seg if where is None else where if mode == 0 else f"{where}{int(seg[1:]) + value}"
                out.append(("f", size[(at, jj)], (at, jj)))
            elif e[0] == "s":
                out.append(("s",))
            elif e[0] == "t":            # the softmax backward's temporary (`_TracedStep`'s rule)
                n = sum(c * v for c, v in zip(e[1], x))
                out += [("a", n, "t"), ("f", n, "t")]
            elif e[0] == "g":
                out.append(("g", e[1][2]))
        return out
    for seg in ("F0", "F1", "F2", "F3"):
        decode(seg)
    return decode(name)


def _one_instant(events):
    """(the events without the allocations freed right after they are made, as (kind, bytes); those
    allocations' bytes)."""
    out, dropped = [], []
    for e in events:
        if out and e[0] == "f" and out[-1][0] == "a" and out[-1][2] == e[2]:
            dropped.append(out.pop()[1])
        else:
            out.append(e)
    return [e[:2] for e in out], dropped


@pytest.mark.parametrize("dims", [d for d in DIMS if d[0] == "seed-gpt"])
def test_a_seed_gpt_layers_backward_is_the_transcribed_one_but_three_instants(dims, monkeypatch):
    """A middle layer's backward (B1: after the next layer's last gradient, to its own) at stages 0-2
    is the transcription's event for event (a sum over the tokens where the transcription stages one,
    the softmax backward's B·heads·s² temporary, the gradients handed over in its order), but for three
    [T, h] temporaries the history makes and frees at once in ln1's three LayerNorm backwards, which
    the CPU's kernels do not make (no call sites are recorded in backward: which kernel is not known)."""
    arch, setup = _arch(dims), _setup(2, 1024)
    t = sequence._Trace()
    monkeypatch.setattr(oracle, "_sum_over_tokens", lambda t, tokens, width: t.events.append(("s",)))
    layer = oracle._SeedGpt(t, arch, setup)
    _, kept = layer._forward_linear(t.alloc(layer.th))
    start = len(t.events)
    layer.backward(kept, 0, lambda k, g=None: t.events.append(("g", k)))
    sizes = {e[1]: e[2] for e in t.events if e[0] == "alloc"}
    want = [("a", e[2], e[1]) if e[0] == "alloc" else ("f", sizes[e[1]], e[1]) if e[0] == "free" else e
            for e in t.events[start:]]
    want, dropped = _one_instant(want)
    got, instants = _one_instant(_played(arch, setup, "B1"))
    softmax = 2 * 2 * arch.num_heads * 1024 ** 2          # bf16 [B, heads, s, s]
    assert instants == [softmax]
    assert sorted(dropped) == sorted([softmax] + [2 * 2 * 1024 * arch.hidden_size] * 3)
    assert got == want
