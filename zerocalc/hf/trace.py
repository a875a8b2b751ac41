"""Build a Hugging Face causal LM from its config.json on fake tensors and read its Profile.

`AutoModelForCausalLM.from_config(cfg, dtype=bfloat16)` runs inside `FakeTensorMode` (no memory,
no weights: a 70B model builds in seconds) with weight initialisation skipped; a forward over
one short sequence, with a global forward pre-hook and hook, records the module calls as they nest
(a function that `kernels` made a module is none: `module_calls`), and whether each call's output
requires grad. The parameter tensors are `named_parameters()` (tied weights once), each module's own
ones `named_parameters(recurse=False)` mapped to them by identity. A decoder layer is a
`GradientCheckpointingLayer` (what HF's checkpointing recomputes); an MoE block is a module with an
`experts` child (what `set_z3_leaf_modules` is given).

torch and transformers are imported here only: `zerocalc` itself stays torch-free.
"""
import copy
import functools
import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import replace

from zerocalc.profile import CallNode, Module, Profile, Tensor

TRACE_VERSION = 13       # bump when what the trace records changes: it is part of the cache key
TRACE_TOKENS = 8         # one sequence of 8 tokens: enough to run every module once


class TraceExtraMissing(ImportError):
    """torch or transformers is not installed: the `trace` extra is what to install (unlike a package a
    model's own code imports, which transformers names in its own ImportError)."""


def _imports():
    try:
        import torch
        import transformers
    except ImportError as err:
        raise TraceExtraMissing(f"tracing a config needs torch and transformers ({err.name} is missing): "
                                "pip install 'zerocalc[trace]'") from None
    return torch, transformers


def is_moe_block(m) -> bool:
    """An MoE block: a module with an `experts` child (what `set_z3_leaf_modules` is given)."""
    return "experts" in dict(m.named_children())


def hf_checkpointing(model, on: bool) -> None:
    """Hugging Face's activation checkpointing on or off as the validator turns it on (non-reentrant,
    `zerocalc.hf.families.build_model`), without transformers' deprecation warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()


def hf_config(d: dict):
    """The transformers config object of a config.json's contents."""
    _, transformers = _imports()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    kind = d.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"model_type {kind!r} is not one transformers {transformers.__version__} knows")
    return CONFIG_MAPPING[kind].from_dict(copy.deepcopy(d))   # transformers rewrites nested dicts (rope_scaling) in place


def _get(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def dims(cfg) -> dict:
    """The config's dimensions under zerocalc's names (text config of multimodal ones). Where layers
    differ (Gemma 4's full-attention layers' own head width and key/value heads, `per_layer_config`), the
    config's global values: most layers', what the nearest family shape needs."""
    c = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not hasattr(type(c), "allow_global_per_layer_attribute_access"):
        return _dims(c)
    allowed = c.allow_global_per_layer_attribute_access
    c.allow_global_per_layer_attribute_access = True
    try:
        return _dims(c)
    finally:
        c.allow_global_per_layer_attribute_access = allowed


def _dims(c) -> dict:
    h = _get(c, "hidden_size", "n_embd", "d_model")
    heads = _get(c, "num_attention_heads", "n_head")
    experts = _get(c, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0)
    out = {
        "vocab_size": _get(c, "vocab_size"), "hidden_size": h,
        "num_layers": _get(c, "num_hidden_layers", "n_layer", "num_layers"),
        "num_heads": heads, "num_kv_heads": _get(c, "num_key_value_heads", "num_kv_heads", default=heads),
        "head_dim": _get(c, "head_dim", default=h // heads if h and heads else None),
        "ffn_hidden_size": _get(c, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * h if h else None),
        "tie_embeddings": bool(_get(c, "tie_word_embeddings", default=False)),
        "max_positions": _get(c, "max_position_embeddings", "n_positions"),
    }
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(c, flag, None):
            out[flag] = True
    if experts:
        out["num_experts"] = experts
        out["experts_per_token"] = _get(c, "num_experts_per_tok", "moe_topk", "top_k", default=1)
        out["moe_ffn_hidden_size"] = _get(c, "moe_intermediate_size", "expert_intermediate_size",
                                          default=out["ffn_hidden_size"])
        shared = _get(c, "shared_expert_intermediate_size", default=0)
        n_shared = _get(c, "n_shared_experts", "num_shared_experts", default=0)
        out["shared_ffn_hidden_size"] = shared or n_shared * out["moe_ffn_hidden_size"]
    return out


def output_requires_grad(out) -> bool:
    """Whether a module's output (a tensor, or tensors in dicts, tuples and lists) requires grad."""
    torch, _ = _imports()
    if isinstance(out, torch.Tensor):
        return out.requires_grad
    if isinstance(out, dict):
        return any(output_requires_grad(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return any(output_requires_grad(v) for v in out)
    return False


@contextmanager
def module_calls(model, pre, post):
    """`pre(m, args)` and `post(m, args, out)` around each module call (torch's global forward pre-hook
    and hook), but a function that `kernels` made a module: its operators belong to the module calling
    it, as when it was a function. With `kernels` installed (a dependency of transformers since 5.25,
    optional before) `use_kernel_forward_from_hub` turns a decorated function (`apply_rotary_pos_emb`)
    into a module instance that is the child of no module, and `use_kernelized_func` gives each module
    calling it a private copy, called through it; both are hub layers (`kernel_layer_name`) outside the
    model. Any other module outside the model is still seen (memtrace names it "?")."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    own = {id(m) for m in model.modules()}

    def seen(m) -> bool:
        return id(m) in own or not hasattr(m, "kernel_layer_name")
    h1 = register_module_forward_pre_hook(lambda m, args: pre(m, args) if seen(m) else None)
    h2 = register_module_forward_hook(lambda m, args, out: post(m, args, out) if seen(m) else None)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def build(cfg):
    """The model on fake tensors, bf16, weights not initialised but tied as `from_config` ties them."""
    torch, transformers = _imports()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, no_init_weights(), _casts_in_place():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.tie_weights()   # skipped with the initialisation (`init_weights` ties)
    model.train()
    known_positions(model)
    _sets_in_order(model)
    return model, mode


class _InOrder(set):
    """A set whose strings iterate sorted: the same order in every process, whatever the hash seed."""

    def __iter__(self):
        items = list(super().__iter__())
        return iter(sorted(items) if all(isinstance(x, str) for x in items) else items)


def _sets_in_order(model) -> None:
    """The model's code iterates its sets in one order in every process. Gemma 3 makes its sliding and
    full rotary tables `for layer_type in set(config.layer_types)`, in the order of the strings' hashes,
    which PYTHONHASHSEED picks: the allocation stream (which free ends which allocation) would differ
    between two traces of one config. `set` in the model's own modules is `_InOrder`."""
    import sys
    for cls in {type(m) for m in model.modules()}:
        for k in cls.__mro__:
            module = sys.modules.get(k.__module__)
            if module is not None and module.__name__.startswith("transformers.models."):
                module.set = _InOrder


@contextmanager
def _casts_in_place():
    """A module cast while the model is built (DeepSeek-V4's norms, `RMSNorm(...).to(torch.float32)`)
    casts its fake parameters in place (`param.data = cast`), as torch does a real module's: for a fake
    tensor torch swaps the parameter for its cast instead, which the fake tensor's weak reference
    forbids ("Couldn't swap"). The parameters are the same objects either way, tied ones too."""
    import torch
    original = torch.nn.Module._apply

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        with torch.no_grad():
            for p in self._parameters.values():
                if p is not None:
                    p.data = fn(p)
        for key, b in self._buffers.items():
            if b is not None:
                self._buffers[key] = fn(b)
        return self
    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original


def known_positions(model) -> None:
    """Each rotary embedding is handed its position ids as values the fake tensors know: 0 … s − 1 in
    every row, as in a batch of whole sequences. Some branch on them in Python (Phi-3.5-MoE's LongRoPE
    picks its scale by `torch.max(position_ids) + 1`), which a fake tensor, holding no values, cannot
    answer; a known one answers it (FakeTensorMode computes an operator whose inputs are all known, and
    keeps a one-element result known). The same tensor is marked, so the operators and the memory
    traced are the same either way."""
    import inspect
    torch, _ = _imports()
    from torch.utils._python_dispatch import _disable_current_modes

    def know(ids):
        if getattr(ids, "constant", 0) is None:      # a fake tensor whose values are not known
            with _disable_current_modes():      # made outside every mode: not the model's operators or memory
                ids.constant = torch.arange(ids.shape[-1], dtype=ids.dtype).expand(tuple(ids.shape)).clone()

    for m in model.modules():
        params = list(inspect.signature(m.forward).parameters)
        if type(m).__name__.endswith("RotaryEmbedding") and "position_ids" in params:
            at = params.index("position_ids")

            def hook(m, args, kwargs, at=at):
                ids = kwargs.get("position_ids", args[at] if len(args) > at else None)
                if ids is not None:
                    know(ids)
            m.register_forward_pre_hook(hook, with_kwargs=True)


def decoder_layer(model):
    """is_layer(module) for `model`: its decoder layers, the `GradientCheckpointingLayer`s of its text
    model (`get_decoder`). A multimodal model's vision tower has its own, which a batch of tokens never
    runs (Gemma 3's SigLIP encoder layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    try:
        text = model.get_decoder()
    except Exception:     # a model with no rule for finding its decoder: every such layer
        text = model
    ids = {id(m) for m in text.modules() if isinstance(m, GradientCheckpointingLayer)} \
        or {id(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)}
    return lambda m: id(m) in ids


ZERO_INIT_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


def keep_in_fp32(model):
    """DeepSpeed 0.19.8's pattern of the buffers it keeps in fp32 under bf16 training, at every stage
    (`runtime/keep_in_fp32.py`, `data_types.keep_in_fp32_modules` "auto"): the names each module lists in
    `_keep_in_fp32_modules_strict` (DeepSeek-V3's `e_score_correction_bias`), under that module's
    name, searched in the full buffer names; None where none is listed."""
    import re
    patterns = set()
    for module_name, child in model.named_modules():
        for name in getattr(child, "_keep_in_fp32_modules_strict", None) or ():
            pattern = name.replace("*", ".*")
            patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    return re.compile("|".join(sorted(patterns))) if patterns else None


def zero_init_kept(d: dict, layer_names: list[str], buffer_names: list[str]) -> dict[str, str]:
    """{buffer name: dtype} of the floating-point buffers that keep their own dtype when the model is
    built under DeepSpeed's zero.Init (0.19.8, `_add_tensor_creation_wrappers`), as Hugging Face
    builds it for stage 3: its wrappers give every floating-point tensor `ZERO_INIT_CONSTRUCTORS` make
    the training dtype, so a buffer they make (Llama's default rotary `inv_freq`, an `arange` in
    float) takes it, and one the model computes after them from integers (a YaRN or Llama-3
    `inv_freq`) keeps its own, and DeepSpeed makes fp32 again those it keeps so (`keep_in_fp32`).
    Read from a shallow copy (`layer_names`: the decoder layers; deeper ones as the copy's layer of
    their place in the layers' pattern, `memtrace.period`) built with the constructors so wrapped to a
    marker dtype, fp16."""
    torch, _ = _imports()
    from zerocalc.hf.memtrace import _shallow, aligned_depth, period, stack
    lead, p = stack(d)[1], period(d)
    n = aligned_depth(min(len(layer_names), 1 + lead + p), len(layer_names), p)
    originals = {c: getattr(torch, c) for c in ZERO_INIT_CONSTRUCTORS}

    def wrapped(fn):
        def make(*args, **kwargs):
            t = fn(*args, **kwargs)
            return t.to(torch.float16) if t.is_floating_point() else t
        return make
    for c, fn in originals.items():
        setattr(torch, c, wrapped(fn))
    try:
        model, _ = build(hf_config(_shallow(d, n)))
    finally:
        for c, fn in originals.items():
            setattr(torch, c, fn)
    under = {name: str(b.dtype).replace("torch.", "") for name, b in model.named_buffers() if b.is_floating_point()}
    keep = keep_in_fp32(model)
    under.update({name: "float32" for name in under if keep and keep.search(name)})

    def shallow_name(name: str) -> str:
        for i, layer in enumerate(layer_names[n:], n):
            if name.startswith(layer + "."):
                return layer_names[lead + 1 + (i - lead - 1) % p] + name[len(layer):]
        return name
    return {name: under[shallow_name(name)] for name in buffer_names
            if under.get(shallow_name(name), "float16") != "float16"}


def saving_dropout(m) -> bool:
    """A dropout module at p > 0: in training it keeps its mask for backward though it has no parameters
    (at p = 0 torch returns its input and keeps nothing), so a checkpointed layer's recomputation is
    started by its backward and runs up to it (`arch._backward_steps`; DeepSpeed's hook order on GPT-2,
    data/README.md, "GPT-2 with its dropout")."""
    import torch
    return isinstance(m, torch.nn.modules.dropout._DropoutNd) and float(m.p) > 0


def _zero3_linear(x, weight, bias=None):
    """F.linear as DeepSpeed's stage 3 replaces it (`zero3_linear_wrap`, an autograd Function that
    saves the weight itself, which the release empties): the views that `record` then sees saved are
    those other operators keep (a fused experts' `weight.transpose(-2, -1)` into grouped_mm)."""
    torch, _ = _imports()

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight, bias)
            out = x.matmul(weight.t())
            return out if bias is None else out + bias

        @staticmethod
        def backward(ctx, grad):
            x, weight, bias = ctx.saved_tensors
            return grad.matmul(weight), None, None
    return Linear.apply(x, weight, bias)


def record(model, forward, is_layer, is_moe=is_moe_block, external=False):
    """(parameters as (name, shape), modules, the root call) of `model` as one `forward()` calls it:
    `module.parameters()` order, tied weights once; each module's own parameters; the calls nested,
    with whether each output requires grad; whether autograd saved a view of a module's own parameters
    (`Module.views`, with F.linear run as DeepSpeed's stage 3 runs it). is_layer(module): a unit
    activation checkpointing recomputes.
    external: also each module's reads of parameters whose module is not being called (the seed's
    nn.MultiheadAttention reads out_proj's weight and bias without calling it); DeepSpeed's stage 3
    fetches such a parameter when it is read and registers it with the module reading it
    (`ZeROOrderedDict.__getitem__`, `register_external_parameter`), so it is fetched with that module."""
    named = list(model.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    mindex, unique = {}, []
    for qual, m in model.named_modules(remove_duplicate=False):
        if id(m) not in mindex:
            mindex[id(m)] = len(unique)
            unique.append((qual, m))
    own = [tuple(sorted(index[id(p)] for _, p in m.named_parameters(recurse=False))) for _, m in unique]
    reads = [set() for _ in unique]
    stack = [[None, []]]    # (module index, children) of the calls in progress

    def pre(m, args):
        stack.append([mindex.get(id(m)), []])

    def post(m, args, out):
        idx, children = stack.pop()
        if idx is None:      # a module the model makes while it runs (BigBird's), none of its own: DeepSpeed
            stack[-1][1].extend(children)     # hooks none such, so the calls under it stand in its place
        else:
            stack[-1][1].append(CallNode(idx, tuple(children), output_requires_grad(out)))

    def read(p):
        i = index.get(id(p))
        calling = {c for c, _ in stack[1:]}
        if i is not None and stack[-1][0] is not None and not any(i in own[c] for c in calling if c is not None):
            reads[stack[-1][0]].add(i)

    class Reads(type(unique[0][1]._parameters)):
        def __getitem__(self, k):
            v = super().__getitem__(k)
            read(v)
            return v
    kept = [m._parameters for _, m in unique]
    if external:
        for _, m in unique:
            m._parameters = Reads(m._parameters)
    viewed = set()        # parameters of which autograd saved a view for backward

    def pack(t):
        base = getattr(t, "_base", None)
        if base is not None and id(base) in index:
            viewed.add(index[id(base)])
        return t
    torch, _ = _imports()
    linear = torch.nn.functional.linear
    torch.nn.functional.linear = _zero3_linear    # as DeepSpeed's stage 3 runs every F.linear
    try:
        with module_calls(model, pre, post), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        torch.nn.functional.linear = linear
        for (_, m), p in zip(unique, kept):
            m._parameters = p
    roots = stack[0][1]
    if len(roots) != 1:
        raise RuntimeError(f"expected one root call, recorded {len(roots)}")
    modules = tuple(Module(q, type(m).__name__, o, is_layer(m), is_moe(m), tuple(sorted(r)), saving_dropout(m),
                           bool(viewed.intersection(o)))
                    for (q, m), o, r in zip(unique, own, reads))
    return tuple(Tensor(n, tuple(p.shape)) for n, p in named), modules, roots[0]


@contextmanager
def quiet():
    """Transformers' warnings about the config (its rope keys, a decoder used alone) and torch's log,
    with a traceback, of an operator the fake tensors could not run, kept off the user's terminal: what
    the trace could not read is said once, in the estimate's notes or its error."""
    import logging
    import warnings
    _, transformers = _imports()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, verbosity = fake_log.level, transformers.logging.get_verbosity()
    fake_log.setLevel(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        fake_log.setLevel(level)
        transformers.logging.set_verbosity(verbosity)


def trace(d: dict, name: str = "", activations: bool = True, steps: bool = True) -> Profile:
    """The Profile of a config.json's contents (a dict); activations: also the layers' kept bytes
    (`memtrace.config_activations`, read again at length where a chunked kernel keeps more,
    `memtrace.at_length`); steps: the operators and FLOPs of a micro-step (`optrace.config_steps`:
    eight forwards and backwards of one or two layers)."""
    with quiet():
        return _trace(d, name, activations, steps)


def _trace(d: dict, name: str, activations: bool, steps: bool) -> Profile:
    torch, transformers = _imports()
    cfg = hf_config(d)
    model, mode = build(cfg)
    with mode:
        params, modules, root = record(model, lambda: model(input_ids=torch.zeros(1, TRACE_TOKENS, dtype=torch.long),
                                                            use_cache=False),
                                       decoder_layer(model))
    layer_names = [m.name for m in modules if m.layer]
    kept = zero_init_kept(d, layer_names, [n for n, _ in model.named_buffers()])
    fp32 = keep_in_fp32(model)         # DeepSpeed's engine makes these fp32 at every stage

    def dtype(name, b):
        held = torch.float32 if fp32 and b.is_floating_point() and fp32.search(name) else b.dtype
        return str(held).replace("torch.", "")
    buffers = tuple(Tensor(n, tuple(b.shape), dtype(n, b), kept.get(n, "")) for n, b in model.named_buffers())
    untraced = {}          # what the trace could not read, and why: formulas or the ratio stand in (`_attempt`)
    layers = len([m for m in modules if m.layer])
    acts = stream = attentions = counted = None
    if activations:
        from zerocalc.hf import memtrace
        acts = _attempt(untraced, "activations", lambda: memtrace.config_activations(d, layers))
        stream = _attempt(untraced, "stream", lambda: memtrace.step_stream(d))
        if acts is not None:
            acts, stream = memtrace.at_length(d, layers, acts, stream)
    if stream is not None and stream.get("attention") != "sdpa":
        # SDPA (zerocalc's and the validator's default) where the config picks another attention: its
        # activations and stream as the attention modules dispatch it (`memtrace.dispatching`)
        def sdpa():
            acts, stream = memtrace.at_length(d, layers, memtrace.config_activations(d, layers, attention="sdpa"),
                                              memtrace.step_stream(d, "sdpa"), "sdpa")
            return {"sdpa": {"activations": acts, "stream": stream}}
        attentions = _attempt(untraced, "sdpa", sdpa)
    if steps:
        from zerocalc.hf import optrace
        counted = _attempt(untraced, "steps", lambda: optrace.config_steps(d, layers))
        if counted is None:
            untraced.setdefault("steps", "neither SDPA nor eager attention of its code could be set")
    p = Profile(name or d.get("_name_or_path") or cfg.model_type, cfg.model_type, dims(cfg),
                params, buffers, modules, root,
                {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                 "trace_version": TRACE_VERSION, "config_sha256": config_digest(d),
                 **({"untraced": untraced} if untraced else {})}, acts, stream, counted, attentions)
    unplayable = stream is not None and _unplayable(p)
    if not unplayable:
        return p
    return replace(p, stream=None, source={**p.source, "untraced": {**untraced, "stream": unplayable}},
                   attentions={k: {**v, "stream": None} for k, v in attentions.items()} if attentions else None)


def _unplayable(p: Profile) -> str | None:
    """Why the profile's allocation streams do not play as the whole model, or None: each attention's,
    at stages 2 and 3 (its gathers), checkpointed or not, at the model's depth. The stream is traced on
    a shallow copy and its middle layer repeated (`zerocalc.sequence`), which needs layers alike past
    the leading dense ones of an MoE stack; where they are not, the trace says so once, here, and the
    calibrated ratio stands in, rather than every estimate failing."""
    from zerocalc import sequence
    from zerocalc.model import from_profile
    from zerocalc.training import Setup, Stage
    spec = from_profile(p)
    for attention in {"sdpa", p.stream["attention"]}:
        for stage in (Stage.GRADIENTS, Stage.PARAMETERS):
            for checkpointing in (False, True):
                setup = Setup(stage=stage, dp=2, seq_len=64, attention=attention, activation_checkpointing=checkpointing)
                try:
                    sequence.peaks_bytes(spec, setup)
                except Exception as err:     # the stream's own structure, not the setup's
                    return f"it does not play as the whole model ({why(err)})"
    return None


def _attempt(untraced: dict, key: str, read):
    """read()'s result; where the model's code defeats it (a forward fake tensors cannot run, a stream
    that does not cut into repeated layers or changes with the shape), None, and why in
    `untraced[key]`: the activation formulas, the calibrated reserved ratio or a Llama layer's
    operators stand in, and `zerocalc estimate`'s note says which and why (`resolve.notes`)."""
    try:
        return read()
    except Exception as err:      # any failure of the model's code on fake tensors
        untraced[key] = why(err)
        return None


def why(err: Exception) -> str:
    """An exception as one short line: its type and its message's first line."""
    text = (str(err).strip().splitlines() or [""])[0]
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def config_digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zerocalc", "profiles")


def _versions() -> tuple[str, str]:
    """The installed torch and transformers versions, without importing them (seconds) when the
    cache answers."""
    from importlib import metadata
    try:
        return metadata.version("torch"), metadata.version("transformers")
    except metadata.PackageNotFoundError:
        _imports()        # says what to install
        raise


def cache_key(d: dict) -> str:
    """The config's content, the transformers and torch versions and what the trace records."""
    torch_version, transformers_version = _versions()
    text = json.dumps({"config": d, "transformers": transformers_version, "torch": torch_version,
                       "trace_version": TRACE_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# The code a trace runs: a failure kept by another version of it is tried again (`resolve._failure_file`)
TRACER_SOURCES = ("hf/trace.py", "hf/memtrace.py", "hf/optrace.py", "hf/cudaops.py", "profile.py")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 of the tracer's source files, as installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in TRACER_SOURCES:
        with open(os.path.join(root, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def cache_path(d: dict) -> str:
    """Where `cached_trace` keeps the profile of `d`."""
    return os.path.join(cache_dir(), cache_key(d) + ".json")


def cached_trace(d: dict, name: str = "") -> Profile:
    """`trace`, kept in the user's cache directory (XDG_CACHE_HOME/zerocalc/profiles)."""
    from zerocalc import profile as P
    path = cache_path(d)
    if os.path.exists(path):
        try:
            p = P.load(path)
            return replace(p, name=name or p.name)
        except (ValueError, KeyError, json.JSONDecodeError):
            pass
    p = trace(d, name)
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    P.save(p, tmp)
    os.replace(tmp, path)
    return p
