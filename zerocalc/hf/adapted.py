"""The allocation stream of a training step of a model with frozen parameters or PEFT's LoRA, recorded
from PEFT's own model on fake tensors (`memtrace.record_step`), for `zerocalc.sequence` to play beside
DeepSpeed's side as it plays a full fine-tune's (docs/lora.md, "Peaks").

What differs from the full model's stream is what autograd and PEFT allocate: no gradient for a frozen
weight, no kept input for a frozen linear, each LoRA target's forward and backward (lora_A's output,
kept for lora_B's gradient; lora_B's output, the scaled copy, the sum; with dropout its output and
CUDA's bool mask, `cudaops`). The model is built as the validator builds it (`validate.hf_models`):
`get_peft_model`, then `requires_grad` from zerocalc's own mask (`ModelSpec.trainable`), so the stream
and the rest of zerocalc describe one set of trained tensors. Four variants (`VARIANTS`), with and
without activation checkpointing, as stages 0-2 run them (adapters cast to the training dtype) and as
stage 3 under zero.Init does (fp32 adapters, `states.wide_stage3_elements`; DeepSpeed's F.linear,
which keeps every input, `familystream.zero3_linear`), each recorded and cached on its own.
"""
import hashlib
import json
import os
from contextlib import nullcontext

# (variant, activation checkpointing, as stage 3 under zero.Init runs it)
VARIANTS = {"plain": (False, False), "checkpointed": (True, False),
            "plain_zero3": (False, True), "checkpointed_zero3": (True, True)}
FORMAT = 4     # bump when what is recorded changes: it is part of the cache key


def variant(checkpointing: bool, zero3: bool) -> str:
    return ("checkpointed" if checkpointing else "plain") + ("_zero3" if zero3 else "")


def peft_config(lora):
    """PEFT's LoraConfig of a `zerocalc.adapters.Lora`."""
    import peft
    listed = lambda x: x if isinstance(x, str) else list(x)   # noqa: E731
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=listed(lora.targets), exclude_modules=listed(lora.exclude) or None,
                           use_dora=lora.dora, use_rslora=lora.rslora, bias=lora.bias, task_type=lora.task_type)


def build(d: dict, layers: int, lora, trainable: tuple[bool, ...] | None, zero3: bool):
    """(model, fake mode) of the config's first `layers` layers with LoRA applied (`lora`, or None) and
    `requires_grad` set from `trainable` (the full model's mask, `shallow_mask`), the adapters cast to
    the model's dtype but for `zero3`."""
    import torch
    from zerocalc.hf import memtrace, trace
    model, mode = trace.build(trace.hf_config(memtrace._shallow(d, layers)))
    dtype = next(model.parameters()).dtype
    if lora is not None:
        import peft
        model = peft.get_peft_model(model, peft_config(lora))    # outside the fake mode: its `.to` swaps
        # the adapters made real (beside the fake base) become fake tensors in the model's dtype (the
        # engine's cast, `_cast_module_mixed_precision`) or, under zero.Init, fp32; a real one would be
        # copied into a fake tensor at each use, a storage of its own that `record_step` would count
        for prefix, m in model.named_modules():
            for name, p in list(m._parameters.items()):
                if p is not None and ".lora_" in f"{prefix}.{name}":
                    fake = p.detach()
                    if not isinstance(fake, torch._subclasses.fake_tensor.FakeTensor):
                        fake = mode.from_tensor(fake)
                    with mode:
                        fake = fake.to(torch.float32 if zero3 else dtype)
                    m._parameters[name] = torch.nn.Parameter(fake)
    params = list(model.parameters())
    if trainable is not None:
        total, leading = memtrace.stack(d)
        mask = shallow_mask(trainable, memtrace._layer_runs(model)[1], len(params), total, leading,
                            memtrace.period(d))
        for p, train in zip(params, mask):
            p.requires_grad_(train)
    return model, mode


def shallow_mask(trainable: tuple[bool, ...], layer_params: list, n_shallow: int, total_layers: int,
                 leading: int = 0, period: int = 1) -> tuple:
    """The mask of a shallow copy (`layer_params`: its layers' parameter indices; `n_shallow` parameters)
    from the full model's of `total_layers` layers (`leading` dense ones, then a pattern of `period`,
    `memtrace.period`): the tensors before and after the layers as they are, each layer of the copy as
    the full layers it is played as (`sequence.played_as`). ValueError where two full layers played as
    one train different tensors."""
    from zerocalc.hf.memtrace import lead_layers
    from zerocalc.sequence import played_as
    k = len(layer_params)
    lead = lead_layers(layer_params, leading, period)
    # the copy's own layers for the leading ones and the first period, then each by its place in the
    # pattern (the copy's second period; its only middle layer where every layer is alike)
    second = lead + period
    sizes = [len(ps) for ps in layer_params[:min(second, total_layers)]] + \
        [len(layer_params[second + (i - second) % period]) for i in range(second, total_layers)]
    start = layer_params[0][0]
    shallow = [None] * k
    for i, size in enumerate(sizes):
        j, mask = played_as(i, total_layers, k, lead, period), tuple(trainable[start:start + size])
        if shallow[j] not in (None, mask):
            raise ValueError(f"layer {i} trains other tensors than the layer it is played as")
        shallow[j] = mask
        start += size
    return tuple(trainable[:layer_params[0][0]]) + sum(shallow, ()) + tuple(trainable[start:])


def record(d: dict, lora, trainable, name: str, attention: str | None = None) -> dict:
    """One variant's fitted segments (`memtrace._fitted_segments`) and the stream's header."""
    from zerocalc.hf import familystream, memtrace
    from zerocalc.hf.trace import hf_checkpointing
    checkpointing, zero3 = VARIANTS[name]
    total, leading = memtrace.stack(d)
    p = memtrace.period(d)
    k = memtrace.stream_depth(total, leading, p)
    model, mode = build(d, k, lora, trainable, zero3)
    base = model.get_base_model() if lora is not None else model

    def set_checkpointing(_, on):     # on the base model under PEFT's wrapper
        hf_checkpointing(base, on)
    layer_params = memtrace._layer_params(model, None, leading, p)[1]
    head = memtrace.stream_head(layer_params, k, leading, p, attention or base.config._attn_implementation)
    with memtrace.dispatching(base, attention), (familystream.zero3_linear() if zero3 else nullcontext()):
        segments = memtrace._fitted_segments(model, mode, k, checkpointing, set_checkpointing=set_checkpointing,
                                             layer_backward=True)
    return {"head": head, "segments": segments}


def stream(d: dict, lora, trainable: tuple[bool, ...], names, attention: str | None = None) -> dict:
    """The stream as a profile stores it (`memtrace._compact`) with the variants `names`, each
    recorded or read from the cache (`cached_variant`), and the trained tensors it was recorded with
    (`trainable`: "params" and "trained", which `sequence.generated` checks against the model's)."""
    from zerocalc.hf import memtrace
    out = {}
    for name in names:
        got = cached_variant(d, lora, trainable, name, attention)
        out.update(got["head"])
        out[name] = got["segments"]
    out["params"], out["trained"] = len(trainable), sum(trainable)
    return memtrace._compact(out)


def cache_key(d: dict, lora, trainable, name: str, attention: str | None) -> str:
    """What the recording depends on: the config, the adapters, the trained tensors, the variant and
    attention, the torch, transformers and PEFT versions, and what is recorded (`FORMAT`)."""
    from importlib import metadata
    from zerocalc.hf import trace
    torch_version, transformers_version = trace._versions()
    text = json.dumps({"config": d, "lora": None if lora is None else repr(lora), "attention": attention,
                       "trainable": "".join("1" if t else "0" for t in trainable), "variant": name,
                       "transformers": transformers_version, "torch": torch_version,
                       "peft": metadata.version("peft") if lora is not None else None,
                       "trace_version": trace.TRACE_VERSION, "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_variant(d: dict, lora, trainable, name: str, attention: str | None = None) -> dict:
    """`record`, kept in the user's cache directory (XDG_CACHE_HOME/zerocalc/streams)."""
    from zerocalc.hf import trace
    folder = os.path.join(os.path.dirname(trace.cache_dir()), "streams")
    path = os.path.join(folder, cache_key(d, lora, trainable, name, attention) + ".json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                return json.load(f)
        except (ValueError, OSError):
            pass
    got = record(d, lora, trainable, name, attention)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(got, f, separators=(",", ":"))
    os.replace(tmp, path)
    return got
