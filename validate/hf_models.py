"""Any Hugging Face causal LM the validator trains: built from a config.json with
`AutoModelForCausalLM.from_config` (random weights, no hub access), for any model_type the pinned
transformers builds; and what the run saw of it (parameter tensors, forward call order, buffers), from
which zerocalc predicts states and communication. docs/hf-validation.md says how to use it.

A config is named by a file `validate/hf_configs/<name>.json` (a published config.json, copied) or given
as a dict; a matrix may override keys (`num_hidden_layers`, `num_local_experts`, ...) to scale it down.
Rows record the exact dict the model was built from."""
import json
import os

from zerocalc.probe.record import SpecRecorder, recorded_spec  # noqa: F401  (what a run saw of its model)

HF_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_configs")
DS_CONFIG_DIR = os.path.join(HF_CONFIG_DIR, "ds")
FAMILY_PREFIX = "auto-"          # an HF job's `family`: "auto-qwen2", never one of zerocalc's transcribed families
PATHS = ("engine", "trainer")    # deepspeed.initialize directly, or transformers.Trainer with an "auto" ds_config


def _config_file(ref: str) -> tuple[str, str]:
    """(name, file) for a config named by `ref`: a config.json, a model directory holding one, or a name
    under validate/hf_configs/."""
    if os.path.isdir(ref) and os.path.exists(os.path.join(ref, "config.json")):
        return os.path.basename(os.path.normpath(ref)), os.path.join(ref, "config.json")
    if os.path.isfile(ref):
        return os.path.basename(ref).removesuffix(".json"), ref
    path = os.path.join(HF_CONFIG_DIR, ref + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no HF config {ref!r}: give a config.json, a model directory holding one, a name under "
                         f"{HF_CONFIG_DIR}, or the config as a dict")
    return ref, path


def load_config(ref, overrides: dict | None = None) -> tuple[str, dict]:
    """(name, config dict) for a matrix entry: `ref` is a config.json, a model directory, the name of a
    file under validate/hf_configs/, or a dict with a "model_type"; `overrides` replaces keys (how a
    matrix scales a model down)."""
    if isinstance(ref, dict):
        name, cfg = ref.get("_name_or_path") or ref["model_type"], dict(ref)
    else:
        name, path = _config_file(ref)
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"{path}: not a readable config.json ({err})")
        except RecursionError:
            raise ValueError(f"{path}: not a readable config.json (nested too deeply)")
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: not a config.json (a JSON object)")
    if "model_type" not in cfg:
        raise ValueError(f"HF config {name!r} has no model_type")
    cfg.update(overrides or {})
    return name, cfg


def make_config(cfg: dict):
    """The transformers config object for a config dict (AutoConfig, as from_pretrained reads config.json)."""
    import transformers
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(cfg["model_type"], **rest)
    except ValueError as err:
        if "Unrecognized model" not in str(err):
            raise
        raise ValueError(f"model_type {cfg['model_type']!r} is not one transformers {transformers.__version__} "
                         "knows (AutoConfig)") from None
    except Exception as err:   # noqa: BLE001 -- transformers' own checks of a field (a string for a size)
        raise ValueError(f"transformers refuses this {cfg['model_type']} config: {type(err).__name__}: "
                         f"{' '.join(str(err).split())[:300]}") from None


def _first(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def key_dims(cfg: dict) -> dict:
    """What a row records of the model, in zerocalc's Architecture columns (family "auto-<model_type>")
    plus the MoE shape; the config's defaults filled in by transformers."""
    c = make_config(cfg)
    heads = _first(c, "num_attention_heads")
    return {"family": FAMILY_PREFIX + cfg["model_type"], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers, "num_heads": heads,
            "num_kv_heads": _first(c, "num_key_value_heads", default=heads),
            "ffn_hidden_size": _first(c, "intermediate_size", default=4 * c.hidden_size),
            "tie_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            "max_positions": _first(c, "max_position_embeddings", default=0)}


def moe_dims(cfg: dict) -> dict:
    """Experts and experts per token, where the config has them."""
    c = make_config(cfg)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    return {} if not experts else {"num_experts": experts, "experts_per_token": _first(c, "num_experts_per_tok")}


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


def build(cfg: dict, dtype: str, checkpointing: bool = False, attention: str = "sdpa"):
    """`AutoModelForCausalLM.from_config(config, dtype=...)` with random weights. Under an
    `HfDeepSpeedConfig` at stage 3 (alive while this runs) transformers builds it under zero.Init and
    initializes each module gathered, as `from_pretrained` does for Trainer users. SDPA where the model's
    code has it, else the attention transformers picks for it (zerocalc traces that one). Activation
    checkpointing as HF documents it: `gradient_checkpointing_enable(use_reentrant=False)`."""
    import torch
    from transformers import AutoModelForCausalLM
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
    try:
        model = AutoModelForCausalLM.from_config(make_config(cfg), dtype=torch_dtype,
                                                 attn_implementation=ATTENTION[attention])
    except ValueError as e:    # a model without SDPA (BLOOM under transformers 5.25): its own, as from_pretrained picks
        if attention != "sdpa" or "does not support" not in str(e):
            raise
        model = AutoModelForCausalLM.from_config(make_config(cfg), dtype=torch_dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def moe_block_classes(model) -> list:
    """The MoE blocks' classes: a module that owns an `experts` child (Mixtral's, Qwen-MoE's and
    DeepSeek's sparse MoE blocks)."""
    return sorted({type(m) for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")},
                  key=lambda t: t.__name__)


def set_moe_leaves(model) -> list[str]:
    """`deepspeed.utils.set_z3_leaf_modules` on the MoE blocks, for stage 3: experts that receive no token
    skip their hooks and ranks hang at N > 1 otherwise (DeepSpeed's docs; done here at every N, so rows
    at N = 1 run as N > 1 must). Returns the class names set (empty for a dense model)."""
    classes = moe_block_classes(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def lora_of(job: dict):
    """The job's LoRA as zerocalc reads it (`zerocalc.adapters.Lora`), from its PEFT LoraConfig keywords
    ("lora": {"r": 16, "target_modules": "all-linear", ...}); None without."""
    if not job.get("lora"):
        return None
    from zerocalc import adapters
    return adapters.from_peft_config({"peft_type": "LORA", **job["lora"]}, f"{job.get('key', 'job')}: lora")


def apply_adapters(model, job: dict):
    """What the job trains: modules frozen by its "freeze" patterns (zerocalc's `--freeze` meaning:
    `adapters.freeze_mask`), then PEFT's `get_peft_model` with its "lora" LoraConfig keywords (after the
    model is built, under zero.Init at stage 3, as PEFT users do: DeepSpeed converts the new
    parameters at `initialize`). The model itself where the job has neither."""
    if job.get("freeze"):
        from zerocalc.adapters import _expand_ranges, _module_matches
        for pattern in job["freeze"]:
            names = _expand_ranges(pattern)
            hit = [m for n, m in model.named_modules() if n and any(_module_matches(x, n) for x in names)]
            if not hit:
                raise ValueError(f"freeze {pattern!r} matches no module")
            for m in hit:
                for p in m.parameters():
                    p.requires_grad_(False)
    if job.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**job["lora"]))
    return model


def trained_parameters(model) -> list:
    """What the job hands DeepSpeed's optimizer: the parameters that require grad (as HF Trainer's
    optimizer takes them), every one for a model with none frozen."""
    return [p for p in model.parameters() if p.requires_grad]


def model_spec(job: dict, buffer_element_bytes: int = 4):
    """zerocalc's ModelSpec for an HF job from what its run recorded (`job["hf_spec"]`,
    `zerocalc.probe.record.recorded_spec`), None before a run recorded one; the direct path's logits
    wrapper is one more call around the recorded ones."""
    s = job.get("hf_spec")
    if not s:
        return None
    return recorded_spec(s, job["arch"]["family"], wrapper=job.get("path", "engine") == "engine",
                         buffer_element_bytes=buffer_element_bytes)


_TRACED = {}


def traced_spec(job: dict):
    """zerocalc's own ModelSpec for an HF job's config, as `zerocalc estimate --hf-config` builds it: the
    model traced from its code on fake tensors (zerocalc.hf.trace, cached; parameters and calls exact,
    activations from the Llama formulas at its dimensions), MoE blocks as stage-3 leaves; the direct
    path's logits wrapper counted. None where the trace extra is missing or the trace fails."""
    cfg = job["hf"]["config"]
    if not cfg.get("model_type"):       # a probed model of the user's own: no config to trace
        return None
    wrapper = job.get("path", "engine") == "engine"
    from zerocalc.measured import moe_blocks_as_leaves
    leaf_moe = moe_blocks_as_leaves(job.get("z3_leaf_modules"), job.get("stage"))
    adapted = bool(job.get("lora") or job.get("freeze"))
    variant = (bool(job.get("activation_checkpointing")), job.get("stage") == 3, job.get("attention") or "sdpa") \
        if adapted else None
    key = (json.dumps(cfg, sort_keys=True), wrapper, json.dumps(job.get("lora"), sort_keys=True),
           json.dumps(job.get("freeze")), variant, leaf_moe)
    if key not in _TRACED:
        try:
            from zerocalc import adapters
            from zerocalc.model import from_profile
            from zerocalc.hf import trace
            traced = trace.cached_trace(cfg, job["hf"].get("name") or "")
            lora, freeze = lora_of(job), tuple(job.get("freeze") or ())
            _TRACED[key] = adapters.spec(traced, lora, freeze, job["hf"].get("name"), wrapper=wrapper,
                                         z3_leaf_moe=leaf_moe) \
                if adapted else from_profile(traced, job["hf"].get("name"), z3_leaf_moe=leaf_moe, wrapper=wrapper)
        except (ImportError, ValueError, TypeError, RuntimeError):
            _TRACED[key] = None
        if adapted and _TRACED[key] is not None:
            _TRACED[key] = adapted_stream(_TRACED[key], cfg, lora, *variant)
    return _TRACED[key]


def adapted_stream(spec, cfg: dict, lora, checkpointing: bool, stage3: bool, attention: str):
    """The spec with the allocation stream of its own trained tensors (`zerocalc.hf.adapted`) in the
    variant the job runs, as `zerocalc estimate` gives it; the spec as it was where PEFT's model cannot
    be recorded (its reserved then from the ratio)."""
    from zerocalc import adapters
    from zerocalc.hf import adapted
    try:
        name = adapted.variant(checkpointing, stage3)
        return adapters.with_stream(spec, adapted.stream(cfg, lora, spec.trainable, [name], attention))
    except (ImportError, ValueError, RuntimeError):
        return spec


# The "auto" values HF Trainer fills from TrainingArguments and the model's hidden size
# (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_finalize): what zerocalc's
# Setup needs of them. The worker records the config the engine really got; the CPU test compares.
def resolve_auto(ds: dict, hidden_size: int) -> dict:
    """zerocalc Setup fields for a Trainer job with `ds`, the HF docs' ds_config with "auto" values."""
    z = ds.get("zero_optimization", {})
    stage = int(z.get("stage", 0))

    def value(key, auto, default):
        v = z.get(key, default)
        return auto if v == "auto" else int(float(v))

    out = {"stage": stage,
           "reduce_bucket_size": value("reduce_bucket_size", hidden_size * hidden_size, 500_000_000),
           "overlap_comm": bool(z["overlap_comm"]) if "overlap_comm" in z else None,
           "contiguous_gradients": bool(z.get("contiguous_gradients", True)),
           "offload_optimizer": z.get("offload_optimizer", {}).get("device", "none"),
           "offload_param": z.get("offload_param", {}).get("device", "none")}
    if stage == 3:
        out.update(prefetch_bucket_size=value("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size),
                                              50_000_000),
                   param_persistence_threshold=value("stage3_param_persistence_threshold", 10 * hidden_size, 100_000),
                   max_live_parameters=value("stage3_max_live_parameters", None, 1_000_000_000),
                   max_reuse_distance=value("stage3_max_reuse_distance", None, 1_000_000_000),
                   sub_group_size=value("sub_group_size", None, 1_000_000_000),
                   zero_init=True)
    return out


def load_ds_config(name: str) -> dict:
    """A ds_config for the Trainer path: a file, or a name under validate/hf_configs/ds/."""
    path = name if os.path.isfile(name) else os.path.join(DS_CONFIG_DIR, name + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no ds_config {name!r}: give a ds_config.json or a name under {DS_CONFIG_DIR}")
    try:
        with open(path) as f:
            ds = json.load(f)
    except (OSError, ValueError, RecursionError) as err:   # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: not a readable ds_config ({type(err).__name__}: {err})"[:400])
    if not isinstance(ds, dict) or not isinstance(ds.get("zero_optimization", {}), dict):
        raise ValueError(f"{path}: not a ds_config (a JSON object, its zero_optimization an object)")
    return ds
