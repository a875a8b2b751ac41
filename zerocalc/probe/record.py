"""What zerocalc needs of a model it has no architecture for, read from the model being trained
(`SpecRecorder`: its parameter tensors, their trainable and fp32 flags, the module calls of one
forward, its buffers), and the ModelSpec zerocalc predicts from that record (`recorded_spec`). The
validator records every HF job so; the probe records a user's model so. torch and DeepSpeed are
imported inside the functions."""
from dataclasses import replace

from zerocalc.hf.trace import output_requires_grad, saving_dropout
from zerocalc.probe.measure import SCALAR_BYTES


class SpecRecorder:
    """What zerocalc needs of a model it has no architecture for, read from the model being trained:
    each parameter's element count in `module.parameters()` order (`ds_numel` once zero.Init has
    partitioned it), the module calls of the first forward as they nest, each with its own parameters
    (a stage-3 leaf's: all under it, its inner calls unseen, as DeepSpeed's hooks see them), whether
    its output requires grad (else DeepSpeed's backward hook never fires for it), whether it is a
    checkpointed layer and whether it is a dropout at p > 0 (`trace.saving_dropout`): from these zerocalc derives stage 3's forward and backward fetch traces
    (`recorded_spec`) as from a traced profile's calls. Also the modules that own parameters in forward
    order (`trace`, what rows before the calls were recorded carry) and the module buffers' bytes
    (those over SCALAR_BYTES; read on the device after the engine is built)."""

    def __init__(self, model):
        import torch
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:   # a model of the user's own, trained without transformers: no HF layers
            GradientCheckpointingLayer = ()
        self.model = model
        params = list(model.parameters())
        index = self._index = {id(p): i for i, p in enumerate(params)}
        self.param_numels = [int(getattr(p, "ds_numel", p.numel())) for p in params]
        self.trainable = [bool(p.requires_grad) for p in params]
        self.fp32 = [p.dtype == torch.float32 for p in params]   # PEFT's adapters in a 16-bit model
        self.trace, self._done, self._hooks = [], False, []
        self._stack = [[]]       # the children of each call in progress: [own params, grad, layer, children,
        self._saves = set()      # saves, a leaf's own (recurse=False) or None]; ids of the dropouts at p > 0
        self._leaves = {}        # id of a stage-3 leaf -> its own parameters
        self._walk(model, index, GradientCheckpointingLayer)

    def _walk(self, m, index, layer_class):
        """Hooks on `m` and, unless it is a stage-3 leaf (`set_z3_leaf_modules`), on the modules under it."""
        from deepspeed.utils import z3_leaf_module
        leaf = z3_leaf_module(m)
        own = tuple(index[id(p)] for p in m.parameters(recurse=leaf) if id(p) in index)
        layer = isinstance(m, layer_class)
        self._hooks.append(m.register_forward_pre_hook(lambda mod, args, own=own: self._enter(own)))
        self._hooks.append(m.register_forward_hook(lambda mod, args, out, own=own, layer=layer:
                                                   self._leave(mod, own, out, layer)))
        if saving_dropout(m):
            self._saves.add(id(m))
        if leaf:
            self._leaves[id(m)] = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        else:
            for child in m.children():
                self._walk(child, index, layer_class)

    def _enter(self, own):
        if not self._done:
            self._stack.append([])
            if own:
                self.trace.append(list(own))

    def _leave(self, mod, own, out, layer):
        if self._done:
            return
        children = self._stack.pop()
        # and the parameters DeepSpeed's getter registered on it in this forward (read outside their own
        # module's forward while partitioned: PEFT's lora.Linear reads lora_A.weight): its hooks fetch them too
        index = self._index
        external = [index[id(p)] for _, p in getattr(mod, "ds_external_parameters", lambda: ())() if id(p) in index]
        self._stack[-1].append([list(dict.fromkeys([*own, *external])), output_requires_grad(out), layer, children,
                                id(mod) in self._saves, self._leaves.get(id(mod))])
        if mod is self.model:
            self.calls = self._stack[0][0]
            self._done = True
            for h in self._hooks:
                h.remove()

    def remove(self):
        """Take the hooks off (they take themselves off after the first forward)."""
        for h in self._hooks:
            h.remove()

    def spec(self) -> dict:
        seen, buffers = set(), []
        for b in self.model.buffers():
            key = (b.untyped_storage().data_ptr(), b.device.type)
            nbytes = b.numel() * b.element_size()
            if key not in seen and nbytes > SCALAR_BYTES:
                seen.add(key)
                buffers.append(nbytes)
        out = {"param_numels": self.param_numels, "trace": self.trace, "buffer_bytes": buffers}
        if self._done:
            out["calls"] = self.calls
        if not all(self.trainable):
            out["trainable"] = self.trainable
        if any(self.fp32) and not all(self.fp32):
            out["fp32"] = self.fp32
        return out


def _call(node: list):
    """A recorded call ([own params, grad, layer, children, saves, a leaf's own or None]; records made
    before dropouts and leaves were recorded end after `children`) as zerocalc's `arch.Call`."""
    from zerocalc.arch import Call
    params, grad, layer, children, *rest = node
    saves, leaf = (rest + [False, None])[:2]
    return Call(tuple(params), tuple(_call(c) for c in children), grad, layer, bool(saves), leaf is not None,
                tuple(leaf or ()))


def recorded_spec(s: dict, name: str, wrapper: bool = False, buffer_element_bytes: int = 4):
    """zerocalc's ModelSpec from a record (`SpecRecorder.spec()`). Parameters only: no architecture, so
    zerocalc predicts states and communication, not activations. The fetch traces come from the
    recorded calls as `model.from_profile` derives them from a traced profile's (wrapper: one more
    parameter-less call around them, the validator's logits wrapper); records made before the calls
    were have the forward order of the modules with parameters, and backward's as its reverse.
    Buffers are the recorded bytes, as elements of the size zerocalc counts them in
    (`states.buffer_element_bytes`): transformers' own zero.Init path keeps the rotary `inv_freq`
    fp32 (every stage-3 row of data/h200-hf-*.csv), where a bare `deepspeed.zero.Init` makes it 16-bit."""
    from zerocalc import arch
    from zerocalc.model import ModelSpec
    spec = ModelSpec(name, tuple(s["param_numels"]), tuple(tuple(t) for t in s["trace"]),
                     tuple(-(-b // buffer_element_bytes) for b in s["buffer_bytes"]),
                     trainable=tuple(s["trainable"]) if "trainable" in s else None,
                     wide=tuple(s["fp32"]) if "fp32" in s else None)
    if "calls" not in s:
        return spec
    root = _call(s["calls"])
    if wrapper:
        root = arch.Call((), (root,))
    return replace(spec, trace=tuple(arch._forward(root)), backward_trace=tuple(arch._backward(root)),
                   checkpointed_backward_trace=tuple(arch._backward(root, checkpointing=True)),
                   checkpointed_recomputed=arch._recomputed(root), leaf_scans=arch.leaf_scans(root))
