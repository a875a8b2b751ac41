"""A model as its own code builds it, without torch: the parameter tensors, the module tree and one
forward's module calls, read once from a real build (`zerocalc.hf.trace`, the optional `trace`
extra) and kept as JSON (shipped in `zerocalc/profiles/`, cached in the user's cache directory).

It holds what DeepSpeed needs to be exact at every stage: the parameters in `module.parameters()`
order, tied weights once; which module owns which tensors; the calls of one forward, nested, with
whether each output requires grad (stage 3's fetch trace, `zerocalc.stage3_trace`, is walked from
them: `traces`); the buffers and the config's dimensions; the step's
allocation stream (`stream`, `hf.memtrace.step_stream`, played by `zerocalc.sequence`) and the
operators and FLOPs per phase (`steps`, `zerocalc.hf.optrace`, read by `zerocalc.timing`). Repeated
layers are stored once (`_compress`). Each field and the JSON's form: docs/models.md, "What a profile
holds".
"""
import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import NamedTuple

FORMAT = 1


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str = ""            # buffers only: their dtype as built ("float32", "bfloat16", ...), fp32 where
                               # DeepSpeed keeps it so (`hf.trace.keep_in_fp32`)
    zero_init_dtype: str = ""  # buffers only: the dtype a floating-point buffer keeps under DeepSpeed's
                               # zero.Init, where that is not the training dtype ("": the training dtype;
                               # `hf.trace.zero_init_kept`)

    @property
    def numel(self) -> int:
        return prod(self.shape)


DTYPE_BYTES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2,
               "int16": 2, "bool": 1, "uint8": 1, "int8": 1}


class Module(NamedTuple):
    name: str                  # qualified name ("" for the root)
    cls: str                   # class name
    params: tuple[int, ...]    # its own parameters (recurse=False), indices into Profile.params
    layer: bool = False        # a decoder layer: the unit activation checkpointing recomputes
    moe: bool = False          # a mixture-of-experts block: one fetch unit at stage 3 (set_z3_leaf_modules)
    external: tuple[int, ...] = ()   # parameters its forward reads of a module it does not call (the seed's
                                     # nn.MultiheadAttention and its out_proj): stage 3 fetches them with it
    saves: bool = False        # a dropout at p > 0: keeps its mask for backward without parameters, so a
                               # checkpointed layer's recomputation starts and ends at it (`arch._backward`)
    views: bool = False        # its forward keeps views of its own parameters for backward (a fused experts
                               # module's 3-d weights, transposed into transformers' grouped_mm): at stage 3
                               # the gathered copy outlives DeepSpeed's release until backward
                               # (`ModelSpec.viewed_params`, `hf.trace.record`)


class CallNode(NamedTuple):
    module: int                           # index into Profile.modules
    children: tuple["CallNode", ...] = ()
    grad: bool = True                     # its output requires grad


@dataclass(frozen=True)
class Profile:
    name: str
    model_type: str
    dims: dict = field(hash=False, compare=False)   # config dimensions (see `hf.trace.dims`)
    params: tuple[Tensor, ...]
    buffers: tuple[Tensor, ...]
    modules: tuple[Module, ...]
    calls: CallNode                        # the root module's forward call
    source: dict = field(default_factory=dict, hash=False, compare=False)   # versions, config digest
    activations: dict | None = field(default=None, hash=False, compare=False)  # `hf.memtrace.layer_activations`
    stream: dict | None = field(default=None, hash=False, compare=False)       # `hf.memtrace.step_stream`
    steps: dict | None = field(default=None, hash=False, compare=False)   # `hf.optrace.config_steps`: operators, FLOPs
    # {attention: {"activations", "stream"}}: traced under an attention other than the config's own
    # (SDPA where the config picks eager: `hf.trace.trace`)
    attentions: dict | None = field(default=None, hash=False, compare=False)
    returns_logits: bool = False        # its forward returns the logits (the seed's GPT): trained as it is,
                                        # where a Hugging Face model is wrapped (`traces`)
    checkpoint_reenters_layer: bool = False   # `checkpoint(layer, x)` calls the layer itself again (the
                                              # seed's GPT); Hugging Face's re-enters below the layer's hooks

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def param_numels(self) -> tuple[int, ...]:
        return tuple(p.numel for p in self.params)

    @cached_property
    def moe_classes(self) -> tuple[str, ...]:
        return tuple(sorted({m.cls for m in self.modules if m.moe}))

    def subtree_params(self, module: int) -> tuple[int, ...]:
        """All parameters of a module and its descendants, in `parameters()` order."""
        name = self.modules[module].name
        inside = {i for m in self.modules if m.name == name or m.name.startswith(name + ".") for i in m.params}
        return tuple(sorted(inside))


# ---------------------------------------------------------------- JSON, with repeated layers stored once

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _first_name(item) -> str | None:
    while isinstance(item, list) and item:
        item = item[0]
    return item if isinstance(item, str) else None


GROUP_INDICES = 8    # the most consecutive indices one repeated block spans (a hybrid model's pattern of layers)


def _template(block, prefix: str, i: int, g: int = 1) -> str:
    """The block's JSON with indices i .. i + g - 1 under prefix as "{i}", "{i+1}", ..."""
    def placeholder(m):
        j = int(m.group(1)) - i
        return prefix + ("{i}" if j == 0 else f"{{i+{j}}}") if 0 <= j < g else m.group(0)
    return re.sub(re.escape(prefix) + r"(\d+)(?=[.\"])", placeholder, json.dumps(block))


def _block_at(items, k: int, prefix: str, i: int) -> int:
    """How many items from k on belong to index i under prefix."""
    head = prefix + str(i)
    n = 0
    while k + n < len(items):
        name = _first_name(items[k + n])
        if name is None or not (name == head or name.startswith(head + ".")):
            break
        n += 1
    return n


def _group_at(items, k: int, prefix: str, i: int, g: int) -> int:
    """How many items from k on belong to indices i .. i + g - 1 under prefix, 0 where one has none."""
    size = 0
    for j in range(g):
        n = _block_at(items, k + size, prefix, i + j)
        if not n:
            return 0
        size += n
    return size


def _compress(items: list) -> list:
    """Runs of consecutive blocks that differ only in one index component become one repeat entry; a
    block may span up to `GROUP_INDICES` consecutive indices ("step": a hybrid model's layers repeat a
    pattern of several), the fewest that cover the most items."""
    out, k = [], 0
    while k < len(items):
        name = _first_name(items[k])
        best = None
        for m in _INDEX.finditer(name or ""):
            prefix, i = name[:m.start(1)], int(m.group(1))
            for g in range(1, GROUP_INDICES + 1):
                size = _group_at(items, k, prefix, i, g)
                if not size:
                    break
                tmpl, reps, at = _template(items[k:k + size], prefix, i, g), 1, k + size
                while True:
                    nxt = _group_at(items, at, prefix, i + reps * g, g)
                    if nxt != size or _template(items[at:at + size], prefix, i + reps * g, g) != tmpl:
                        break
                    reps, at = reps + 1, at + size
                if reps > 1 and (best is None or reps * size > best[0] * best[1]):
                    best = (reps, size, prefix, i, tmpl, g)
        if best is None:
            out.append(items[k])
            k += 1
            continue
        reps, size, prefix, i, tmpl, g = best
        out.append({"repeat": reps, "prefix": prefix, "from": i, **({"step": g} if g > 1 else {}),
                    "items": _compress(json.loads(tmpl))})
        k += reps * size
    return out


def _expand(items: list) -> list:
    """The compressed entries written out (`_compress`); a list without a repeated block is itself."""
    if not any(isinstance(it, dict) for it in items):
        return items
    out = []
    for it in items:
        if isinstance(it, dict):
            text, step = json.dumps(_expand(it["items"])), it.get("step", 1)
            for r in range(it["repeat"]):
                base, block = it["from"] + r * step, text
                for j in range(step - 1, 0, -1):
                    block = block.replace(f"{it['prefix']}{{i+{j}}}", it["prefix"] + str(base + j))
                out += json.loads(block.replace(it["prefix"] + "{i}", it["prefix"] + str(base)))
        else:
            out.append(it)
    return out


def written_out(p: Profile) -> dict:
    """p's tensors, buffers, modules and calls as `to_json` writes them before compressing them (a
    module's parameters by name, a call's module by name)."""
    names = [t.name for t in p.params]
    mods = [m.name for m in p.modules]

    def node(c: CallNode):
        return [mods[c.module], int(c.grad), [node(x) for x in c.children]]

    return {
        "params": [[t.name, list(t.shape)] for t in p.params],
        "buffers": [[t.name, list(t.shape), t.dtype] + ([t.zero_init_dtype] if t.zero_init_dtype else [])
                    for t in p.buffers],
        "modules": [[m.name, m.cls, [names[i] for i in m.params],
                     ("L" if m.layer else "") + ("M" if m.moe else "") + ("S" if m.saves else "")
                     + ("V" if m.views else "")]
                    + ([[names[i] for i in m.external]] if m.external else []) for m in p.modules],
        "calls": node(p.calls),
    }


def expanded(d: dict) -> dict:
    """A profile JSON's tensors, buffers, modules and calls written out (`written_out`'s form)."""
    def node(x):
        name, grad, children = x
        return [name, grad, [node(c) for c in _expand(children)]]
    return {"params": _expand(d["params"]), "buffers": _expand(d["buffers"]), "modules": _expand(d["modules"]),
            "calls": node(d["calls"])}


def to_json(p: Profile) -> dict:
    out = written_out(p)

    def node(x):
        name, grad, children = x
        return [name, grad, _compress([node(c) for c in children])]

    return {
        "format": FORMAT, "name": p.name, "model_type": p.model_type, "dims": p.dims, "source": p.source,
        "params": _compress(out["params"]), "buffers": _compress(out["buffers"]),
        "modules": _compress(out["modules"]), "calls": node(out["calls"]),
        "activations": p.activations,
        "stream": p.stream,
        **({"steps": p.steps} if p.steps else {}),
        **({"attentions": p.attentions} if p.attentions else {}),
        **({"returns_logits": True} if p.returns_logits else {}),
        **({"checkpoint_reenters_layer": True} if p.checkpoint_reenters_layer else {}),
    }


def from_json(d: dict) -> Profile:
    if d.get("format") != FORMAT:
        raise ValueError(f"profile format {d.get('format')!r}; this zerocalc reads format {FORMAT}")
    params = tuple(Tensor(n, tuple(s)) for n, s in _expand(d["params"]))
    index = {t.name: i for i, t in enumerate(params)}.__getitem__
    modules = tuple(Module(n, c, tuple(map(index, ps)), "L" in f, "M" in f, tuple(map(index, ext[0])) if ext else (),
                           "S" in f, "V" in f)
                    for n, c, ps, f, *ext in _expand(d["modules"]))
    mindex = {m.name: i for i, m in enumerate(modules)}

    def node(x) -> CallNode:
        name, grad, children = x
        return CallNode(mindex[name], tuple(map(node, _expand(children))), bool(grad))

    return Profile(d["name"], d["model_type"], d.get("dims", {}), params,
                   tuple(Tensor(b[0], tuple(b[1]), *b[2:]) for b in _expand(d["buffers"])), modules, node(d["calls"]),
                   d.get("source", {}), d.get("activations"), d.get("stream"), d.get("steps"), d.get("attentions"),
                   bool(d.get("returns_logits")), bool(d.get("checkpoint_reenters_layer")))


def traced_under(p: Profile, attention: str) -> tuple[dict | None, dict | None]:
    """(activations, stream) of the profile under `attention`: the config's own attention's, or one
    traced beside it (`attentions`); for an attention not traced, the own activations (as before) and
    no stream (its allocations are then not simulated)."""
    stream = getattr(p, "stream", None)
    own = (stream or {}).get("attention")
    other = (getattr(p, "attentions", None) or {}).get(attention) if attention != own else None
    if other:
        return other.get("activations"), other.get("stream")
    return getattr(p, "activations", None), (stream if stream is not None and attention == own else None)


def save(p: Profile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_json(p), f, separators=(",", ":"))
        f.write("\n")


def load(path: str) -> Profile:
    with open(path) as f:
        return from_json(json.load(f))


# ---------------------------------------------------------------- shipped profiles

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


def shipped() -> dict[str, str]:
    """Shipped profile names -> their files."""
    if not os.path.isdir(SHIPPED_DIR):
        return {}
    return {f[:-5]: os.path.join(SHIPPED_DIR, f) for f in sorted(os.listdir(SHIPPED_DIR)) if f.endswith(".json")}


_loaded: dict[str, Profile] = {}


def shipped_profile(name: str) -> Profile:
    files = shipped()
    if name not in files:
        raise ValueError(f"unknown model {name!r}; `zerocalc models` lists the shipped ones")
    if name not in _loaded:
        _loaded[name] = load(files[name])
    return _loaded[name]


# ---------------------------------------------------------------- to the ModelSpec the rest of zerocalc uses

def _call_tree(p: Profile, node: CallNode, leaf_moe: bool):
    from zerocalc.arch import Call
    modules = p.modules

    def call(node: CallNode):
        m = modules[node.module]
        if leaf_moe and m.moe:
            # deepspeed.utils.set_z3_leaf_modules: no hooks below the block; its pre-forward hook fetches
            # every parameter under it at once, and its release frees them together.
            return Call(p.subtree_params(node.module), (), node.grad, m.layer, leaf=True, own=m.params)
        return Call(tuple(sorted(m.params + m.external)), tuple(map(call, node.children)), node.grad, m.layer,
                    m.saves)
    return call(node)


def architecture(p: Profile):
    """The family shape nearest the profile, for what is computed from dimensions (activations, step
    time, a family's stream): the seed's GPT for its own, GPT-2 for gpt2, Llama's for every other
    decoder. An MoE layer's MLP is counted as the top-k experts' and the shared experts' widths
    (balanced routing: each token's MLP activations are those of the k experts it is sent to)."""
    from zerocalc.arch import Architecture
    d = p.dims
    heads = d["num_heads"]
    ffn = d["ffn_hidden_size"]
    if d.get("num_experts"):
        ffn = d.get("experts_per_token", 1) * d["moe_ffn_hidden_size"] + d.get("shared_ffn_hidden_size", 0)
    family = {"gpt2": "hf-gpt2", "seed-gpt": "seed-gpt"}.get(p.model_type, "hf-llama")
    llama = p.model_type == "llama"
    return Architecture(family, d["vocab_size"], d["hidden_size"], d["num_layers"], heads,
                        d.get("num_kv_heads") or heads, ffn, bool(d.get("tie_embeddings")),
                        d.get("max_positions") or 2048, llama and bool(d.get("attention_bias")),
                        llama and bool(d.get("mlp_bias")))


def buffer_element_bytes(b: Tensor) -> tuple[int, int]:
    """(bytes per element as built, under zero.Init: 0 for the training dtype) of a buffer: a
    floating-point one takes the training dtype there unless it keeps its own (`zero_init_dtype`);
    any other (a bool mask) keeps its dtype everywhere."""
    built = DTYPE_BYTES.get(b.dtype, 4)
    if b.zero_init_dtype:
        return built, DTYPE_BYTES.get(b.zero_init_dtype, 4)
    return built, 0 if b.dtype.startswith(("float", "bfloat")) else built


SCALAR_BUFFER_ELEMENTS = 2   # a buffer of at most this many elements is a scalar (`kept_buffers`)


def kept_buffers(p: Profile) -> list[Tensor]:
    """The buffers a rank's states count: scalar ones (Gemma's embed_scale) are left out, as the
    validator's state measurement leaves every storage of 8 bytes or less out (with DeepSpeed's own
    scalars: `validate.measure.SCALAR_BYTES`)."""
    return [b for b in p.buffers if b.numel > SCALAR_BUFFER_ELEMENTS]


def traces(p: Profile, z3_leaf_moe: bool = True, wrapper: bool = True) -> tuple:
    """(forward, backward, checkpointed backward, which of its steps are recomputations, what the
    stage-3 reuse rule reads of each step where a module is a leaf: `arch.leaf_scans`): the module
    steps DeepSpeed's hooks see, walked from the calls by `arch._forward` / `arch._backward` (Hugging
    Face's checkpointing re-enters below the layer's own hooks, the seed's `checkpoint(block, x)` calls
    the block again). wrapper: the validator trains a Hugging Face model inside a module that returns
    the logits (`zerocalc.hf.families.HFCausalLM`): one parameter-less call around it (not around a
    model whose forward returns them, `Profile.returns_logits`). z3_leaf_moe: an MoE block is one
    stage-3 fetch unit."""
    from zerocalc import arch as A
    root = _call_tree(p, p.calls, z3_leaf_moe)
    if wrapper and not p.returns_logits:
        root = A.Call((), (root,))
    again = p.checkpoint_reenters_layer
    checkpointed = tuple(A._backward_steps(root, True, again))
    return (tuple(A._forward(root)), tuple(A._backward(root)), tuple(call.params for call, _ in checkpointed),
            tuple(recomputed for _, recomputed in checkpointed), A.leaf_scans(root, again))
