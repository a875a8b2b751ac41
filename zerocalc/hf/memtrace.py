"""The allocation event stream of one training step's forward and backward, recorded on fake
tensors: every storage an operator creates is born with its bytes, and dies when its last reference
goes (a weak reference on the storage, as `torch.distributed._tools.mem_tracker` keeps). Each
event carries the module call it happened in (forward pre/post hooks) and the phase.

What this records is what the CPU kernels' fake implementations allocate; where CUDA's kernels
allocate otherwise (`zerocalc.sequence` holds the H200 histories' facts) the difference is stated
where the stream is compared (`tests/test_memtrace.py`).

What is recorded is a step after one that is not (`WARM_UP`): a model's code may do something on its
first step only (LongRoPE's rotary embedding makes its long inverse frequencies once and keeps them:
Phi-3.5-mini, Phi-4-mini), and a job's every step but its first is the one after.
"""
import functools
import json
import weakref
from contextlib import contextmanager

from zerocalc.hf.cudaops import allocation_order, cuda_dispatch
from zerocalc.hf.trace import _imports, decoder_layer, hf_checkpointing, module_calls


def _new_storages(out, alive: dict, func=None):
    """(key, storage) of each storage an operator's output holds that `alive` does not know yet, in the
    order CUDA's kernel of `func` allocates them (`cudaops.allocation_order`); the caller enters it in
    `alive` before the next is looked at, so a storage two outputs share comes once."""
    import torch
    from torch.utils._pytree import tree_flatten
    for t in tree_flatten(allocation_order(str(func), out))[0]:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st._cdata not in alive:
                yield st._cdata, st


@contextmanager
def unpacked_batch():
    """Transformers checks the position ids for packed sequences, a data-dependent test it cannot make
    on fake tensors (`masking_utils.find_packed_sequence_indices`: under tracing it keeps the packed
    mask), and then builds an explicit causal mask: a bool [B, 1, s, s] tensor, a per-layer float copy
    of it saved by SDPA, and for grouped-query attention K and V repeated to every head
    (`integrations.sdpa_attention.use_gqa_in_sdpa` needs no mask). A real batch of whole sequences is
    not packed: the mask is skipped, SDPA runs causal with `enable_gqa` and saves K and V at their own
    width (the H200 histories' Llama layer, `zerocalc.sequence._llama_forward`). This says so."""
    from transformers import masking_utils
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextmanager
def dispatching(model, attention: str | None):
    """The model's attention modules calling `attention`'s function (they look it up in
    `ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation` at every call), where the model was
    built with another: how a model whose class does not offer SDPA (Gemma-2, for its soft-capping) is
    traced as transformers 5.17 ran it when asked for SDPA, the keyword arguments SDPA has no use for
    (the soft-cap) ignored (the H200 rows of Gemma-2 with `attention` sdpa, `data/h200-hf-time-a.csv`:
    25.28 GiB allocated, 1.06 GiB less than with eager; later transformers refuse SDPA for it)."""
    own = model.config._attn_implementation
    if not attention or attention == own:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    function = ALL_ATTENTION_FUNCTIONS[attention]

    def lenient(*args, softcap=None, **kwargs):
        return function(*args, **kwargs)
    ALL_ATTENTION_FUNCTIONS[attention] = lenient
    model.config._attn_implementation = attention
    try:
        yield
    finally:
        model.config._attn_implementation = own
        del ALL_ATTENTION_FUNCTIONS[attention]


def record(model, mode, input_ids, loss_fn=None):
    """(events, names): events are ("alloc", handle, bytes, module, phase) and ("free", handle, phase);
    parameters and buffers existing before the call are not events."""
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode

    events, alive, state = [], {}, {"phase": "forward", "module": "", "next": 0}
    stack = []

    def on_free(key):
        h = alive.pop(key, None)
        if h:
            events.append(("free", h, state["phase"]))

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key, st in _new_storages(out, alive, func):
                state["next"] += 1
                alive[key] = state["next"]
                events.append(("alloc", state["next"], st.nbytes(), state["module"], state["phase"], str(func)))
                weakref.finalize(st, on_free, key)
            return out

    for t in list(model.parameters()) + list(model.buffers()) + [input_ids]:
        alive[t.untyped_storage()._cdata] = 0       # existing before the step: not events
    names = {id(m): n for n, m in model.named_modules()}

    def pre(m, args):
        stack.append(state["module"])
        state["module"] = names.get(id(m), "?")

    def post(m, args, out):
        events.append(("exit", names.get(id(m), "?"), state["phase"]))
        state["module"] = stack.pop()

    with module_calls(model, pre, post), mode, unpacked_batch(), cuda_dispatch(), Recorder():
        logits = model(input_ids=input_ids, use_cache=False).logits
        state["phase"] = "loss"
        loss = (loss_fn or (lambda x: torch.nn.functional.cross_entropy(
            x.float().view(-1, x.shape[-1]), input_ids.view(-1))))(logits)
        del logits
        state["phase"] = "backward"
        state["module"] = ""
        loss.backward()
        del loss
    return events


def layers_kept_bytes(model, mode, batch: int, seq: int, with_head: bool = False):
    """Bytes the decoder layers keep for backward at the end of forward: what is alive when the module
    after the last layer is called (the model's code has dropped the last layer's input by then
    unless backward needs it), less what was alive when the first layer was called and less the last
    layer's output (the next module's input, not the layers')."""
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.modeling_layers import GradientCheckpointingLayer

    alive, state = {}, {"bytes": 0, "first": None, "last": None, "out": 0, "serial": 0}
    born = {}        # storage -> its creation's serial number

    def on_free(key):
        state["bytes"] -= alive.pop(key, 0)
        born.pop(key, None)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key, st in _new_storages(out, alive, func):
                alive[key] = st.nbytes()
                state["serial"] += 1
                born[key] = state["serial"]
                state["bytes"] += st.nbytes()
                weakref.finalize(st, on_free, key)
            return out

    for t in list(model.parameters()) + list(model.buffers()):
        alive[t.untyped_storage()._cdata] = 0

    def pre(m, args):
        if isinstance(m, GradientCheckpointingLayer):
            if state["first"] is None:
                state["first"] = state["bytes"]
            state["last"], state["inside"] = None, True
        elif not state.get("inside") and state["first"] is not None and state["last"] is None:
            state["last"] = state["bytes"]      # the first call after the last layer: its input released
            state["head_from"] = state["serial"]

    def post(m, args, out):
        if isinstance(m, GradientCheckpointingLayer):
            state["inside"] = False
            first = out[0] if isinstance(out, tuple) else out
            state["out"] = first.untyped_storage().nbytes() if isinstance(first, torch.Tensor) else 0
        elif m is model and "head_from" in state:
            # The head's kept tensors: made after the last layer (final norm, output projection, the
            # model's code after it: Gemma-2's logit soft-capping keeps its tanh) and alive when the
            # model returns, the logits aside (the loss path's formulas count those).
            logits = getattr(out, "logits", None)
            skip = logits.untyped_storage()._cdata if logits is not None else None
            state["head"] = sum(alive[k] for k, n in born.items() if n > state["head_from"] and k != skip)

    with module_calls(model, pre, post), mode, unpacked_batch(), cuda_dispatch(), Counter():
        ids = torch.zeros(batch, seq, dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits
        del logits
    if state["first"] is None or state["last"] is None:
        raise RuntimeError("no decoder layer (GradientCheckpointingLayer) was called")
    layers = state["last"] - state["first"] - state["out"]
    return (layers, state.get("head", 0)) if with_head else layers


def layer_activations(model, mode, seqs=(32, 64)) -> dict:
    """The layers' kept bytes as a·T + c·B·s² (T = B·s tokens; c: attention probabilities kept by an
    eager attention, 0 with SDPA), from two forwards of one sequence at two lengths, in the model's
    dtype (bf16 as traced); and what the head keeps per token (`layers_kept_bytes`)."""
    s1, s2 = seqs
    layers_kept_bytes(model, mode, 1, s1)           # the first forward, not counted (the module's docstring)
    (k1, _), (k2, head2) = layers_kept_bytes(model, mode, 1, s1, True), layers_kept_bytes(model, mode, 1, s2, True)
    # k = a·s + c·s²: two equations in a and c
    c = (k2 * s1 - k1 * s2) / (s1 * s2 * (s2 - s1))
    a = (k1 - c * s1 * s1) / s1
    if c < 0.5:
        # No quadratic term (SDPA): what does not grow with the tokens (a position table cut per length,
        # an MoE's fake routing, a small model's weight copy) must not extrapolate as s²; the slope
        # between the two lengths is the per-token term.
        c, a = 0.0, (k2 - k1) / (s2 - s1)
    return {"bytes_per_token": round(a, 3), "bytes_per_sequence_squared": round(c, 3),
            "head_bytes_per_token": round(head2 / s2, 3), "dtype": "bfloat16", "traced_at": [s1, s2]}


SCAN_LAYERS = 8      # the decoder layers read for an MoE stack's leading dense ones


def stack(d: dict) -> tuple[int, int]:
    """(decoder layers, the dense layers an MoE stack leads with) of the model a config.json describes,
    as transformers builds it: a multimodal file's text model (Gemma 3's `text_config`, beside its
    vision tower), its config class's default where the file gives none. The dense layers are read from
    the model, whatever its config calls them (DeepSeek's `first_k_dense_replace`, AFMoE's
    `num_dense_layers`): those before the first layer with an MoE block (an `experts` child) among its
    first `SCAN_LAYERS`; 0 for a dense model."""
    layers = _layer_count(d)
    return layers, _leading_dense(json.dumps(d, sort_keys=True), _ending_alike(d, min(layers, SCAN_LAYERS), layers))


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _layer_count(d: dict) -> int:
    """The decoder layers the config gives, else (a multimodal file, a class default) as transformers
    builds it."""
    given = next((d[k] for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    if given is not None:
        return given
    from zerocalc.hf.trace import _get, hf_config
    return _get(hf_config(d).get_text_config(), *LAYER_KEYS)


@functools.lru_cache(maxsize=8)
def _leading_dense(config: str, scanned: int) -> int:
    from zerocalc.hf.trace import build, hf_config, is_moe_block
    model, _ = build(hf_config(_shallow(json.loads(config), scanned)))
    is_layer = decoder_layer(model)
    moe = [any(is_moe_block(c) for c in m.modules()) for m in model.modules() if is_layer(m)]
    return moe.index(True) if any(moe) else 0


PERIOD_SCAN = 24     # the decoder layers recorded for the pattern their events repeat with (periods up to 7)


def period(d: dict, attention: str | None = None) -> int:
    """How many decoder layers the pattern of a model's layers spans past its leading dense ones (1:
    every layer alike), read from its own events: one step of a shallow copy of `PERIOD_SCAN` layers
    is recorded and cut into layers (`_canonical`), and the period is the smallest p with each layer's
    forward and backward equal to those of the layer p on, over at least two periods. Hybrid models
    interleave kinds: Qwen3-Next and Qwen3.5 three linear-attention layers to one full, Gemma 4 five
    sliding-window layers to one full of wider heads, SmolLM3 every fourth layer without rotary
    positions. Left out of the comparison: the first period past the leading layers (the first layer
    of a kind frees, in backward, what the model made for that kind: `sequence.played_as`) and the
    copy's last two layers (the last one's output is the head's input; a config may force the last
    layer's kind). Where its layers repeat no pattern, the period is the model's depth: the activations,
    stream and operators are then traced on the whole model. A model of fewer than 5 layers past the
    leading ones is taken as alike (the stream is then traced whole, `stream_depth`)."""
    return _period(json.dumps(d, sort_keys=True), attention)


@functools.lru_cache(maxsize=8)
def _period(config: str, attention: str | None) -> int:
    from zerocalc.hf.trace import build, hf_config
    d = json.loads(config)
    total, lead = stack(d)
    scan = _ending_alike(d, min(total, lead + PERIOD_SCAN), total)
    model, mode = build(hf_config(_shallow(d, scan)))
    with dispatching(model, attention):
        record_step(model, mode, *WARM_UP)
        segs = segments_at(model, mode, scan, False, *STREAM_SHAPES[1], layer_backward=True)
    layers = [(repr(segs[f"F{i}"]), repr(segs[f"B{i}"])) for i in range(lead, scan - 2)]
    if len(layers) < 3:       # too few layers to compare: as every layer alike (the stream is the whole model's)
        return 1
    p = 1
    while 3 * p <= len(layers):
        compared = layers[p:]
        if all(a == b for a, b in zip(compared, compared[p:])):
            return p
        p += 1
    return total              # no pattern: the copies are the whole model


def _ending_alike(d: dict, depth: int, total: int) -> int:
    """The deepest copy of at most `depth` layers whose last layer is what the config says of the
    model's last (every per-layer list's entry, a per-layer table's), else `depth`: Gemma 4's config
    makes a copy's last layer full-attention and refuses one whose full-attention layers then differ."""
    entries = [v for _, v in _per_layer(d, total)]

    def entry(value, i):
        if isinstance(value, list):
            return value[i]
        return next((v for k, v in value.items() if int(k) == i), None)
    for n in range(depth, max(depth // 2, 1) - 1, -1):
        if all(entry(v, n - 1) == entry(v, total - 1) for v in entries):
            return n
    return depth


def aligned_depth(least: int, total: int, p: int) -> int:
    """The fewest layers, at least `least`, of a shallow copy whose last layer has the whole model's
    last layer's place in the pattern of period p (layers ≡ total mod p); the whole model where that
    is not fewer. A copy of this depth and one of p more differ by one whole period."""
    return min(total, least + (total - least) % p)


def _shallow(d: dict, layers: int) -> dict:
    """The config with its first `layers` decoder layers, and what it says per layer cut to match: a
    list with one entry per layer (`layer_types`, DeepSeek-V3.2's and EXAONE's `mlp_layer_types`,
    SmolLM3's `no_rope_layers`, Ling's `swiglu_limits`) to its first `layers`, a table keyed by layer
    index (dots's `per_layer_config`) to theirs; config classes refuse a copy whose lists are longer
    than its stack. A multimodal file's text model is cut so."""
    d = dict(d)
    if isinstance(d.get("text_config"), dict) and not any(k in d for k in LAYER_KEYS):
        d["text_config"] = _shallow(d["text_config"], layers)
        return d
    total = _layer_count(d)
    for key in LAYER_KEYS:
        if key in d:
            d[key] = layers
    d.setdefault("num_hidden_layers", layers)
    for key, value in _per_layer(d, total):
        d[key] = value[:layers] if isinstance(value, list) else {k: v for k, v in value.items() if int(k) < layers}
    return d


# Keys that may hold as many entries as the model has layers without being per layer
_NOT_PER_LAYER = frozenset({"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "id2label", "label2id"})


def _per_layer(d: dict, total: int) -> list:
    """(key, value) of what a config of `total` layers says per layer: a list with one entry per layer,
    a table keyed by layer index."""
    return [(key, value) for key, value in d.items() if key not in _NOT_PER_LAYER and (
        isinstance(value, list) and len(value) == total
        or isinstance(value, dict) and value and all(str(k).isdigit() and int(k) < total for k in value))]


def config_activations(d: dict, num_layers: int, seqs=(32, 64), attention: str | None = None) -> dict:
    """`layer_activations` of the whole stack from two shallow copies of the model, n1 and n1 + p
    layers (p: the layers' `period`; n1 covers the leading dense layers of an MoE stack, `stack`, and
    a layer of each kind, and puts the copies' last layer where the model's is in the pattern,
    `aligned_depth`): the first n1 layers as traced, each further period as the one the second copy
    adds. Decoder layers after the leading ones repeat what they keep with the pattern (the kept bytes
    do not depend on a layer's position), so this equals tracing the whole stack at a fraction of the
    time. `attention`: traced under that one (`dispatching`), else the config's own."""
    from zerocalc.hf.trace import build, hf_config
    p = period(d, attention)
    n = aligned_depth(min(num_layers, stack(d)[1] + p), num_layers, p)
    shallow = []
    for layers in sorted({n, min(n + p, num_layers)}):
        model, mode = build(hf_config(_shallow(d, layers)))
        with dispatching(model, attention):
            shallow.append((layers, layer_activations(model, mode, seqs)))
    (n1, a1), (n2, a2) = shallow[0], shallow[-1]
    out = dict(a1)
    for key in ("bytes_per_token", "bytes_per_sequence_squared"):
        step = a2[key] - a1[key] if n2 > n1 else 0.0
        out[key] = round(a1[key] + (num_layers - n1) // p * step, 3)
    out["head_bytes_per_token"] = a2.get("head_bytes_per_token", 0.0)
    out["traced_layers"] = [n1, n2]
    return out


# Sequence lengths of two chunks or more of every chunked kernel seen (the gated delta rule's 64 tokens,
# Mamba-2's 256: one whole chunk keeps less than each further one), whole multiples of each
LONG_SEQS = (512, 1024)


def at_length(d: dict, num_layers: int, short: dict, stream: dict | None,
              attention: str | None = None) -> tuple[dict, dict | None]:
    """(activations, stream) with what a chunked kernel keeps at length. `short` (`config_activations`
    at 32 and 64 tokens) and the stream (16–48 tokens, `STREAM_SHAPES`) see every sequence padded to
    one whole chunk, so the chunk-shaped tensors look constant and the layers keep too little per token
    (Qwen3-Next's linear-attention layers: 297 kB a token traced, 464 kB at 256 tokens or more, as its
    CUDA and CPU runs keep, data/qwen3-next-saved/). Where the kept bytes per token at `LONG_SEQS`
    exceed `short`'s by more than 2%, the long ones are the activations, and the difference, spread
    evenly over the layers, is added to each layer where the stream is played (its
    `kept_bytes_per_token_beyond_trace`, `zerocalc.sequence._TracedStep`); elsewhere (no chunked
    kernel: equal, or a sliding window's little less; or a model whose code refuses that many tokens)
    `short` and the stream as they are."""
    try:
        long = config_activations(d, num_layers, LONG_SEQS, attention)
    except Exception:       # a position table shorter than the lengths, cut per length: nothing chunked
        return short, stream
    if long["bytes_per_token"] <= 1.02 * short["bytes_per_token"]:
        return short, stream
    missed = round((long["bytes_per_token"] - short["bytes_per_token"]) / num_layers, 3)
    return long, (None if stream is None else {**stream, "kept_bytes_per_token_beyond_trace": missed})


# ---------------------------------------------------------------- the allocation event stream of a training step

MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")
SDPA_BACKWARD = ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                 "aten._scaled_dot_product_efficient_attention_backward.default",
                 "aten._scaled_dot_product_flash_attention_backward.default",
                 "zerocalc.fused_attention_backward.default")
STREAM_LAYERS = 4                    # a shallow copy of this many decoder layers is traced (fewer if the model has fewer)
# (micro-batch, sequence) traced: sizes solved per event. Not a micro-batch of 1: torch.matmul folds a
# batch of one into a view where a larger one copies (eager attention's scores, `_matmul_impl`).
STREAM_SHAPES = ((2, 16), (2, 32), (2, 48), (3, 16), (3, 32), (3, 48))
STREAM_BASIS = ("1", "s", "B*s", "B*s*s", "B", "s*s")  # an allocation's bytes: k·(1, s, B·s, B·s², B, s²)
# (micro-batch, sequence) of the step run before those recorded and not recorded: what a model does on its
# first step only is done by then (the module's docstring)
WARM_UP = STREAM_SHAPES[0]


def record_step(model, mode, batch: int, seq: int, checkpointing: bool = False, forward=None,
                set_checkpointing=None, is_layer=None, layer_backward: bool = False):
    """The raw event stream of one forward, the loss (the validator's: cross-entropy of the logits'
    fp32 copy) and backward of `model` (fake tensors) at [batch, seq] tokens. Events:
    ("a", handle, bytes, op), ("f", handle), ("g", param index, handle: the gradient handed to the
    optimizer, which frees it; a post-accumulate-grad hook, where DeepSpeed's hooks run), ("L", i) the
    i-th decoder layer's forward begins, ("Lend", i) it returns, ("phase", name), and what a CUDA
    kernel adds beside its outputs (`zerocalc.sequence` applies the rules): ("sum", input elements) a
    reduction over every dimension but the last of a contiguous input (a bias's or norm weight's
    gradient summed over the tokens), ("sdpa", q elements, log-sum-exp elements) SDPA's backward, ("mm",) a matmul;
    with `layer_backward`, ("Lb", i) where the gradient of the i-th layer's output is ready (a hook on
    that output, allocating nothing): where the head is frozen or has no parameters of its own, backward's
    last layer begins there.
    Gradients are handed over for the parameters that require grad.
    A model that is not a Hugging Face causal LM (the validator's seed-gpt) gives `forward(model, ids)`
    (its logits), `set_checkpointing(model, on)` and `is_layer(module)` (its decoder layers)."""
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode

    events, alive, handed, taken = [], {}, set(), set()
    state = {"phase": "forward", "next": 0, "backward_from": 0, "linear": 0}

    def on_free(key):
        h = alive.pop(key, None)
        if key in taken:
            taken.discard(key)
        elif h and h not in handed:
            events.append(("f", h))

    def into_first(first, out):
        """The op's output keeps `first`'s storage: an operation that real tensors run in place."""
        first = first.untyped_storage()._cdata
        key = out.untyped_storage()._cdata
        alive[key] = alive[first]
        taken.add(first)
        weakref.finalize(out.untyped_storage(), on_free, key)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if (state["phase"] == "backward" and name == "aten.add.Tensor" and len(args) == 2 and not kwargs
                    and not args[0]._is_view()
                    and all(isinstance(a, torch.Tensor) and a.untyped_storage().nbytes() == out.untyped_storage().nbytes()
                            and alive.get(a.untyped_storage()._cdata, 0) > state["backward_from"] for a in args)):
                # Two gradients of one tensor summed (autograd's InputBuffer::accumulate: every add of two
                # backward-made tensors of the sum's size in the models traced): on CUDA in place, into
                # the first (`can_accumulate_inplace`), unless the first is a view: a view keeps its base,
                # a second reference to the storage, so the sum is a new tensor (the H200 history of
                # Gemma-2-2B, `data/snapshots/hf-diag/`: two [B, s, h] sums a layer and the tied
                # embedding's two gradients, the head's a view through the weight's transpose, each
                # allocated anew). A fake tensor is a tensor subclass, so it is summed out of place here;
                # an in-place sum keeps the first one's storage.
                into_first(args[0], out)
                return out
            if state["linear"] and name == "aten.add.Tensor" and alive.get(args[0].untyped_storage()._cdata):
                # F.linear's bias added to a matmul's output (a 3-d input that is not contiguous, as
                # nn.MultiheadAttention's projections get): `at::native::linear` adds it in place
                # (`output.add_(bias)`) but for a tensor subclass, which a fake tensor is.
                into_first(args[0], out)
                return out
            fp32 = {}
            if name == "aten.native_layer_norm.default":
                # LayerNorm's saved mean and rstd: fp32 on CUDA for a bf16/fp16 input (the kernel's
                # accumulate type; the seed GPT's H200 histories), the input's dtype on the CPU.
                fp32 = {t.untyped_storage()._cdata: 4 * t.numel() for t in out[1:] if t.element_size() < 4}
            for key, st in _new_storages(out, alive, func):
                state["next"] += 1
                alive[key] = state["next"]
                events.append(("a", state["next"], fp32.get(key, st.nbytes()), name))
                weakref.finalize(st, on_free, key)
            if name == "aten.sum.dim_IntList":
                # staged only for a contiguous input: the seed GPT's H200 histories stage none for the
                # key projection's bias, whose gradient nn.MultiheadAttention hands over transposed
                x, dims = args[0], [d % max(args[0].dim(), 1) for d in args[1]]
                if x.dim() > 1 and x.dim() - 1 not in dims and x.is_contiguous():
                    events.append(("sum", x.numel()))
            elif name in SDPA_BACKWARD:
                q, lse = args[1], args[5] if name.endswith("for_cpu_backward.default") else args[5]
                events.append(("sdpa", q.numel(), out[0].shape[0] * out[0].shape[1] * out[0].shape[2]))
            elif name == "aten._softmax_backward_data.default":
                events.append(("softmax", out.untyped_storage().nbytes()))
            elif name in MATMULS:
                events.append(("mm",))
            return out

    @contextmanager
    def in_linear():
        """Counts the F.linear calls in progress (`Recorder` sees only their aten operators): the
        module's function wrapped, as nn.Linear and nn.MultiheadAttention look it up at each call."""
        functional = torch.nn.functional
        linear = functional.linear

        def counted(*args, **kwargs):
            state["linear"] += 1
            try:
                return linear(*args, **kwargs)
            finally:
                state["linear"] -= 1
        functional.linear = counted
        try:
            yield
        finally:
            functional.linear = linear

    params = list(model.parameters())
    for t in params + list(model.buffers()):
        alive[t.untyped_storage()._cdata] = 0

    def grad_hook(i):
        def hook(p):
            g = p.grad
            key = g.untyped_storage()._cdata
            h = alive.get(key)
            if h:
                handed.add(h)
                events.append(("g", i, h))
            p.grad = None
        return hook

    hooks = [p.register_post_accumulate_grad_hook(grad_hook(i)) for i, p in enumerate(params) if p.requires_grad]
    is_layer = is_layer or decoder_layer(model)
    layers = [m for m in model.modules() if is_layer(m)]
    index = {id(m): i for i, m in enumerate(layers)}

    def pre(m, args):
        if id(m) in index and state["phase"] == "forward":
            events.append(("L", index[id(m)]))

    def post(m, args, out):
        if id(m) in index and state["phase"] == "forward":
            events.append(("Lend", index[id(m)]))
            first = out[0] if isinstance(out, tuple) else out
            if layer_backward and isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(lambda g, i=index[id(m)]: events.append(("Lb", i)))

    if set_checkpointing is None:
        set_checkpointing = hf_checkpointing
    if forward is None:
        def forward(model, ids):
            return model(input_ids=ids, use_cache=False).logits
    if checkpointing:
        set_checkpointing(model, True)
    try:
        with mode:
            ids = torch.zeros(batch, seq, dtype=torch.long)
            labels = torch.zeros(batch * seq, dtype=torch.long)
        alive[ids.untyped_storage()._cdata] = 0
        alive[labels.untyped_storage()._cdata] = 0
        with module_calls(model, pre, post), mode, unpacked_batch(), cuda_dispatch(), in_linear(), Recorder():
            logits = forward(model, ids)
            state["phase"] = "loss"
            events.append(("phase", "loss"))
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels)
            del logits
            state["phase"], state["backward_from"] = "backward", state["next"]
            events.append(("phase", "backward"))
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
        if checkpointing:
            set_checkpointing(model, False)
    return events


def _fit(values: list) -> list:
    """Integer coefficients k of `STREAM_BASIS` with k·(1, s, B·s, B·s², B, s²) = value at each of
    `STREAM_SHAPES` (B = 2 and 3, s = 16, 32, 48); ValueError where none exist. At each B the value is
    a + b·s + c·s² with a = k0 + B·kB, b = k1 + B·k2, c = ks² + B·k3 (an explicit [1, 1, s, s] mask is
    the s² term, eager attention's probabilities the B·s² one)."""
    from fractions import Fraction

    def quadratic(v16, v32, v48):
        c = (v48 - 2 * v32 + v16) / (2 * 16 * 16)
        b = (v32 - v16) / 16 - c * 48
        return v16 - 16 * b - 256 * c, b, c
    v = [Fraction(x) for x in values]
    (a2, b2, c2), (a3, b3, c3) = quadratic(*v[:3]), quadratic(*v[3:])
    kb, k2, k3 = a3 - a2, b3 - b2, c3 - c2
    k = [a2 - 2 * kb, b2 - 2 * k2, k2, k3, kb, c2 - 2 * k3]
    if any(x.denominator != 1 for x in k):
        raise ValueError(f"sizes {values} are not k·(1, s, B·s, B·s², B, s²) with integer k")
    while len(k) > 1 and k[-1] == 0:
        k.pop()
    return [int(x) for x in k]


def _canonical(events, k: int, layer_of_param: dict, n_params: int, first_layer_param: int, per_layer: int,
               starts: list | None = None):
    """The raw stream of a k-layer model cut into segments (P: before the first layer; F<i>: layer i's
    forward; H: after the last layer through the loss; Hb: backward until the last layer's gradients
    begin; B<i>: layer i's backward, ending at its last gradient; E: the rest) with every handle named
    by where it was made: (segment, its allocation index there). Returns {segment: [event, ...]} with
    sizes still as bytes (lists of numbers to fit) and references as strings. `starts`: each layer's
    first parameter where the layers are not equal runs (leading dense layers)."""
    pos_L = {e[1]: n for n, e in enumerate(events) if e[0] == "L"}
    pos_Lend = {e[1]: n for n, e in enumerate(events) if e[0] == "Lend"}
    back = next(n for n, e in enumerate(events) if e == ("phase", "backward"))
    lastg, firstg = {}, {}
    for n, e in enumerate(events):
        if e[0] == "g" and e[1] in layer_of_param:
            lastg[layer_of_param[e[1]]] = n
            firstg.setdefault(layer_of_param[e[1]], n)
    if sorted(pos_L) != list(range(k)) or sorted(lastg) != list(range(k)):
        raise ValueError("the stream does not cut into layers")
    head = [n for n, e in enumerate(events) if e[0] == "g" and e[1] not in layer_of_param and n < firstg[k - 1]]
    # the last layer's backward begins after the head's gradients or, none before it (the head frozen, or
    # without parameters of its own), where the gradient of its output is ready (`record_step`'s "Lb")
    last_start = head[-1] + 1 if head else next((n for n, e in enumerate(events) if e == ("Lb", k - 1)), None)
    if last_start is None:
        raise ValueError("the stream does not cut into layers")
    bounds = [("P", 0)] + [(f"F{i}", pos_L[i]) for i in range(k)] + [("H", pos_Lend[k - 1] + 1), ("Hb", back)]
    bounds += [(f"B{k - 1}", last_start)] + [(f"B{i}", lastg[i + 1] + 1) for i in range(k - 2, -1, -1)]
    bounds += [("E", lastg[0] + 1)]
    seg_at = []
    for (name, start), (_, end) in zip(bounds, bounds[1:] + [(None, len(events))]):
        seg_at += [name] * (end - start)
    where, count, out = {}, {}, {name: [] for name, _ in bounds}

    def layer(name):
        return int(name[1:]) if name[0] in "FB" and name[1:].isdigit() else None

    def ref(h, seg):
        name, j = where[h]
        i, mine = layer(name), layer(seg)
        if i is None:
            return f"{name}:{j}"
        if mine is not None and abs(i - mine) <= 1:
            return f"{name[0]}~{i - mine}:{j}"
        # from no layer, or from a layer further than the next (the first layer's backward freeing the
        # last one's gradient buffer, the head and the embedding frozen): that layer itself
        return f"{name[0]}@{i if i < 2 else i - k}:{j}"

    def param(p, seg):
        if p in layer_of_param:
            i, mine = layer_of_param[p], layer(seg)
            local = p - (starts[i] if starts else first_layer_param + i * per_layer)
            return f"~{i - mine}:{local}" if mine is not None else f"@{i if i < 2 else i - k}:{local}"
        return f"#{p if p < first_layer_param else p - n_params}"

    first_mm = True
    for n, e in enumerate(events):
        seg = seg_at[n]
        if e[0] == "a":
            j = count.get(seg, 0)
            count[seg] = j + 1
            where[e[1]] = (seg, j)
            out[seg].append(["a", e[2]])
        elif e[0] == "f":
            out[seg].append(["f", ref(e[1], seg)])
        elif e[0] == "g":
            out[seg].append(["g", param(e[1], seg), ref(e[2], seg)])
        elif e[0] == "sum":
            out[seg].append(["s", e[1]])
        elif e[0] == "sdpa":
            out[seg].append(["d", e[1], e[2]])
        elif e[0] == "softmax":
            out[seg].append(["t", e[1]])
        elif e[0] == "mm" and n > back and first_mm:
            first_mm = False
            out[seg].append(["w"])
    return out


def _layer_runs(model, is_layer=None):
    """(the parameters, each decoder layer's parameter indices), checked to be consecutive runs."""
    params = list(model.parameters())
    pid = {id(p): i for i, p in enumerate(params)}
    is_layer = is_layer or decoder_layer(model)
    layer_params = [[pid[id(p)] for p in m.parameters()] for m in model.modules() if is_layer(m)]
    at = layer_params[0][0]
    for ps in layer_params:
        if ps != list(range(at, at + len(ps))):
            raise ValueError("decoder layers do not hold consecutive runs of parameters")
        at += len(ps)
    return params, layer_params


def _layer_params(model, is_layer=None, leading: int = 0, period: int = 1):
    """(the parameters, each decoder layer's parameter indices), checked to be consecutive runs, equal
    but for leading ones (`lead_layers`) or, with a `period` of more than one layer, past the leading
    ones and a first period of the layers' pattern (played as traced, `sequence.played_as`), equal to
    those of the layer a period on."""
    params, layer_params = _layer_runs(model, is_layer)
    counts = [len(ps) for ps in layer_params[lead_layers(layer_params, leading, period) + period:]]
    if any(a != b for a, b in zip(counts, counts[period:])):
        raise ValueError("decoder layers do not hold equal runs of parameters")
    return params, layer_params


def lead_layers(layer_params, leading: int, period: int) -> int:
    """The layers a stream's header counts apart (`leading_layer_params`): where every layer past them
    is alike, those holding another number of parameters than the last one (`leading_layers`, as
    streams always have); with a pattern of several layers, the MoE stack's `leading` dense ones."""
    return leading_layers(layer_params) if period == 1 else leading


def leading_layers(layer_params) -> int:
    """How many leading layers hold another number of parameters than the last one."""
    n = len(layer_params)
    while n and len(layer_params[n - 1]) == len(layer_params[-1]):
        n -= 1
    return n


def segments_at(model, mode, k: int, checkpointing: bool, batch: int, seq: int, **kw) -> dict:
    """`_canonical`'s segments of one step of a k-layer model at [batch, seq] (sizes in bytes); a
    parameter is named by its place in its own layer, whatever the layers before it hold."""
    params, layer_params = _layer_runs(model, kw.get("is_layer"))
    per_layer, first = len(layer_params[-1]), layer_params[0][0]
    layer_of_param = {p: i for i, ps in enumerate(layer_params) for p in ps}
    starts = [ps[0] for ps in layer_params]
    return _canonical(record_step(model, mode, batch, seq, checkpointing, **kw), k, layer_of_param, len(params),
                      first, per_layer, starts)


def _fitted_segments(model, mode, k: int, checkpointing: bool, **kw) -> dict:
    """One variant of a k-layer model's stream (`_canonical`'s segments) with each event's bytes
    solved as coefficients of `STREAM_BASIS` over `STREAM_SHAPES`; `record_step`'s keywords. The
    steps recorded follow one of the variant's own that is not (`WARM_UP`)."""
    record_step(model, mode, *WARM_UP, checkpointing, **kw)
    runs = [segments_at(model, mode, k, checkpointing, b, s, **kw) for b, s in STREAM_SHAPES]
    shape = _structure(runs[0])
    if any(_structure(r) != shape for r in runs[1:]):
        raise ValueError("the stream's events differ between traced shapes")
    return {seg: [[x if isinstance(x, str) else _fit([r[seg][n][m] for r in runs]) for m, x in enumerate(e)]
                  for n, e in enumerate(evs)] for seg, evs in runs[0].items()}


def _structure(segs: dict) -> dict:
    """A stream's segments with every number (a size) blanked: what must not change between traces."""
    return {seg: [[x if isinstance(x, str) else None for x in e] for e in evs] for seg, evs in segs.items()}


def step_stream(d: dict, attention: str | None = None) -> dict:
    """The allocation event stream of a training step of the model a config.json describes, as the
    profile stores it (`zerocalc.profile`, `zerocalc.sequence` plays it): for a shallow copy of
    `stream_depth` decoder layers, without and with activation checkpointing, each event's bytes as
    integer coefficients of `STREAM_BASIS`, solved from `STREAM_SHAPES` (an event whose bytes are
    not so fails the trace); an MoE stack's leading dense layers (`stack`) traced beside them. A
    deeper model repeats the middle layers' segments, one period of its layers' pattern (`period`)
    (`zerocalc.sequence._TracedStep`). `attention`: traced under that one (`dispatching`), else
    the config's own."""
    from zerocalc.hf.trace import build, hf_config
    layers_total, leading = stack(d)
    p = period(d, attention)
    k = stream_depth(layers_total, leading, p)
    model, mode = build(hf_config(_shallow(d, k)))
    with dispatching(model, attention):
        return _step_stream(model, mode, k, leading, p)


def stream_depth(total: int, leading: int, p: int) -> int:
    """The layers of the shallow copy a stream is traced on: the leading dense ones, two periods of the
    layers' pattern (the first played as traced, the one just before the last two for every middle
    layer) and the last two
    (`sequence.played_as`), at least `STREAM_LAYERS` past the leading ones, the last where the model's
    is in the pattern (`aligned_depth`)."""
    return aligned_depth(leading + max(STREAM_LAYERS, 2 * p + 2), total, p)


def stream_head(layer_params: list, k: int, leading: int, p: int, attention: str) -> dict:
    """The stream's header: its depth, where its layers' parameters begin, how many each holds (the
    leading ones each, `leading_layer_params`; the rest `params_per_layer`, or the first period's each,
    `first_period_params`, and every later layer's by its place in the pattern, `period_params`: layer
    i's is entry (i - leading) mod its length) and its attention; the layers' `period` where a deeper
    model repeats a pattern of more than one layer (p = k or more: the copy is the whole model, played
    as traced). The first period may differ (LFM's, Zaya's and DeepSeek-V4's first layers)."""
    head = {"basis": list(STREAM_BASIS), "layers": k, "first_layer_param": layer_params[0][0],
            "params_per_layer": len(layer_params[-1]), "attention": attention}
    lead = lead_layers(layer_params, leading, p)
    if lead:
        head["leading_layer_params"] = [len(ps) for ps in layer_params[:lead]]
    counts = [len(ps) for ps in layer_params[lead:]]
    if 1 < p < k:
        head["period"], head["first_period_params"], head["period_params"] = p, counts[:p], counts[p:2 * p]
    elif len(set(counts)) > 1:
        head["period_params"] = counts
    return head


def _step_stream(model, mode, k: int, leading: int = 0, p: int = 1) -> dict:
    """`step_stream` of a built k-layer model (`leading` dense layers, a pattern of period p after them)."""
    params, layer_params = _layer_params(model, None, leading, p)
    out = stream_head(layer_params, k, leading, p, model.config._attn_implementation)
    for variant, ckpt in (("plain", False), ("checkpointed", True)):
        # where the last layer's backward begins when no gradient of the head's own comes before it (a
        # tied embedding and a final norm without parameters: OLMo-1B): `record_step`'s "Lb"
        out[variant] = _fitted_segments(model, mode, k, ckpt, layer_backward=True)
    return _compact(out)


def _compact(stream: dict) -> dict:
    """The stream as stored: each distinct size once (`sizes`, a table of coefficient lists); an
    allocation is its size's index (an int >= 0); a free of a tensor its own segment made is -d, the
    d-th allocation back (-1 the last); a free of another segment's tensor its name; ["g", param,
    name], ["s", size], ["d", size, size], ["w"] as `_canonical` makes them, with sizes as indices; a
    segment equal to one stored before it is that one's name ("plain.F1")."""
    table, index = [], {}

    def size(coefs):
        key = tuple(coefs)
        if key not in index:
            index[key] = len(table)
            table.append(list(coefs))
        return index[key]

    variants = [k for k, v in stream.items() if isinstance(v, dict)]   # plain, checkpointed, ...
    out = {k: v for k, v in stream.items() if k not in variants}
    seen = {}
    for variant in variants:
        out[variant] = {}
        for seg, evs in stream[variant].items():
            packed, j = [], 0
            for e in evs:
                if e[0] == "a":
                    packed.append(size(e[1]))
                    j += 1
                elif e[0] == "f":
                    where, at = e[1].rsplit(":", 1)
                    own = where == seg or (where[1:2] == "~" and where[0] == seg[0] and where[2:] == "0")
                    packed.append(int(at) - j if own else e[1])
                elif e[0] in ("s", "d", "t"):
                    packed.append([e[0]] + [size(x) for x in e[1:]])
                else:
                    packed.append(e)
            text = repr(packed)
            out[variant][seg] = seen.setdefault(text, f"{variant}.{seg}") if text in seen else packed
            seen.setdefault(text, f"{variant}.{seg}")
    out["sizes"] = table
    return out
