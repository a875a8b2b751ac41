"""The validator's model families as profiles of any size, without torch.

The families are the models the validator trains (`zerocalc.hf.families`): the seed's GPT, Hugging
Face GPT-2 and Llama. Each was traced once from that code (`zerocalc.hf.familyprofile`) into
`family_profiles.json`, sizes as expressions of the dimensions ("h", "3*h", "d/2") and the layers
repeated "L" times; `profile` evaluates one at an Architecture's dimensions. Beside its tensors and
calls a family carries what was measured of it: its allocation stream, sizes polynomial in the
dimensions (`family_streams.json`, `zerocalc.hf.familystream`), and the calibrated activation
formula and step counts (`zerocalc.activations`, `family_steps.json`), which a family profile takes
by holding no traced ones of its own. A shipped or traced profile that is a family's at its
dimensions (`described`) takes the family's stream and activations the same way: the family's stream
holds stage 3's linear, which a profile's own lacks, and on the H200 rows its own traced ones would
move 9 of 304 allocated and 4 of 284 reserved peaks, nearer on some, further on others (data/README.md,
"One description of a model").
"""
import json
import os
from dataclasses import replace
from functools import lru_cache
from math import prod

from zerocalc import profile as _profile
from zerocalc.arch import Architecture, validate_architecture
from zerocalc.training import ATTENTION

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILY = "family"      # the key of `Profile.source` naming the family a profile is described by
CODE = ("seed-gpt", "gpt2", "llama", "mistral")   # the model types the families' code is (Mistral's: Llama's
                                                   # but for its sliding-window mask)


@lru_cache(maxsize=None)
def templates() -> dict:
    """`family_profiles.json`: each family's profile JSON with sizes as expressions."""
    with open(os.path.join(HERE, "family_profiles.json")) as f:
        return json.load(f)["families"]


@lru_cache(maxsize=None)
def streams() -> dict:
    """The families' allocation streams (`zerocalc.hf.familystream`), by "family/attention/tied|untied"."""
    with open(os.path.join(HERE, "family_streams.json")) as f:
        return json.load(f)


def key(a: Architecture) -> str:
    """The template of `a`: its family, tied or not, Llama's bias flags."""
    return "/".join([a.family, "tied" if a.tie_embeddings else "untied"] + ["attention_bias"] * a.attention_bias
                    + ["mlp_bias"] * a.mlp_bias)


def _size(expr: str, values: dict) -> int:
    """"h" -> h, "3*h" -> 3h, "d/2" -> the rotary table's ceil(d/2) (`arange(0, d, 2)`)."""
    if "*" in expr:
        c, x = expr.split("*")
        return int(c) * values[x]
    if "/" in expr:
        x, c = expr.split("/")
        return -(-values[x] // int(c))
    return values[expr]


def _sized(items, values: dict, entry=lambda it: it):
    """The compressed JSON entries (`profile._compress`) with `entry` applied to each and the layers'
    repeat made `values["L"]`."""
    return [{**it, "repeat": values["L"] if it["repeat"] == "L" else it["repeat"],
             "items": _sized(it["items"], values, entry)} if isinstance(it, dict) else entry(it) for it in items]


def dims(a: Architecture) -> dict:
    """The dimensions as a traced profile names them (`zerocalc.hf.trace.dims`)."""
    out = {"vocab_size": a.vocab_size, "hidden_size": a.hidden_size, "num_layers": a.num_layers,
           "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
           "ffn_hidden_size": a.ffn_hidden_size, "tie_embeddings": a.tie_embeddings, "max_positions": a.max_positions}
    out.update({flag: True for flag in ("attention_bias", "mlp_bias") if getattr(a, flag)})
    return out


def stream(a: Architecture, attention: str) -> dict | None:
    """The family's allocation stream under `attention`: the seed's nn.MultiheadAttention whatever the
    setting; a Llama's with its attention, grouped-query or not, and biases; a model shallower than the
    traced stack, its own depth's where one is traced. None for one head or one key/value head (the
    streams are traced with 2 to 12 of each, `familystream.random_dims`: nn.MultiheadAttention runs one
    head on another path, SDPA's backward one key/value head otherwise) and for GPT-2 (none traced)."""
    if a.num_heads < 2 or a.num_kv_heads == 1:
        return None
    grouped = "/grouped" if a.num_kv_heads < a.num_heads else ""
    bias = "".join(("/attention_bias" if a.attention_bias else "", "/mlp_bias" if a.mlp_bias else ""))
    name = f"{a.family}/{'eager' if a.family == 'seed-gpt' else attention}/" \
           f"{'tied' if a.tie_embeddings else 'untied'}{grouped}{bias}"
    found = streams().get(name)
    if found is not None and found["layers"] > a.num_layers:
        found = streams().get(f"{name}/{a.num_layers}-layer")
    return found


def _measured(p: _profile.Profile, a: Architecture, own=lambda attention: None) -> _profile.Profile:
    """p holding the family's measured data: its stream under each attention (else `own(attention)`),
    no traced activations (the calibrated formula) and the family's name in its source."""
    played = {att: stream(a, att) or own(att) for att in ATTENTION}
    return replace(p, activations=None, stream=None, source={**p.source, FAMILY: key(a)},
                   attentions={att: {"activations": None, "stream": s} for att, s in played.items() if s is not None})


def _values(a: Architecture) -> dict:
    """The sizes the templates name, at `a`'s dimensions."""
    return {"V": a.vocab_size, "h": a.hidden_size, "f": a.ffn_hidden_size, "kv": a.num_kv_heads * a.head_dim,
            "d": a.head_dim, "P": a.max_positions, "L": a.num_layers}


def _elements(items: list, values: dict) -> int:
    """The elements of compressed tensor entries (`profile._compress`: a dict is a block repeated) at `values`."""
    return sum((values["L"] if it["repeat"] == "L" else it["repeat"]) * _elements(it["items"], values)
               if isinstance(it, dict) else prod(_size(e, values) for e in it[1]) for it in items)


def param_count(a: Architecture) -> int:
    """The parameters of the family's profile at `a` (`profile(a).num_params`, without building it)."""
    validate_architecture(a)
    return _elements(templates()[key(a)]["params"], _values(a))


def profile(a: Architecture, name: str | None = None) -> _profile.Profile:
    """The family's profile at `a`'s dimensions, with the family's measured data (`_measured`)."""
    return _measured(_profile.from_json(_profile_json(a, name)), a)


def _profile_json(a: Architecture, name: str | None = None) -> dict:
    """The family's profile JSON at `a`'s dimensions, without measured data."""
    validate_architecture(a)
    t = templates()[key(a)]
    values = _values(a)

    def shaped(it):
        return [it[0], [_size(e, values) for e in it[1]], *it[2:]]

    def call(node):
        return [node[0], node[1], _sized(node[2], values, call)]
    return {"format": _profile.FORMAT, "name": name or a.family, "model_type": t["model_type"], "dims": dims(a),
            "source": t["source"], "params": _sized(t["params"], values, shaped),
            "buffers": _sized(t["buffers"], values, shaped), "modules": _sized(t["modules"], values),
            "calls": call(t["calls"]),
            **{k: t[k] for k in ("returns_logits", "checkpoint_reenters_layer") if k in t}}


def described(p: _profile.Profile) -> _profile.Profile:
    """p, or where its architecture's family builds the same tensors, buffers and module calls at its
    dimensions, p holding the family's measured data (`_measured`; its own stream under an attention
    the family has none for, as Gemma-2B's single key/value head or GPT-2's)."""
    if FAMILY in p.source:
        return p
    try:
        a = _profile.architecture(p)
        d = _profile_json(a)
    except (ValueError, KeyError):
        return p
    written = _profile.expanded(d)
    if tuple(prod(shape) for _, shape in written["params"]) != p.param_numels:   # `_same_model`'s first test
        return p
    if not (_written_alike(p, d, written) or _same_model(p, _profile.from_json(d))):
        return p
    return _measured(p, a, lambda attention: _profile.traced_under(p, attention)[1])


def _written_alike(p: _profile.Profile, d: dict, theirs: dict) -> bool:
    """Whether p has the tensors (names and shapes), kept buffers (sizes), modules (but for their
    class names, which no trace reads: MistralAttention is LlamaAttention) and calls of the profile
    JSON d (`theirs`: d written out, `profile.expanded`): then `_same_model` holds, found without
    building d's profile (`described` asks it of every shipped profile an estimate reads)."""
    mine = _profile.written_out(p)
    if mine["params"] != theirs["params"] or [b.numel for b in _profile.kept_buffers(p)] != \
            [n for n in (prod(b[1]) for b in theirs["buffers"]) if n > _profile.SCALAR_BUFFER_ELEMENTS]:
        return False
    return [m[:1] + m[2:] for m in mine["modules"]] == [m[:1] + m[2:] for m in theirs["modules"]] \
        and mine["calls"] == theirs["calls"] and (p.returns_logits, p.checkpoint_reenters_layer) == \
        (bool(d.get("returns_logits")), bool(d.get("checkpoint_reenters_layer")))


def _same_model(p: _profile.Profile, q: _profile.Profile) -> bool:
    """Equal tensors, kept buffers and stage-3 traces (forward, and backward with checkpointing), its
    dropouts aside: GPT-2 as published (p = 0.1) is the validator's dropout-free GPT-2 with masks, which
    its own calls keep (`Module.saves`: where DeepSpeed recomputes a checkpointed block from)."""
    if p.param_numels != q.param_numels or [b.numel for b in _profile.kept_buffers(p)] != \
            [b.numel for b in _profile.kept_buffers(q)]:
        return False
    # what `traces` walks, equal: so are the traces (the usual case, and the cheap test: every estimate
    # of a shipped profile asks)
    if (p.modules, p.calls, p.returns_logits, p.checkpoint_reenters_layer) == \
            (q.modules, q.calls, q.returns_logits, q.checkpoint_reenters_layer):
        return True

    def key(x):
        x = replace(x, modules=tuple(m._replace(saves=False) for m in x.modules))
        forward, _, checkpointed, _, _ = _profile.traces(x)
        return forward, checkpointed
    return key(p) == key(q)


# ---------------------------------------------------------------- a config.json a family reads

def reads(d: dict) -> bool:
    """Whether a family reads a config.json exactly: GPT-2's; Llama's and Mistral's with the usual
    head width (no biases Mistral lacks: their flags are Llama's)."""
    kind = d.get("model_type")
    if kind == "gpt2":
        return True
    return kind in ("llama", "mistral") \
        and d.get("head_dim") in (None, d.get("hidden_size", 0) // max(d.get("num_attention_heads", 1), 1))


def from_config(d: dict) -> Architecture:
    """The Architecture of a GPT-2, Llama or Mistral config.json (`reads`), with transformers' defaults
    for the keys it leaves out. No hub access: the caller reads the local file."""
    kind = d.get("model_type", "")
    if kind == "gpt2":
        h = d.get("n_embd", 768)
        return Architecture("hf-gpt2", d.get("vocab_size", 50257), h, d.get("n_layer", 12), d.get("n_head", 12),
                            d.get("n_head", 12), d.get("n_inner") or 4 * h, d.get("tie_word_embeddings", True),
                            d.get("n_positions", 1024))
    if kind in ("llama", "mistral"):
        heads = d["num_attention_heads"]
        return Architecture("hf-llama", d["vocab_size"], d["hidden_size"], d["num_hidden_layers"], heads,
                            d.get("num_key_value_heads") or heads, d["intermediate_size"],
                            d.get("tie_word_embeddings", False), d.get("max_position_embeddings", 2048),
                            kind == "llama" and bool(d.get("attention_bias")),   # Mistral has no bias flags
                            kind == "llama" and bool(d.get("mlp_bias")))
    raise ValueError(f"config.json has model_type {kind!r}; zerocalc reads gpt2, llama and mistral configs")


# ---------------------------------------------------------------- a shape for P alone

def generic_layers(num_params: int) -> int:
    """`generic`'s depth: h ≈ 128·L makes 12·L·h² = 196608·L³ ≈ P."""
    return max(2, round((num_params / 196608) ** (1 / 3)))


def generic(num_params: int, vocab_size: int = 32000) -> Architecture:
    """A Llama of at most `num_params`, short of it by less than the parameters one more unit of FFN
    width adds (3·L·h), for what needs a shape when only P is known: activations and step time. Shapes
    follow the GPT-3/Llama habit h ≈ 128·L (12·L·h² = 196608·L³ ≈ P), h a multiple of 128, heads of
    128; the vocabulary is `vocab_size`, or less where its embeddings (2·V·h) would pass a quarter of
    P; the FFN width takes what the rest leaves, read from the family's own tensors (P is linear in
    it). Raises ValueError below ~0.2M parameters, too few for a layer."""
    layers = generic_layers(num_params)
    hidden = max(128, 128 * round((num_params / (12 * layers)) ** 0.5 / 128))
    heads = max(1, hidden // 128)
    vocab = max(1, min(vocab_size, num_params // (8 * hidden)))
    base = Architecture("hf-llama", vocab, hidden, layers, heads, heads, 1, False)
    one, two = (param_count(replace(base, ffn_hidden_size=f)) for f in (1, 2))
    ffn = (num_params - (2 * one - two)) // (two - one)
    if ffn < 1:
        raise ValueError(f"{num_params:,} parameters are too few to give a transformer shape; "
                         "give the architecture (--model or --hidden-size/--num-layers/...)")
    return replace(base, ffn_hidden_size=ffn)
