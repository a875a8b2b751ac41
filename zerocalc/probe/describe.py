"""What zerocalc is asked about a user's job, read from the job itself: the how (a Setup from the
ds_config the engine parsed, the world size and the batch it was given), the what (the model: from
its Hugging Face config through a shipped profile or a trace, with its PEFT LoRA and frozen
parameters; and always the parameter tensors and calls recorded from the module) and the where (a
GPU preset by the device's name). torch, DeepSpeed and transformers are imported inside."""
import json

from zerocalc import dsconfig, hardware
from zerocalc.training import OPTIMIZERS, Setup, Stage, validate_setup

ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flash_attention_3": "flash"}


def ds_config_of(engine) -> dict:
    """The ds_config DeepSpeed parsed (a file given by path, loaded; Trainer's "auto" values filled)."""
    parsed = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(parsed, dict):
        return parsed
    if isinstance(getattr(engine, "config", None), dict):
        return engine.config
    raise ValueError("the engine holds no ds_config dict (engine._config._param_dict)")


def hf_config_of(module):
    """The module's Hugging Face config (a PEFT model's: its base model's), None for another module."""
    config = getattr(module, "config", None)
    return config if hasattr(config, "to_diff_dict") and getattr(config, "model_type", None) else None


def _optimizer(engine) -> tuple[str | None, str | None]:
    """(zerocalc's name of the optimizer the engine steps, a note where it is not modelled) from the
    optimizer object, for a ds_config without an "optimizer" block (Trainer's own AdamW, a client one)."""
    opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "client_optimizer", None)
    if opt is None:
        return None, None
    name = type(opt).__name__.lower()
    if "adam" in name:
        wide = "adamw" in name or getattr(opt, "adam_w_mode", False) or getattr(opt, "adamw_mode", False)
        return ("adamw" if wide else "adam"), None
    if "sgd" in name:
        momentum = (opt.param_groups[0].get("momentum") or 0) if getattr(opt, "param_groups", None) else 0
        return ("sgd-momentum" if momentum else "sgd"), None
    return None, f"optimizer {type(opt).__name__} is not modelled: Adam's 8 bytes per parameter are assumed"


def _checkpointing(module) -> bool:
    """Whether an HF model recomputes its layers (transformers 5 renamed the flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            return bool(getattr(module, name))     # a PEFT model hands it on from its base model
        except AttributeError:
            continue
    return False


def _any_fp32_param(module) -> bool:
    import torch
    return any(p.dtype == torch.float32 for p in module.parameters())


def setup_of(engine, module, batch_shape, path: str, overrides: dict) -> tuple[Setup, list[str]]:
    """The Setup DeepSpeed runs, and notes on what zerocalc does not model in it. `batch_shape`: the
    (micro-batch, sequence length) of the inputs seen, None where no 2-D input was seen; `overrides`:
    Setup fields the user gave (activation_checkpointing, zero_init, ...), which win."""
    config = hf_config_of(module)
    hidden = getattr(config, "hidden_size", None) if config is not None else None
    ds = dsconfig.parse(ds_config_of(engine), hidden)
    fields, notes = dict(ds.fields), list(ds.warnings)
    if "optimizer" not in fields:
        name, note = _optimizer(engine)
        if name:
            fields["optimizer"] = name
        notes += [note] if note else []
    stage = fields.pop("stage", 0)
    if stage < 3:
        fields.pop("offload_param", None)
    if stage == 0:
        fields.pop("offload_optimizer", None)
    micro, seq = batch_shape or (engine.train_micro_batch_size_per_gpu(), None)
    fields.update(micro_batch=micro, seq_len=seq, gas=engine.gradient_accumulation_steps(),
                  hf_trainer=path == "trainer")
    if config is not None:
        fields["activation_checkpointing"] = _checkpointing(module)
        fields["attention"] = ATTENTION.get(getattr(config, "_attn_implementation", None) or "sdpa", "sdpa")
    if stage == 3:   # a model built under zero.Init keeps parameters made fp32 (PEFT's adapters) as they were
        fields["zero_init"] = _zero3_from_transformers() or (fields.get("dtype", "fp32") != "fp32"
                                                              and _any_fp32_param(module))
    fields["expandable_segments"] = _expandable_segments()
    fields.update(overrides)
    if isinstance(fields.get("optimizer"), str):
        fields["optimizer"] = OPTIMIZERS[fields["optimizer"]]
    dp = getattr(engine, "dp_world_size", None) or _world_size()
    setup = Setup(stage=Stage(stage), dp=dp, **fields)
    validate_setup(setup)
    return setup, notes


def _zero3_from_transformers() -> bool:
    """transformers builds models under zero.Init while an HfDeepSpeedConfig at stage 3 is alive (Trainer's)."""
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _expandable_segments() -> bool:
    import os
    return "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()


def _world_size() -> int:
    import deepspeed.comm as dist
    return dist.get_world_size()


def gpu_preset(device_name: str | None):
    """The GPU preset a device's name is (NVIDIA H100 80GB HBM3 -> h100), None for none or CPU."""
    if not device_name:
        return None
    name = device_name.lower().replace(" ", "")
    for key, hw in hardware.PRESETS.items():
        base, _, size = key.partition("-")
        if base in name and (not size or size.rstrip("g") + "gb" in name):
            return hw
    return None


def _lora_of(module):
    """The active PEFT LoRA adapter as zerocalc reads it, None without PEFT; ValueError for one it cannot."""
    configs = getattr(module, "peft_config", None)
    if not configs:
        return None
    from zerocalc import adapters
    cfg = configs[getattr(module, "active_adapter", None) or next(iter(configs))]
    d = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()}
    kind = getattr(d.get("peft_type"), "value", d.get("peft_type"))      # PEFT's enum, or its name
    return adapters.from_peft_config({**d, "peft_type": str(kind)}, "the model's peft_config")


def _frozen_roots(module) -> tuple[str, ...]:
    """The outermost modules of `module` that hold parameters and freeze every one of them."""
    out = []
    for name, m in module.named_modules():
        params = list(m.parameters())
        if name and params and not any(p.requires_grad for p in params) \
                and not any(name.startswith(r + ".") for r in out):
            out.append(name)
    return tuple(out)


def frozen_column(module) -> str:
    """The row's `freeze`: the outermost fully frozen modules as JSON, for a model without PEFT."""
    if getattr(module, "peft_config", None):
        return ""
    roots = _frozen_roots(module)
    return json.dumps(list(roots)) if roots else ""


def recorded_model(record: dict, name: str, buffer_element_bytes: int):
    """zerocalc's ModelSpec from the module's recorded tensors and calls (no wrapper around them)."""
    from zerocalc.probe.record import recorded_spec
    return recorded_spec(record, name, wrapper=False, buffer_element_bytes=buffer_element_bytes)


def config_dict(config) -> dict:
    """A config as a row keeps it: what differs from its class's defaults, the model_type included."""
    d = config.to_diff_dict()
    d.pop("transformers_version", None)
    return json.loads(json.dumps(d, default=str))


def configured_spec(module, record: dict):
    """(zerocalc's ModelSpec from the module's HF config, how it was made): its shipped profile (a
    config that is one by the keys that build the model) or its trace, with the PEFT LoRA and the
    frozen modules; (None, why) where there is no config or its tensors are not the module's."""
    config = hf_config_of(module)
    if config is None:
        return None, (f"{type(module).__name__}'s {len(record['param_numels'])} parameter tensors and its calls, as "
                      "recorded (no Hugging Face config: no activations, so no device peaks)")
    from zerocalc import adapters, configmatch, profile
    from zerocalc.model import from_profile
    d = config_dict(config)
    names, _, _ = configmatch.match(d)
    if names:
        p, how = profile.shipped_profile(names[0]), f"the shipped {names[0]}"
    else:
        from zerocalc.hf import trace
        p = trace.cached_trace(d, d.get("_name_or_path") or d["model_type"])
        how = f"{d['model_type']} traced from its config"
    lora = _lora_of(module)
    trainable = record.get("trainable")
    freeze = () if lora is not None or trainable is None else _frozen_roots(module)
    spec = adapters.spec(p, lora, freeze, how, wrapper=False) if lora or freeze else \
        from_profile(p, how, wrapper=False)
    if lora is not None:
        short = isinstance(lora.targets, str) or len(lora.targets) <= 4
        how += " + " + (lora.describe() if short else f"{'DoRA' if lora.dora else 'LoRA'} r{lora.rank} on "
                        f"{len(lora.targets)} modules")
    if freeze:
        how += f" (frozen: {', '.join(freeze)})"
    every = [True] * len(spec.param_numels)
    if list(spec.param_numels) != list(record["param_numels"]) or \
            list(spec.trainable or every) != list(trainable or every):
        return None, f"{how} is not the module trained (its parameter tensors differ): from the recorded tensors"
    return spec, how


def model_columns(module) -> dict:
    """The row's model columns: an HF model's dimensions under the Architecture fields' names (family
    "auto-<model_type>", as the validator's HF rows), another module's class as its family."""
    config = hf_config_of(module)
    if config is None:
        return {"family": f"module-{type(module).__name__}", "hf_name": type(module).__name__}
    from zerocalc.hf.trace import dims
    d = dims(config)
    out = {"family": f"auto-{config.model_type}", **{k: d.get(k) for k in (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "tie_embeddings",
        "max_positions", "attention_bias", "mlp_bias")}}
    out["hf_name"] = getattr(config, "_name_or_path", "") or config.model_type
    out["hf_model_type"] = config.model_type
    out["hf_config"] = json.dumps(config_dict(config), sort_keys=True)
    if d.get("num_experts"):
        out.update(hf_num_experts=d["num_experts"], hf_experts_per_token=d.get("experts_per_token"))
    return {k: v for k, v in out.items() if v is not None}
