"""The transcribed families' allocation streams (`zerocalc/family_streams.json`), with every size an
integer polynomial in the batch, the sequence and the model's dimensions: one stream per family
serves every width, depth, head count and vocabulary, where a traced model's stream
(`memtrace.step_stream`) holds one config's dimensions.

How (`family_stream`): the validator's own model of the family (`zerocalc.hf.families.build_model`)
is traced on fake tensors (`memtrace.record_step`, with and without checkpointing and DeepSpeed's
stage-3 linear) at random dimensions and the six (B, s) shapes; each size's coefficients, the terms
of (1, s, B·s, B·s², B, s²) times the monomials of the family's dimensions (`monomials`), are solved
exactly and checked against held-out traces (at least `HELD_OUT`): a size that is no such
polynomial, or a stream whose events change with the dimensions, fails the generation. The method
in full: docs/reserved-memory.md, "The transcribed families".

    python -m zerocalc.hf.familystream     # regenerate zerocalc/family_streams.json (needs the validator)
"""
import json
import os
import random
from contextlib import contextmanager, nullcontext
from fractions import Fraction

from zerocalc.hf import memtrace

FORMAT = 1
FAMILY_STREAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "family_streams.json")
# The dimensions a family's sizes are polynomials in (`zerocalc.sequence.STREAM_VARIABLES` reads them):
# h hidden, f FFN, V vocabulary, H heads, kv key/value width (kv heads x head_dim), d head_dim, P positions.
FAMILY_VARIABLES = {"seed-gpt": ("h", "f", "V", "H"), "hf-llama": ("h", "kv", "f", "V", "H", "d")}
# What is generated: (family, attention, tied embeddings, grouped-query attention). seed-gpt is
# nn.MultiheadAttention whatever the attention setting; the Llama is generated with SDPA, as the H200
# histories ran it, with as many key/value heads as heads and with fewer (SDPA's backward then sums
# each group's key and value gradients: other events).
FAMILIES = (("seed-gpt", "eager", False, False), ("seed-gpt", "eager", True, False),
            ("hf-llama", "sdpa", False, False), ("hf-llama", "sdpa", True, False),
            ("hf-llama", "sdpa", False, True), ("hf-llama", "sdpa", True, True))
# Stage 3's backward fetches run before backward's fourth allocation (after the validator's loss's
# scalar gradient, nll's and log-softmax's fp32 gradients, the log-softmax's output freed; before the
# logits' bf16 gradient), where the transcription of the H200 histories placed them: the 1.1B
# Llama's at N = 2 and with parameter offload at N = 1 then give the recorded allocated peak (a fetch
# before backward put a logits-sized tensor less there).
BACKWARD_FETCH_AT = 3
HELD_OUT = 3           # traces beyond the solving ones, each checked event by event (and the first)
# (variant, activation checkpointing, traced with DeepSpeed's stage-3 linear (`zero3_linear`))
VARIANTS = (("plain", False, False), ("checkpointed", True, False),
            ("plain_zero3", False, True), ("checkpointed_zero3", True, True))


@contextmanager
def zero3_linear():
    """torch.nn.functional.linear as DeepSpeed's stage 3 leaves it: the engine converts the module
    through `zero.Init(module=...)`, which (memory_efficient_linear, on by default) replaces it with
    `LinearFunctionForZeroStage3` (`runtime/zero/partition_parameters.py`, `_enable_mem_efficient_linear`,
    DeepSpeed 0.19.8): it saves the input as given, and backward makes the weight's gradient from the
    output gradient flattened to 2-d and a bias's as its sum over every leading dimension. nn.Linear,
    nn.MultiheadAttention's projections and Hugging Face's linears all call it."""
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    original = torch.nn.functional.linear
    torch.nn.functional.linear = zero3_linear_wrap
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def monomials(variables: tuple) -> list[tuple]:
    """1, each variable, and h times each: a tensor's shape holds at most two of the model's
    dimensions, and where two, one is the hidden width (a weight [h, x] or [x, h]; activations are
    [B, s, x], attention's [B, H, s, s], [B, H, s, d] = B·s·h)."""
    return [()] + [(v,) for v in variables] + [tuple(sorted(("h", v))) for v in variables]


def random_dims(family: str, rng: random.Random, grouped: bool = False) -> dict:
    """Dimensions to trace at: heads, head_dim (even, for the rotary halves), kv heads (grouped: at
    least two, fewer than the heads, dividing them), FFN, vocabulary and positions (at least the longest traced
    sequence), chosen at random so that the monomials' values are independent."""
    # one head is another path (nn.MultiheadAttention views where it copies), and so is one key/value
    # head (its backward differs from grouped-query attention's)
    heads = rng.choice([4, 6, 8, 9, 10, 12]) if grouped else rng.randint(2, 8)
    head_dim = 2 * rng.randint(2, 12)
    kv_heads = rng.choice([k for k in range(2, heads) if heads % k == 0]) if grouped else heads
    return {"num_heads": heads, "num_kv_heads": kv_heads, "hidden_size": heads * head_dim,
            "ffn_hidden_size": rng.randint(8, 256), "vocab_size": rng.randint(16, 400),
            "max_positions": rng.randint(max(s for _, s in memtrace.STREAM_SHAPES), 256)}


def variables(dims: dict) -> dict:
    """The values of `FAMILY_VARIABLES` at these dimensions."""
    head_dim = dims["hidden_size"] // dims["num_heads"]
    return {"h": dims["hidden_size"], "f": dims["ffn_hidden_size"], "V": dims["vocab_size"], "H": dims["num_heads"],
            "kv": dims["num_kv_heads"] * head_dim, "d": head_dim, "P": dims["max_positions"]}


def _build(family: str, attention: str, tie: bool, dims: dict, layers: int):
    """The validator's model of the family on fake tensors in bf16 (as `optrace.family_steps` builds it)."""
    from zerocalc.arch import Architecture
    from zerocalc.hf.optrace import fake_validator_model
    return fake_validator_model(Architecture(family, dims["vocab_size"], dims["hidden_size"], layers, dims["num_heads"],
                                             dims["num_kv_heads"], dims["ffn_hidden_size"], tie, dims["max_positions"]),
                                attention)


def _record_keywords():
    """`memtrace.record_step`'s keywords for the validator's models: called on the token ids, their
    layers the seed's blocks or Hugging Face's decoder layers, checkpointed as the validator does."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    from zerocalc.hf.families import SeedBlock, SeedGPT
    from zerocalc.hf.trace import hf_checkpointing

    def set_checkpointing(model, on):
        if isinstance(model, SeedGPT):
            model.checkpointing = on
        else:
            hf_checkpointing(model.model, on)
    return {"forward": lambda m, ids: m(ids), "set_checkpointing": set_checkpointing,
            "is_layer": lambda m: isinstance(m, (SeedBlock, GradientCheckpointingLayer))}


def _solve_square(rows: list[list[int]]) -> list[list[Fraction]]:
    """The inverse of a square integer matrix, exactly (Gauss-Jordan over the rationals)."""
    n = len(rows)
    m = [[Fraction(x) for x in r] + [Fraction(int(i == j)) for j in range(n)] for i, r in enumerate(rows)]
    for c in range(n):
        p = next((r for r in range(c, n) if m[r][c] != 0), None)
        if p is None:
            raise ValueError("the traced dimensions do not separate the monomials")
        m[c], m[p] = m[p], m[c]
        pivot = m[c][c]
        m[c] = [x / pivot for x in m[c]]
        for r in range(n):
            if r != c and m[r][c] != 0:
                f = m[r][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [r[n:] for r in m]


def term(basis: str, monomial: tuple) -> str:
    """The name of a (B, s) basis element times a monomial in the dimensions: "B*s" x ("h",) is "B*s*h"."""
    factors = [x for x in basis.split("*") if x != "1"] + list(monomial)
    return "*".join(factors) or "1"


def family_stream(family: str, attention: str, tie: bool, grouped: bool = False, seed: int = 0,
                  layers: int = memtrace.STREAM_LAYERS) -> dict:
    """The family's stream (`memtrace.step_stream`'s layout, `sequence._TracedStep` plays it) with each
    size's coefficients over `basis`, the products of (1, s, B·s, B·s², B, s²) and the family's
    monomials that occur. One trace at random dimensions, fitted over the six (B, s) shapes, says which
    of (1, s, B·s, B·s², B, s²) each size has; every further trace is at new random dimensions and one
    random shape, and each size's coefficients (those terms times each monomial) are solved from as
    many traces as it has unknowns and checked against the rest (at least `HELD_OUT`) and the first."""
    rng = random.Random(seed)
    # as many key/value heads as heads: kv is h (the monomials would repeat)
    mono = monomials(tuple(v for v in FAMILY_VARIABLES[family] if grouped or v != "kv"))
    k = layers
    kw = _record_keywords()
    dims0 = random_dims(family, rng, grouped)
    model, mode = _build(family, attention, tie, dims0, k)
    params, layer_params = memtrace._layer_params(model, kw["is_layer"])
    first = {}
    for variant, ckpt, zero3 in VARIANTS:
        with zero3_linear() if zero3 else nullcontext():
            first[variant] = memtrace._fitted_segments(model, mode, k, ckpt, **kw)
    shape = {v: memtrace._structure(segs) for v, segs in first.items()}
    widest = max(sum(1 for c in x if c) for segs in first.values() for evs in segs.values() for e in evs
                 for x in e if isinstance(x, list))
    samples = []                    # (variables, B, s, {variant: raw segments})
    while len(samples) < widest * len(mono) + HELD_OUT:
        dims = random_dims(family, rng, grouped)
        b, s = rng.randint(2, 4), rng.randint(16, max(s for _, s in memtrace.STREAM_SHAPES))
        model, mode = _build(family, attention, tie, dims, k)
        raw = {}
        for variant, ckpt, zero3 in VARIANTS:
            with zero3_linear() if zero3 else nullcontext():
                raw[variant] = memtrace.segments_at(model, mode, k, ckpt, b, s, **kw)
            bad = [seg for seg in shape[variant] if memtrace._structure(raw[variant]).get(seg) != shape[variant][seg]]
            if bad:
                raise ValueError(f"{family}: the stream's events change with the dimensions ({variant} {bad}: "
                                 f"{dims0} and {dims} at {b} x {s})")
        samples.append((variables(dims), b, s, raw))
    x0 = variables(dims0)
    inverses = {}

    def solve(coefs0: list, values: list) -> dict:
        """{term: coefficient} of a size whose (B, s) coefficients are `coefs0` at the first trace and
        whose bytes are `values` at the samples."""
        used = tuple(j for j, c in enumerate(coefs0) if c)
        terms = [(j, m) for j in used for m in mono]
        rows = [[_basis(j, b, s) * _product(x, m) for j, m in terms] for x, b, s, _ in samples]
        if used not in inverses:
            inverses[used] = _solve_square(rows[:len(terms)])
        a = [sum(inv * v for inv, v in zip(row, values)) for row in inverses[used]] if terms else []
        if any(x.denominator != 1 for x in a):
            raise ValueError(f"{family}: a size is no integer polynomial in {FAMILY_VARIABLES[family]}")
        a = [int(x) for x in a]
        for row, v in zip(rows[len(terms):], values[len(terms):]):
            if sum(c * y for c, y in zip(a, row)) != v:
                raise ValueError(f"{family}: a held-out trace's size differs from the solved polynomial")
        for j, c in enumerate(coefs0):
            if sum(y * _product(x0, m) for y, (jj, m) in zip(a, terms) if jj == j) != c:
                raise ValueError(f"{family}: the first trace's size differs from the solved polynomial")
        return {term(memtrace.STREAM_BASIS[j], m): y for y, (j, m) in zip(a, terms) if y}

    stream = {"layers": k, "first_layer_param": layer_params[0][0], "params_per_layer": len(layer_params[0]),
              "attention": attention, "tie_embeddings": tie, "grouped": grouped,
              "backward_fetch_at": BACKWARD_FETCH_AT}
    terms = {}
    for variant, _, _ in VARIANTS:
        segs = {}
        for seg, evs in first[variant].items():
            segs[seg] = [[x if isinstance(x, str) else
                          solve(x, [raw[variant][seg][i][m] for _, _, _, raw in samples]) for m, x in enumerate(e)]
                         for i, e in enumerate(evs)]
            for e in segs[seg]:
                for x in e:
                    if isinstance(x, dict):
                        terms.update(dict.fromkeys(x))
        stream[variant] = segs
    basis = sorted(terms, key=lambda t: (t.count("*"), t))
    stream["basis"] = basis
    for variant, _, _ in VARIANTS:
        for evs in stream[variant].values():
            for e in evs:
                for m, x in enumerate(e):
                    if isinstance(x, dict):
                        coefs = [x.get(t, 0) for t in basis]
                        while coefs and coefs[-1] == 0:
                            coefs.pop()
                        e[m] = coefs
    return memtrace._compact(stream)


def _basis(j: int, b: int, s: int) -> int:
    """The j-th of (1, s, B·s, B·s², B, s²) (`memtrace.STREAM_BASIS`) at B = b, s = s."""
    return (1, s, b * s, b * s * s, b, s * s)[j]


def _product(x: dict, monomial: tuple) -> int:
    out = 1
    for v in monomial:
        out *= x[v]
    return out


def key(family: str, attention: str, tie: bool, grouped: bool) -> str:
    """The stream's name in the file (`zerocalc.family.stream` reads it)."""
    return f"{family}/{attention}/{'tied' if tie else 'untied'}" + ("/grouped" if grouped else "")


# Shallower than `memtrace.STREAM_LAYERS` layers, a model plays a stream traced at its own depth
# where one is generated ("<key>/<n>-layer"; `sequence.step_stream`): the tests' one-layer Llama.
SHALLOW = ((("hf-llama", "sdpa", False, False), 1),)


def family_streams() -> dict:
    out = {"format": FORMAT, **{key(*f): family_stream(*f) for f in FAMILIES}}
    for f, layers in SHALLOW:
        out[f"{key(*f)}/{layers}-layer"] = family_stream(*f, layers=layers)
    return out


if __name__ == "__main__":
    streams = family_streams()
    with open(FAMILY_STREAMS, "w") as f:
        json.dump(streams, f, separators=(",", ":"))
        f.write("\n")
