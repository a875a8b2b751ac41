"""What trains when most people fine-tune: PEFT's LoRA adapters on a frozen base, or parts of a model
frozen (`requires_grad = False`), computed from a profile's modules without torch.

LoRA as PEFT 0.21 builds it (`peft/tuners/lora/layer.py`, checked against PEFT itself by
`tests/test_adapters.py`): each targeted `nn.Linear` (or GPT-2's `Conv1D`) becomes a `lora.Linear`
module of the same name holding the original as `base_layer`, then `lora_dropout.default` (Dropout, or
Identity at p = 0), `lora_A.default` = Linear(in, r, no bias) and `lora_B.default` = Linear(r, out, no
bias); DoRA adds `lora_magnitude_vector.default.weight` (out). `parameters()` lists base_layer's tensors,
A (r × in), B (out × r), the magnitude (out); every base tensor is frozen. rsLoRA changes the scaling
only (alpha/√r instead of alpha/r): no tensor. `target_modules` is PEFT's: a string is a regex matched
against the whole module name, a list matches a name or a name's last dotted parts, and "all-linear" is
every Linear/Conv1D but the output head (`_maybe_include_all_linear_layers`).

The result is a Profile (the new tensors, modules and calls) and a trainable mask over its parameters:
`spec` turns both into the ModelSpec the rest of zerocalc reads (`ModelSpec.trainable`)."""
import fnmatch
import re
from dataclasses import dataclass, replace

from zerocalc.profile import CallNode, Module, Profile, Tensor

LINEAR_CLASSES = ("Linear", "Conv1D")    # what PEFT's LoRA wraps as lora.Linear (nn.Linear, transformers' Conv1D)
ALL_LINEAR = "all-linear"
PEFT_DEFAULT_ALPHA = 8                   # LoraConfig.lora_alpha's default


@dataclass(frozen=True)
class Lora:
    """PEFT's LoraConfig, the fields that change what is held (and the scaling, for the record)."""
    rank: int
    alpha: float = PEFT_DEFAULT_ALPHA
    dropout: float = 0.0
    targets: str | tuple[str, ...] = ALL_LINEAR    # a regex (str), names (tuple), or "all-linear"
    exclude: str | tuple[str, ...] = ()
    dora: bool = False
    rslora: bool = False
    bias: str = "none"                             # "none" | "all" | "lora_only": which biases train
    task_type: str | None = "CAUSAL_LM"            # PEFT's: None wraps the model in a bare PeftModel

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def describe(self) -> str:
        what = "DoRA" if self.dora else "LoRA"
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return f"{what} r{self.rank} {targets}"


def check_lora(lora: Lora) -> None:
    """ValueError naming the field to fix."""
    if not isinstance(lora.rank, int) or isinstance(lora.rank, bool) or lora.rank <= 0:
        raise ValueError(f"LoRA rank must be a positive whole number, got {lora.rank!r}")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {lora.dropout!r}")
    if lora.bias not in ("none", "all", "lora_only"):
        raise ValueError(f"LoRA bias must be none, all or lora_only (PEFT's), got {lora.bias!r}")
    if not lora.targets:
        raise ValueError("LoRA needs target modules: all-linear, names (q_proj,v_proj) or a regex")


# adapter_config.json fields that change the tensors and that zerocalc does not model: refused by name,
# never answered as if absent. Each maps to the value that means "not used".
_UNMODELLED = {
    "modules_to_save": (None, []),            # a trained copy of whole modules (ModulesToSaveWrapper)
    "layers_to_transform": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "target_parameters": (None, []),          # LoRA on raw parameters (e.g. fused MoE experts)
    "trainable_token_indices": (None, [], {}),
    "lora_bias": (False, None),               # a bias on lora_B
    "use_qalora": (False, None),
    "megatron_config": (None,),
    "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []),
    "arrow_config": (None,),
}


def from_peft_config(d: dict, where: str = "adapter_config.json") -> Lora:
    """A Lora from PEFT's own adapter_config.json (as `LoraConfig.save_pretrained` writes it). Another
    peft_type, or a field that changes the tensors in a way not modelled, is a ValueError naming it."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: not a PEFT adapter config (a JSON object)")
    kind = d.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{where}: peft_type {kind!r}; zerocalc models LoRA (peft_type LORA, with DoRA and "
                         "rsLoRA), not other PEFT methods")
    for key, unused in _UNMODELLED.items():
        if key in d and d[key] not in unused:
            raise ValueError(f"{where}: {key} = {d[key]!r} is not modelled (it changes which tensors exist or "
                             "train); remove it or estimate without it")
    if d.get("init_lora_weights") in ("loftq",) or d.get("loftq_config"):
        raise ValueError(f"{where}: LoftQ initialisation quantizes the base (QLoRA-like): not modelled")
    targets = d.get("target_modules")
    if targets is None:
        raise ValueError(f"{where}: target_modules is null (PEFT then picks per-model defaults); name the "
                         "modules, e.g. [\"q_proj\", \"v_proj\"], or all-linear")
    exclude = d.get("exclude_modules") or ()
    lora = Lora(rank=d.get("r", 8), alpha=d.get("lora_alpha", PEFT_DEFAULT_ALPHA), dropout=d.get("lora_dropout", 0.0),
                targets=targets if isinstance(targets, str) else tuple(targets),
                exclude=exclude if isinstance(exclude, str) else tuple(exclude),
                dora=bool(d.get("use_dora")), rslora=bool(d.get("use_rslora")), bias=d.get("bias", "none"),
                task_type=d.get("task_type"))
    try:
        check_lora(lora)
    except ValueError as err:
        raise ValueError(f"{where}: {err}")
    return lora


# ---------------------------------------------------------------- which modules LoRA wraps

def _named_match(spec: str | tuple[str, ...], name: str) -> bool:
    """PEFT's `check_target_module_exists`: a string is a regex over the whole name; a list matches the
    name or its last dotted parts."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith("." + t) for t in spec)


def output_head(p: Profile) -> int | None:
    """The module `get_output_embeddings()` returns: the last module called in forward, where it is a
    Linear (the LM head; tied or not)."""
    last = next((m for m in reversed(list(_call_order(p.calls))) if p.modules[m].params), None)
    return last if last is not None and p.modules[last].cls in LINEAR_CLASSES else None


def linear_modules(p: Profile) -> list[str]:
    """The model's Linear/Conv1D module names (what `--lora-targets` may name), the head included."""
    return [m.name for m in p.modules if m.cls in LINEAR_CLASSES and m.params]


def targets(p: Profile, lora: Lora) -> tuple[int, ...]:
    """Indices of the modules LoRA wraps. ValueError where none matches (naming the linear modules) or
    a match is not a Linear (LoRA on embeddings and convolutions is not modelled)."""
    head = output_head(p)
    if lora.targets == ALL_LINEAR and p.moe_classes:
        raise ValueError(f"all-linear on {p.name}, a mixture of experts: PEFT 0.21 then also puts LoRA on the fused "
                         f"experts and the router ({', '.join(p.moe_classes)}: ParamWrapper), which zerocalc does not "
                         "model; name the targets instead, e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")
    found = []
    for i, m in enumerate(p.modules):
        if not m.name:
            continue
        if lora.targets == ALL_LINEAR:
            hit = m.cls in LINEAR_CLASSES and bool(m.params) and i != head
        else:
            hit = _named_match(lora.targets, m.name)
        if hit and lora.exclude and _named_match(lora.exclude, m.name):
            hit = False
        if not hit:
            continue
        if m.cls not in LINEAR_CLASSES:
            raise ValueError(f"LoRA target {m.name} is a {m.cls}: zerocalc models LoRA on Linear layers only "
                             "(PEFT's lora.Linear), not on embeddings, convolutions or fused experts")
        found.append(i)
    if not found:
        raise ValueError(f"LoRA targets {_show(lora.targets)} match no module of {p.name}; its linear modules: "
                         f"{', '.join(layer_names(linear_modules(p)))}")
    return tuple(found)


def layer_names(names: list[str]) -> list[str]:
    """Names with layer indices folded ("model.layers.{i}.self_attn.q_proj"), each once, in order."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".{i}", n) for n in names))


def _show(spec) -> str:
    return spec if isinstance(spec, str) else ",".join(spec)


def _in_out(m: Module, p: Profile) -> tuple[int, int]:
    """(in_features, out_features) of a Linear (weight out × in) or a Conv1D (weight in × out)."""
    shape = p.params[m.params[0]].shape
    return (shape[0], shape[1]) if m.cls == "Conv1D" else (shape[1], shape[0])


# ---------------------------------------------------------------- the adapted profile

def with_lora(p: Profile, lora: Lora) -> tuple[Profile, tuple[bool, ...]]:
    """The profile of `get_peft_model(model, LoraConfig(...))`, and which of its tensors train (the
    tensors LoRA adds are those named `.lora_`: `added`). Its calls' `grad` are the full model's:
    `regrad` sets them for what trains."""
    check_lora(lora)
    wrapped = set(targets(p, lora))
    params, trainable, modules, new_index = [], [], [], {}
    seen = {}

    def own(old_params, train=lambda t: False):
        out = []
        for i in old_params:
            if i not in seen:            # a tied tensor: listed once, where `parameters()` first meets it
                seen[i] = len(params)
                params.append(p.params[i])
                trainable.append(train(p.params[i]))
            out.append(seen[i])
        return tuple(out)

    def new(name, shape):
        params.append(Tensor(name, shape))
        trainable.append(True)
        return len(params) - 1

    def bias(kept_by_lora: bool):
        """PEFT's `bias`: "all" trains every bias, "lora_only" those of the wrapped layers."""
        trains = lora.bias == "all" or (lora.bias == "lora_only" and kept_by_lora)
        return lambda t: trains and t.name.endswith("bias")

    for i, m in enumerate(p.modules):
        if i not in wrapped:
            modules.append(m._replace(params=own(m.params, bias(False))))
            new_index[i] = (len(modules) - 1,)
            continue
        fan_in, fan_out = _in_out(m, p)
        first = len(modules)
        base = own(m.params, bias(True))
        a = new(m.name + ".lora_A.default.weight", (lora.rank, fan_in))
        # lora.Linear.forward reads lora_A.weight's dtype (`_cast_input_dtype`) before it calls lora_A:
        # at stage 3 DeepSpeed's parameter getter then registers the partitioned weight as the wrapper's
        # external parameter in the first forward (`ZeROOrderedDict.__getitem__`, parameter_offload.py:80-93),
        # so from then on the wrapper's hooks fetch and release it too.
        modules.append(Module(m.name, "lora.Linear", (a,), m.layer, m.moe))
        modules.append(Module(m.name + ".base_layer", m.cls, base))
        modules.append(Module(m.name + ".lora_dropout.default", "Dropout" if lora.dropout else "Identity", ()))
        modules.append(Module(m.name + ".lora_A.default", "Linear", (a,)))
        modules.append(Module(m.name + ".lora_B.default", "Linear", (new(m.name + ".lora_B.default.weight", (fan_out, lora.rank)),)))
        if lora.dora:
            modules.append(Module(m.name + ".lora_magnitude_vector.default", "DoraLinearLayer",
                                  (new(m.name + ".lora_magnitude_vector.default.weight", (fan_out,)),)))
        new_index[i] = tuple(range(first, len(modules)))

    def call(node: CallNode) -> CallNode:
        idx = new_index[node.module]
        kids = tuple(call(c) for c in node.children)
        if len(idx) == 1:
            return CallNode(idx[0], kids, node.grad)
        wrapper, base, dropout, a, b, *mag = idx
        if not mag:
            # lora.Linear.forward: base_layer(x), then lora_B(lora_A(lora_dropout(x)))
            inner = (CallNode(base, kids), CallNode(dropout), CallNode(a), CallNode(b))
        else:
            # DoRA: base_layer(x), the dropout only where it is one, then the magnitude layer, which
            # runs lora_B(lora_A(·)) on an identity (the weight's norm) and on the input
            ab = (CallNode(a), CallNode(b))
            inner = (CallNode(base, kids),) + ((CallNode(dropout),) if lora.dropout else ()) + (CallNode(mag[0], ab + ab),)
        return CallNode(wrapper, inner, node.grad)

    # PeftModelForCausalLM > LoraModel > the model: two calls without parameters around the forward
    # (each a stage-3 step that prefetches). Without a task_type PEFT makes a bare PeftModel, whose
    # forward calls the model itself (`get_base_model()`): one call.
    peft = (Module("<peft>", "PeftModelForCausalLM", ()), Module("<peft>.base_model", "LoraModel", ()))
    if lora.task_type is None:
        peft = (Module("<peft>", "PeftModel", ()), peft[1])
    shift = len(peft)
    modules = list(peft) + modules
    body = _shifted(call(p.calls), shift)
    root = CallNode(0, (body if lora.task_type is None else CallNode(1, (body,)),))
    out = replace(p, name=f"{p.name} + {lora.describe()}", params=tuple(params), modules=tuple(modules), calls=root)
    return out, tuple(trainable)


def _shifted(node: CallNode, k: int) -> CallNode:
    return CallNode(node.module + k, tuple(_shifted(c, k) for c in node.children), node.grad)


def regrad(p: Profile, trainable: tuple[bool, ...], input_grads: bool = False) -> CallNode:
    """The calls with `grad` (does the output require grad?) as autograd sets it once some tensors are
    frozen: an output requires grad where the call's input did (a trained tensor was used earlier in
    forward) or the call used a trained tensor itself, and where it did in the full model (a
    rotary-embedding table never does). DeepSpeed's stage-3 backward hook fires only for such calls.
    input_grads: the input embeddings' output requires grad whatever trains, as transformers 5.25's
    `activation_checkpointing_enable` (and PEFT's `prepare_model_for_gradient_checkpointing`) make it
    (`enable_input_require_grads`); the input embeddings are the first call holding parameters."""
    flowing = False
    embed = next((m for m in _call_order(p.calls) if p.modules[m].params), None) if input_grads else None

    def walk(node: CallNode) -> CallNode:
        nonlocal flowing
        before = flowing
        flowing = flowing or node.module == embed or any(trainable[i] for i in p.modules[node.module].params)
        kids = tuple(walk(c) for c in node.children)
        grad = node.grad and flowing
        if not node.grad:          # a side input (rotary tables): the main flow is as it was
            flowing = before
        return CallNode(node.module, kids, grad)
    return walk(p.calls)


def _call_order(node: CallNode):
    """The called modules in forward pre-hook order."""
    yield node.module
    for c in node.children:
        yield from _call_order(c)


# ---------------------------------------------------------------- --freeze

def _expand_ranges(pattern: str) -> list[str]:
    """`layers.{0..3}` -> layers.0 ... layers.3 (one range per pattern)."""
    m = re.search(r"\{(\d+)\.\.(\d+)\}", pattern)
    if not m:
        return [pattern]
    lo, hi = int(m.group(1)), int(m.group(2))
    return [pattern[:m.start()] + str(i) + pattern[m.end():] for i in range(lo, hi + 1)]


def _module_matches(pattern: str, name: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def freeze_mask(p: Profile, patterns: tuple[str, ...], trainable: tuple[bool, ...] | None = None) -> tuple[bool, ...]:
    """Which tensors still train once every module matching one of `patterns` is frozen with all it
    contains (a module's name, its last dotted parts, a glob; `{0..7}` a range of layer indices; a tied
    tensor freezes with any module holding it). ValueError naming a pattern that matches nothing."""
    mask = list(trainable) if trainable is not None else [True] * len(p.params)
    for pattern in patterns:
        hit = False
        for expanded in _expand_ranges(pattern.strip()):
            roots = [m.name for m in p.modules if m.name and _module_matches(expanded, m.name)]
            for m in p.modules:
                if any(m.name == r or m.name.startswith(r + ".") for r in roots):
                    for i in m.params:
                        mask[i] = False
                        hit = True
        if not hit:
            raise ValueError(f"--freeze {pattern!r} matches no module holding parameters of {p.name}; its modules "
                             f"include: {', '.join(layer_names([m.name for m in p.modules if m.params])[:24])}")
    return tuple(mask)


# ---------------------------------------------------------------- to a ModelSpec

def spec(p: Profile, lora: Lora | None = None, freeze: tuple[str, ...] = (), name: str | None = None,
         wrapper: bool = True, z3_leaf_moe: bool = True):
    """The ModelSpec of the profile with LoRA applied and/or modules frozen (`ModelSpec.trainable`).
    ValueError where nothing would train."""
    from zerocalc.model import from_profile
    trainable = None
    if lora is not None:
        p, trainable = with_lora(p, lora)
    if freeze:
        trainable = freeze_mask(p, tuple(freeze), trainable)
    if trainable is not None and not any(trainable):
        raise ValueError("nothing trains: every parameter is frozen")
    # PEFT makes its adapters in fp32 (autocast_adapter_dtype): `ModelSpec.wide`
    wide = tuple(".lora_" in t.name for t in p.params) if lora is not None else None
    label = name or p.name
    if lora is not None and name:
        label = f"{name} + {lora.describe()}"
    if freeze:
        label += " (frozen: " + ", ".join(freeze) + ")"
    s = from_profile(replace(p, calls=regrad(p, trainable)) if trainable else p, label, z3_leaf_moe=z3_leaf_moe,
                      wrapper=wrapper)
    if trainable is not None:
        # With activation checkpointing the input embeddings' output requires grad (`regrad`), so backward
        # reaches every call after them, frozen or not: the checkpointed backward comes from those calls.
        ck = from_profile(replace(p, calls=regrad(p, trainable, input_grads=True)), label, z3_leaf_moe=z3_leaf_moe,
                           wrapper=wrapper)
        s = replace(s, checkpointed_backward_trace=ck.checkpointed_backward_trace,
                    checkpointed_recomputed=ck.checkpointed_recomputed,
                    leaf_scans=ck.leaf_scans and (*s.leaf_scans[:2], ck.leaf_scans[2]))
    return replace(s, trainable=trainable, wide=wide)


def with_stream(s, stream: dict):
    """The ModelSpec `s` (of `spec`) with its profile's allocation stream replaced by `stream`, one
    recorded from its own trained tensors (`zerocalc.hf.adapted.stream`), under that stream's attention
    only (the full model's streams under other attentions dropped)."""
    return replace(s, profile=replace(s.profile, stream=stream, attentions=None))


# ---------------------------------------------------------------- what LoRA and a frozen base keep for backward

MASK_BYTES = 1       # CUDA's fused dropout (`native_dropout`) keeps a bool mask; the CPU kernel a mask of the input's dtype


@dataclass(frozen=True)
class _Linear:
    """One Linear call of a layer as the kept-bytes walk sees it (or one matmul of an MoE's experts)."""
    parent: str          # the module calling it ("model.layers.0.self_attn")
    fan_in: int
    trains: bool         # its own weight requires grad (a full fine-tune's linear)
    rank: int = 0        # LoRA's rank (0: not wrapped)
    dropout: bool = False
    attention_output: bool = False   # an attention's last projection: its input is SDPA's output, kept by SDPA
    reads: str = ""      # the tensor it reads where other modules read it too: an MoE block's input
    rows: int = 1        # input rows per token: an MoE's experts see each token top-k times
    grouped: bool = False   # a fused experts' grouped matmul: not F.linear, which zero.Init replaces


def _experts(p: Profile, m: Module, trainable) -> list[_Linear]:
    """A fused experts module (transformers 5's `@use_experts_implementation`: 3-d weights, run as
    `grouped_mm` over the k·T routed rows): its up projection reads the gathered hidden states (h wide),
    its down projection the gated product (the down weight's other dimension); each input kept only for
    its weight's gradient."""
    h = p.dims.get("hidden_size")
    weights = [i for i in m.params if len(p.params[i].shape) == 3]
    k = p.dims.get("experts_per_token", 1)
    out = []
    for n, i in enumerate(weights):
        shape = p.params[i].shape[1:]
        fan_in = h if n == 0 else (shape[0] if shape[1] == h else shape[1])
        out.append(_Linear(m.name, fan_in, trainable[i], rows=k, grouped=True))
    return out


def _layer_linears(p: Profile, layer: CallNode, trainable) -> list[_Linear]:
    """The Linear calls inside one decoder layer's call, in call order (a lora.Linear is one); in an MoE
    block its experts' matmuls, and its router, the block's own linears and the first linears of a
    shared expert marked as reading the block's input (`_Linear.reads`)."""
    out = []
    moe = {}           # module name -> the MoE block it is a child or grandchild of

    def parent_of(name: str) -> str:
        return name.rsplit(".", 1)[0]

    def reads(name: str, fan_in: int) -> str:
        """The MoE block whose input a linear reads: a direct child of the block (a router, a shared
        expert's gate), or the first run of one fan-in in a child module (a shared expert's gate and up)."""
        parent = parent_of(name)
        if parent in moe.values():
            return parent
        block = moe.get(parent, "")
        earlier = [x for x in out if x.parent == parent]
        if block and (not earlier or (out[-1] is earlier[-1] and out[-1].reads == block and out[-1].fan_in == fan_in)):
            return block
        return ""

    def walk(node: CallNode, block: str = ""):
        m = p.modules[node.module]
        if block and parent_of(m.name) == block:
            moe[m.name] = block
        if m.cls == "lora.Linear":
            # with_lora lists the wrapper's base_layer, dropout, lora_A right after it (DoRA calls them otherwise)
            base, drop, a = p.modules[node.module + 1:node.module + 4]
            rank, fan_in = p.params[a.params[0]].shape
            out.append(_Linear(parent_of(m.name), fan_in, any(trainable[i] for i in base.params if
                                                               p.params[i].name.endswith("weight")), rank,
                               drop.cls == "Dropout", reads=reads(m.name, fan_in)))
            return
        if block and any(len(p.params[i].shape) == 3 for i in m.params):
            out.extend(_experts(p, m, trainable))
            return
        if m.params and (m.cls in LINEAR_CLASSES or (block and parent_of(m.name) == block)):
            # a Linear, or an MoE's router (a weight of experts × h, applied with F.linear)
            w = m.params[0]
            fan_in = _in_out(m, p)[0] if m.cls in LINEAR_CLASSES else p.params[w].shape[-1]
            out.append(_Linear(parent_of(m.name), fan_in, trainable[w], reads=reads(m.name, fan_in)))
            return
        for c in node.children:
            walk(c, m.name if m.moe else block)
    walk(layer)
    # An attention module's last projection (o_proj) takes SDPA's output, which SDPA keeps for its backward
    for k, lin in enumerate(out):
        later = [x for x in out[k + 1:] if x.parent == lin.parent]
        if not later and "attn" in lin.parent.rsplit(".", 1)[-1].lower():
            out[k] = replace(lin, attention_output=True)
    return out


def _input_groups(linears: list[_Linear]) -> list[list[_Linear]]:
    """Linears reading one tensor: consecutive calls of one module with the same fan-in (q, k and v; gate
    and up), and every reader of an MoE block's input (`_Linear.reads`); an attention's output projection
    reads its own, and each matmul of fused experts its own gathered rows."""
    groups, by_source = [], {}
    for lin in linears:
        if lin.reads:
            if lin.reads in by_source:
                by_source[lin.reads].append(lin)
            else:
                by_source[lin.reads] = [lin]
                groups.append(by_source[lin.reads])
            continue
        g = groups[-1] if groups else None
        if g and not g[-1].reads and not g[-1].grouped and not lin.grouped and g[-1].parent == lin.parent \
                and g[-1].fan_in == lin.fan_in and not lin.attention_output and not g[-1].attention_output:
            g.append(lin)
        else:
            groups.append([lin])
    return groups


def _frozen_expert_bias_bytes(p: Profile, layer: CallNode, trainable) -> int:
    """Bytes per token fused experts with biases no longer keep once the biases are frozen: each bias is
    gathered per routed row (`bias[expert_ids]`), whose backward keeps the k int64 expert ids a token."""
    total = 0
    for m in (p.modules[k] for k in _call_order(layer)):
        biases = [i for i in m.params if len(p.params[i].shape) == 2]
        if biases and any(len(p.params[i].shape) == 3 for i in m.params) and not any(trainable[i] for i in biases):
            total += 8 * p.dims.get("experts_per_token", 1)
    return total


def _frozen_norm_elements(p: Profile, layer: CallNode, trainable) -> int:
    """Elements per token of the RMSNorm outputs a frozen norm weight no longer keeps: HF's RMSNorm returns
    `weight * x.to(dtype)`, whose product keeps x only for the weight's gradient. A per-head norm (Qwen3's
    q_norm, k_norm: a weight of head_dim) scales every head's elements."""
    d, total = p.dims, 0
    for m in (p.modules[k] for k in _call_order(layer)):
        if m.cls.endswith("RMSNorm") and m.params and not any(trainable[i] for i in m.params):
            width = p.params[m.params[0]].numel
            if width == d.get("head_dim") and width != d.get("hidden_size"):
                width *= d.get("num_kv_heads") if m.name.endswith("k_norm") else d.get("num_heads")
            total += width
    return total


def kept_delta_bytes_per_token(p: Profile, trainable: tuple[bool, ...], compute_bytes: int, adapter_bytes: int,
                               linears_keep_input: bool) -> int:
    """What the decoder layers keep for backward per token beyond a full fine-tune of the same model
    (negative: less), with some weights frozen and LoRA's adapters (`with_lora`). Derived from autograd,
    and checked against PEFT's own model traced on fake tensors (`tests/test_lora_activations.py`):
    - a matmul keeps its input only for the weight's gradient: a frozen linear keeps nothing, unless
      `linears_keep_input` (DeepSpeed's zero.Init replaces F.linear with `zero3_linear_wrap` for the
      rest of the process, `runtime/zero/linear.py`, whose autograd function saves its input always)
      or another op keeps that tensor (SDPA its output, which o_proj reads; a LoRA target's lora_A);
      linears reading one tensor (q, k, v) keep it once;
    - LoRA's `lora.Linear.forward` casts x to the adapter's dtype (`_cast_input_dtype`): where the
      adapters are wider (fp32 under zero.Init, `states.wide_stage3_elements`) each target keeps its own
      copy (a·in); with dropout, the dropout's output (a·in) and CUDA's bool mask (1·in) instead of x;
      lora_A's output (a·r) is kept for lora_B's weight gradient (a: the adapter's bytes);
    - a frozen RMSNorm weight: its product keeps nothing (`_frozen_norm_elements`).
    The first layer, whose input needs no gradient under a frozen embedding, is counted as the others
    (it keeps a few fp32 norm internals less: under 1% of a layer)."""
    b, a = compute_bytes, adapter_bytes
    total = 0

    def layers(node: CallNode):
        if p.modules[node.module].layer:
            yield node
            return
        for c in node.children:
            yield from layers(c)

    for layer in layers(p.calls):
        linears = _layer_linears(p, layer, trainable)
        for lin in linears:
            if lin.rank and lin.dropout:
                total += (a + MASK_BYTES) * lin.fan_in + a * lin.rank
            elif lin.rank:
                total += (a * lin.fan_in if a != b else 0) + a * lin.rank
        for group in _input_groups(linears):
            kept = (linears_keep_input and not group[0].grouped) or \
                any(x.attention_output or x.trains or (x.rank and not x.dropout and a == b) for x in group)
            if not kept:
                total -= b * group[0].fan_in * group[0].rows
        total -= _frozen_expert_bias_bytes(p, layer, trainable)
        total -= b * _frozen_norm_elements(p, layer, trainable)
    return total
