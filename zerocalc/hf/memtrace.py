"""The allocation event stream of one training step's forward and backward, recorded on fake
tensors: every storage an operator creates is born with its bytes, and dies when its last reference
goes (a weak reference on the storage, as `torch.distributed._tools.mem_tracker` keeps). Each
event carries the module call it happened in (forward pre/post hooks) and the phase.

What this records is what the CPU kernels' fake implementations allocate; where CUDA's kernels
allocate otherwise (`zerocalc.sequence` holds the H200 histories' facts) the difference is stated
where the stream is compared (`tests/test_memtrace.py`).
"""
import weakref
from contextlib import contextmanager

from zerocalc.hf.trace import _imports


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


def record(model, mode, input_ids, loss_fn=None):
    """(events, names): events are ("alloc", handle, bytes, module, phase) and ("free", handle, phase);
    parameters and buffers existing before the call are not events."""
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    events, alive, state = [], {}, {"phase": "forward", "module": "", "next": 0}
    stack = []

    def on_free(key):
        h = alive.pop(key, None)
        if h:
            events.append(("free", h, state["phase"]))

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st._cdata
                    if key in alive:
                        continue
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

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    h1, h2 = register_module_forward_pre_hook(pre), register_module_forward_hook(post)
    try:
        with mode, unpacked_batch(), Recorder():
            logits = model(input_ids=input_ids, use_cache=False).logits
            state["phase"] = "loss"
            loss = (loss_fn or (lambda x: torch.nn.functional.cross_entropy(
                x.float().view(-1, x.shape[-1]), input_ids.view(-1))))(logits)
            del logits
            state["phase"] = "backward"
            state["module"] = ""
            loss.backward()
            del loss
    finally:
        h1.remove()
        h2.remove()
    return events


def layers_kept_bytes(model, mode, batch: int, seq: int, with_head: bool = False):
    """Bytes the decoder layers keep for backward at the end of forward: what is alive when the module
    after the last layer is called (the model's code has dropped the last layer's input by then
    unless backward needs it), less what was alive when the first layer was called and less the last
    layer's output (the next module's input, not the layers')."""
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers.modeling_layers import GradientCheckpointingLayer

    alive, state = {}, {"bytes": 0, "first": None, "last": None, "out": 0, "serial": 0}
    born = {}        # storage -> its creation's serial number

    def on_free(key):
        state["bytes"] -= alive.pop(key, 0)
        born.pop(key, None)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st._cdata not in alive:
                        alive[st._cdata] = st.nbytes()
                        state["serial"] += 1
                        born[st._cdata] = state["serial"]
                        state["bytes"] += st.nbytes()
                        weakref.finalize(st, on_free, st._cdata)
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

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    h1, h2 = register_module_forward_pre_hook(pre), register_module_forward_hook(post)
    try:
        with mode, unpacked_batch(), Counter():
            ids = torch.zeros(batch, seq, dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits
            del logits
    finally:
        h1.remove()
        h2.remove()
    if state["first"] is None or state["last"] is None:
        raise RuntimeError("no decoder layer (GradientCheckpointingLayer) was called")
    layers = state["last"] - state["first"] - state["out"]
    return (layers, state.get("head", 0)) if with_head else layers


def layer_activations(model, mode, seqs=(32, 64)) -> dict:
    """The layers' kept bytes as a·T + c·B·s² (T = B·s tokens; c: attention probabilities kept by an
    eager attention, 0 with SDPA), from two forwards of one sequence at two lengths, in the model's
    dtype (bf16 as traced); and what the head keeps per token (`layers_kept_bytes`)."""
    s1, s2 = seqs
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


def _shallow(d: dict, layers: int) -> dict:
    """The config with its first `layers` decoder layers (per-layer lists cut to match)."""
    d = dict(d)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in d:
            d[key] = layers
    d.setdefault("num_hidden_layers", layers)
    for key in ("layer_types",):
        if isinstance(d.get(key), list):
            d[key] = d[key][:layers]
    return d


def config_activations(d: dict, num_layers: int, seqs=(32, 64)) -> dict:
    """`layer_activations` of the whole stack from two shallow copies of the model (its first n and
    n + 1 layers, n covering the leading dense layers of an MoE stack, `first_k_dense_replace`): the
    first n layers as traced, each further layer as the (n + 1)-th. Decoder layers after the leading
    ones are alike in what they keep (the kept bytes do not depend on a layer's position), so this
    equals tracing the whole stack at a fraction of the time."""
    from zerocalc.hf.trace import build, hf_config
    n = min(num_layers, 1 + int(d.get("first_k_dense_replace") or 0))
    shallow = []
    for layers in sorted({n, min(n + 1, num_layers)}):
        model, mode = build(hf_config(_shallow(d, layers)))
        shallow.append((layers, layer_activations(model, mode, seqs)))
    (n1, a1), (n2, a2) = shallow[0], shallow[-1]
    out = dict(a1)
    for key in ("bytes_per_token", "bytes_per_sequence_squared"):
        step = a2[key] - a1[key] if n2 > n1 else 0.0
        out[key] = round(a1[key] + (num_layers - n1) * step, 3)
    out["head_bytes_per_token"] = a2.get("head_bytes_per_token", 0.0)
    out["traced_layers"] = [n1, n2]
    return out
