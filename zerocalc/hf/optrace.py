"""What one micro-step asks of the host and the GPU, read from the model's own code: the operators the
host dispatches and the FLOPs they do, per phase (forward; backward; backward under activation
checkpointing, its recomputation included), for the layers and for what is outside them.

A forward from the token ids to the logits and a backward from the logits run on fake tensors
(`hf.trace.build`) under a dispatch mode that sees every aten operator, as `zerocalc.timing` counts
them: operators dispatched (not views or metadata reads, `VIEW_OPS`), matmul and attention FLOPs
(torch's formulas, the CPU's SDPA and `_grouped_mm` counted as their CUDA kernels), and the bytes
every other operator writes. Each quantity is a·B·s + c·B·s², read at two lengths, and split into
base + (L − n)·per_layer from the model cut to n and n + 1 layers. The rules in full, MoE included:
docs/models.md, "Step time of a traced model".

torch is imported lazily: the profile carries the result (`Profile.steps`) and `zerocalc.timing`
reads it without torch.
"""
import os
from contextlib import contextmanager

from zerocalc.hf.cudaops import cuda_dispatch
from zerocalc.hf.trace import _imports, hf_checkpointing

# Operators that only make a view or read metadata: no kernel (as counted for zerocalc.timing since its
# per-family counts; tests/test_optrace.py)
VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
    "aten.detach.default", "aten.expand.default", "aten.split.Tensor", "aten.slice.Tensor",
    "aten.unsqueeze.default", "aten.reshape.default", "aten.permute.default", "aten.select.int",
    "aten.squeeze.dim", "aten.as_strided.default", "aten.alias.default", "aten.split_with_sizes.default",
    "aten.unbind.int", "aten.empty.memory_format", "aten.lift_fresh.default", "aten._reshape_alias.default"})

PHASES = ("forward", "backward", "backward_checkpointed")
SEQ = 32                 # tokens per traced sequence
BATCH = 2                # sequences per trace: nn.MultiheadAttention and GPT-2 take another path for one
                         # (the seed's layer 6 operators fewer forward, 2 backward; GPT-2's backward 1 fewer)
FORMAT = 1


def _sdpa_flops(q, k, v, backward: bool) -> int:
    """Scores Q·Kᵀ and values P·V: 2·B·H·s_q·s_k·d each (FlopCounterMode's formula for the CUDA kernels);
    backward four such products (dQ, dK, dV, dP)."""
    b, h, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    fwd = 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v
    return 2 * fwd if backward else fwd


def _grouped_mm_flops(a, b) -> int:
    """torch._grouped_mm: (M, K) × (G, K, N) sends each row through one group's matrix: 2·M·K·N;
    (K, M) × (M, N) → (G, K, N) (the weights' gradient) 2·K·M·N; 3-D × 3-D as bmm."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


ATTENTION_OPS = ("aten.bmm", "aten.baddbmm")   # besides SDPA's kernels: eager attention's scores and values


def flops_of(func, args, kwargs, out) -> tuple[str, int] | None:
    """(class, FLOPs) of one operator: "attention" (SDPA's kernels; eager attention's batched matmuls,
    the only bmm in these models, an MoE's experts being `_grouped_mm`) or "matmul"; None for an
    operator that does no work at the matmul rate."""
    from torch.utils.flop_counter import flop_registry
    name = str(func)
    packet = func._overloadpacket
    if ("scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name
            or name.startswith("zerocalc.fused_attention")):
        if packet in flop_registry:
            return "attention", int(flop_registry[packet](*args, **kwargs, out_val=out))
        backward = "backward" in name        # the CPU kernel: as the CUDA flash kernel
        q, k, v = (args[1], args[2], args[3]) if backward else args[:3]
        return "attention", _sdpa_flops(q, k, v, backward)
    if packet in flop_registry:
        return ("attention" if name.rsplit(".", 1)[0] in ATTENTION_OPS else "matmul"), \
            int(flop_registry[packet](*args, **kwargs, out_val=out))
    if name.startswith("aten._grouped_mm"):
        return "matmul", _grouped_mm_flops(args[0], args[1])
    return None


class _Totals:
    def __init__(self):
        self.ops, self.bytes = 0, 0
        self.flops = {"matmul": 0, "attention": 0}


def _counter(totals):
    torch, _ = _imports()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func)
            if name in VIEW_OPS or name.startswith("prim."):
                return out
            t = totals[0]
            t.ops += 1
            f = flops_of(func, args, kwargs, out)
            if f is not None:
                t.flops[f[0]] += f[1]
            else:
                t.bytes += sum(x.numel() * x.element_size() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
            return out

    return Counter()


def hf_forward(model, ids):
    return model(input_ids=ids, use_cache=False).logits


@contextmanager
def counted_unpacked_batch():
    """`memtrace.unpacked_batch`, with the operators the skipped check dispatches on a real batch counted:
    transformers' test for packed sequences (`masking_utils.find_packed_sequence_indices`: diff, cumsum,
    compare, and a read of the answer on the host) is run on real position ids of the same shape."""
    torch, _ = _imports()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes
    from transformers import masking_utils
    original = masking_utils.find_packed_sequence_indices

    def check(position_ids):
        with _disable_current_modes():      # the ids themselves are not the check's
            real = torch.arange(position_ids.shape[-1]).expand(tuple(position_ids.shape)).clone()
        with unset_fake_temporarily():
            original(real)
        return None

    masking_utils.find_packed_sequence_indices = check
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def phase_totals(model, mode, seq: int, checkpointing: bool, forward=hf_forward, set_checkpointing=hf_checkpointing,
                 batch: int = BATCH) -> dict:
    """{phase: (ops, flops, bytes)} of one forward (token ids to logits) and one backward from the logits."""
    torch, _ = _imports()
    set_checkpointing(model, checkpointing)
    for p in model.parameters():
        p.grad = None
    fwd, bwd = _Totals(), _Totals()
    current = [fwd]
    with mode, counted_unpacked_batch(), cuda_dispatch():
        ids = torch.zeros(batch, seq, dtype=torch.long)
        with _counter(current):
            logits = forward(model, ids)
        grad = torch.ones_like(logits)
        current[0] = bwd
        with _counter(current):
            logits.backward(grad)
    for p in model.parameters():
        p.grad = None
    set_checkpointing(model, False)
    return {"forward": fwd, ("backward_checkpointed" if checkpointing else "backward"): bwd}


def model_totals(model, mode, seq: int = SEQ, batch: int = BATCH, **kw) -> dict:
    """{phase: {"ops", "flops_per_token", "attention_flops_per_token_seq", "bytes_per_token"}} of one
    model from one batch: matmul FLOPs and written bytes per token (T = B·s), attention's per token and
    per position (it grows as B·s²)."""
    phase_totals(model, mode, seq, False, batch=batch, **kw)     # the first step, not counted (`memtrace.WARM_UP`)
    plain = phase_totals(model, mode, seq, False, batch=batch, **kw)
    ck = phase_totals(model, mode, seq, True, batch=batch, **kw)
    if ck["forward"].ops != plain["forward"].ops:
        raise RuntimeError(f"checkpointing changed the forward's operators ({plain['forward'].ops} to {ck['forward'].ops})")
    tokens = batch * seq
    return {phase: {"ops": t.ops, "flops_per_token": t.flops["matmul"] / tokens,
                    "attention_flops_per_token_seq": t.flops["attention"] / (tokens * seq), "bytes_per_token": t.bytes / tokens}
            for phase, t in (("forward", plain["forward"]), ("backward", plain["backward"]),
                             ("backward_checkpointed", ck["backward_checkpointed"]))}


def stack_counts(build_layers, n: int, num_layers: int, period: int = 1, **kw) -> dict:
    """The profile's `steps` entry for one attention implementation: per phase and quantity
    (`model_totals`) [base, per_layer], base the model with n layers and per_layer a p-th of what p
    more add (the layers' `memtrace.period`; n puts the copy's last layer where the model's is in the
    pattern, so the model's count is exact); build_layers(k) gives (model, mode) with k layers."""
    counts = []
    for k in sorted({n, min(n + period, num_layers)}):
        model, mode = build_layers(k)
        counts.append((k, model_totals(model, mode, **kw)))
    (n1, c1), (n2, c2) = counts[0], counts[-1]
    out = {"base_layers": n1}
    for phase in PHASES:
        out[phase] = {key: [_round(a), _round((c2[phase][key] - a) / (n2 - n1) if n2 > n1 else 0)]
                      for key, a in c1[phase].items()}
    return out


def _round(x):
    r = round(x, 3)
    return int(r) if r == int(r) else r


def fake_validator_model(a, attention: str):
    """(model, mode): the validator's model of Architecture `a` (`zerocalc.hf.families.build_model`) built in
    training mode on fake tensors in bf16, buffers in the parameters' dtype (`to_model_dtype`)."""
    torch, _ = _imports()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from zerocalc.hf.families import build_model
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with mode:
            model = build_model(a.as_dict(), attention=attention).train()
    finally:
        torch.set_default_dtype(default)
    to_model_dtype(model, mode)
    return model, mode


def to_model_dtype(model, mode) -> None:
    """Floating-point buffers in the parameters' dtype, as DeepSpeed's engine converts the module it is
    given (`module.bfloat16()`): Llama's rotary `inv_freq` then costs a cast per forward, as on the
    direct path's runs (transformers' zero.Init path keeps it fp32: one operator fewer)."""
    dtype = next(model.parameters()).dtype
    with mode:
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    m._buffers[name] = b.to(dtype)


def config_steps(d: dict, num_layers: int, attentions=("sdpa", "eager")) -> dict:
    """`Profile.steps` of a config.json's contents: {"format", "traced_at": [B, s], attention:
    `stack_counts`} for SDPA (flash dispatches one attention operator as SDPA does) and eager attention,
    those the model supports (transformers refuses SDPA for Gemma-2), on the model cut to its first n
    and n + p layers (`memtrace._shallow`; p the layers' `memtrace.period`, n as
    `memtrace.config_activations` picks it)."""
    from zerocalc.hf.memtrace import _shallow, aligned_depth, period, stack
    from zerocalc.hf.trace import build, hf_config
    p = period(d)
    n = aligned_depth(min(num_layers, stack(d)[1] + p), num_layers, p)
    built = {}

    def build_layers(k, attention):
        if k not in built:
            model, mode = build(hf_config(_shallow(d, k)))
            to_model_dtype(model, mode)
            built[k] = model, mode
        model, mode = built[k]
        model.set_attn_implementation(attention)
        return model, mode

    out = {"format": FORMAT, "traced_at": [BATCH, SEQ]}
    for attention in attentions:
        try:
            build_layers(n, attention)
        except ValueError:      # an implementation the model does not support (Gemma-2: eager only)
            continue
        out[attention] = stack_counts(lambda k, attention=attention: build_layers(k, attention), n, num_layers, p)
    return out if any(a in out for a in attentions) else None


# ---------------------------------------------------------------- the transcribed families

FAMILY_ATTENTIONS = (("seed-gpt", "eager"), ("seed-gpt", "sdpa"), ("hf-llama", "eager"), ("hf-llama", "sdpa"),
                     ("hf-gpt2", "eager"), ("hf-gpt2", "sdpa"))
FAMILY_STEPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "family_steps.json")


def family_steps() -> dict:
    """`stack_counts` of the transcribed families as the validator builds them (`zerocalc.hf.families`), at
    the dimensions of their dispatch test: vocabulary 128, width 64, 4 heads (Llama 2 key/value heads),
    FFN 160, untied. What a layer dispatches does not depend on its widths, but Llama's eager attention
    repeats grouped key/value heads (two copies forward, their sums backward): with as many key/value
    heads as heads its layer dispatches 2 operators fewer backward (`config_steps` counts each config's
    own). Keys "family/attention"; nn.MultiheadAttention is the seed's whatever the attention setting."""
    torch, _ = _imports()
    from zerocalc.hf.families import SeedGPT    # the validator's own models
    from zerocalc.arch import Architecture

    def build_layers(family, attention, k):
        return fake_validator_model(Architecture(family, 128, 64, k, 4, 4 if family == "seed-gpt" else 2, 160, False, 64),
                                    attention)

    def set_checkpointing(model, on):
        if isinstance(model, SeedGPT):
            model.checkpointing = on
        else:
            hf_checkpointing(model.model, on)

    return {f"{family}/{attention}": stack_counts(lambda k, f=family, a=attention: build_layers(f, a, k), 1, 2,
                                                  forward=lambda m, ids: m(ids), set_checkpointing=set_checkpointing)
            for family, attention in FAMILY_ATTENTIONS}


if __name__ == "__main__":       # python -m zerocalc.hf.optrace: regenerate zerocalc/family_steps.json
    import json
    with open(FAMILY_STEPS, "w") as f:
        json.dump({"format": FORMAT, "traced_at": [BATCH, SEQ], **family_steps()}, f, indent=1)
        f.write("\n")
