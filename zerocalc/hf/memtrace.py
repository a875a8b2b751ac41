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
