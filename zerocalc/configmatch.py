"""Which shipped profile a config.json is: by the keys that build the model, not by the file's bytes.

A Hub config.json carries keys the shipped one lacks (`torch_dtype`, `transformers_version`,
`initializer_range`, ...) and keys at their defaults (`attention_bias: false`). It is the shipped
model NAME when, for every key zerocalc does not ignore (IGNORED, IGNORED_IF), transformers builds
the same config from it as from NAME's: each such key the file gives holds a value that
`zerocalc.hf.ship.match_record` found, with transformers, to resolve NAME's config unchanged
(`accept`), and every key NAME's config needs is given (`required`: those whose default differs).
A key no record names decides unless transformers keeps it as a bare attribute that NAME's code never
reads (`unread`). Any other key, or another value, decides: the config is then traced, or refused naming
the key.

Torch-free: the records are JSON (`zerocalc/hf/matching.json`), made by `python -m zerocalc.hf.ship`.
"""
import json
import os
from functools import lru_cache

# Keys that decide none of the tensors, activations or operations zerocalc reads (state, the module
# calls, the traced allocation stream, the operators and FLOPs), with why. Checked, with torch, by
# tests/test_configmatch.py tracing small configs of every shipped model type with each changed.
IGNORED = {
    "_name_or_path": "where the file was loaded from",
    "architectures": "zerocalc builds the model_type's causal LM (AutoModelForCausalLM.from_config), "
                     "whichever class the file lists (a file listing only other heads is refused: "
                     "resolve.OTHER_HEADS)",
    "auto_map": "the repository's own classes, which transformers uses only with trust_remote_code; "
                "zerocalc builds transformers' own class of the model_type (one it lacks is refused)",
    "transformers_version": "the version that wrote the file; a profile records the one that traced it",
    "torch_dtype": "the checkpoint's storage dtype: the training dtype is the setup's (--dtype, the "
                   "ds_config's fp16/bf16), to which DeepSpeed's engine casts the module",
    "dtype": "transformers 5's name for torch_dtype",
    "bos_token_id": "read by tokenisation and generation only",
    "eos_token_id": "read by tokenisation and generation only",
    "pad_token_id": "nn.Embedding's padding_idx: the same weight and embedding operator; only the "
                    "padding row's initial value and its gradient (zeroed inside the same kernel) differ",
    "initializer_range": "the spread of the initial weights: values, not shapes",
    "cache_implementation": "the KV cache generate() builds; training runs without one (use_cache)",
    "use_cache": "zerocalc's trace, as the validator, calls the model with use_cache=False whatever "
                 "the config says (HF Trainer does under gradient checkpointing)",
    "rope_theta": "the rotary base: the values of inv_freq, not its shape or the operators",
    "rope_local_base_freq": "Gemma 3's rotary base of its local layers: values only",
    "task_specific_params": "pipelines' generation settings",
    "output_past": "GPT-2's old name for use_cache",
    "rms_norm_eps": "a constant inside the norm's operators",
    "layer_norm_eps": "a constant inside the norm's operators",
    "layer_norm_epsilon": "a constant inside the norm's operators",
    "router_aux_loss_coef": "weighs the router's auxiliary loss, computed only with output_router_logits",
    "id2label": "the labels of a sequence-classification head: the causal LM zerocalc builds has none",
    "label2id": "the labels of a sequence-classification head: the causal LM zerocalc builds has none",
    "num_labels": "the size of a sequence-classification head: the causal LM zerocalc builds has none",
}

# Rope types whose rotary tables depend on max_position_embeddings only in their values: the others
# ("dynamic", "longrope") compare the sequence length with it at run time and may switch tables.
_STATIC_ROPE = (None, "default", "linear", "llama3", "yarn")
# Model types whose positions are rotary only: no table or buffer is sized by max_position_embeddings
# (the rotary module keeps it for the dynamic rope types alone).
ROTARY_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2",
                "gemma3_text", "phi3", "olmo2", "gpt_neox", "deepseek_v2")
# Qwen's configs set sliding_window to None (0 for qwen2_moe) and every layer to full attention
# unless use_sliding_window is true; max_window_layers is read only then.
_QWEN_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


# The keys of a rope dict that set only the values of the rotary tables (the base, the scaling factors,
# the llama3/yarn constants). The rope type decides (the code that builds the tables, and so the dtype
# inv_freq keeps under zero.Init: `hf.trace.zero_init_kept`), as do `partial_rotary_factor` (the tables'
# width) and any other key.
_ROPE_VALUES = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
ROPE_KEYS = ("rope_scaling", "rope_parameters")


def _per_layer_type(value) -> bool:
    """Whether a rope value is one dict per layer type, as transformers 5 nests Gemma 3's (full and
    sliding attention)."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())


def _ropes(value) -> list:
    """The rope dicts of a `rope_scaling` or `rope_parameters` value: none where it is absent or falsy,
    one per layer type where nested; a value that is no dict is returned as it is."""
    if not value:
        return []
    return list(value.values()) if _per_layer_type(value) else [value]


def _rope_types(d: dict) -> set:
    """The rope types config `d` names ("?" for a rope value that is no dict; None: the default)."""
    ropes = _ropes(d.get("rope_scaling")) + _ropes(d.get("rope_parameters"))
    return {r.get("rope_type", r.get("type")) if isinstance(r, dict) else "?" for r in ropes} or {None}


def _static_rope(d: dict) -> bool:
    return d.get("model_type") in ROTARY_TYPES and _rope_types(d) <= set(_STATIC_ROPE)


def rope_built(value):
    """What of a rope value builds the model: per rope dict (per layer type where nested) its type
    ("default" where none is named) and every other key but `_ROPE_VALUES`, which only scale the tables."""
    def built(r):
        if not isinstance(r, dict):
            return r
        kind = r.get("rope_type", r.get("type")) or "default"
        return {"rope_type": kind, **{k: v for k, v in r.items() if k not in _ROPE_VALUES + ("rope_type", "type")}}
    if _per_layer_type(value):
        return {k: built(v) for k, v in value.items()}
    return built(value) if value else {"rope_type": "default"}


def _window_off(d: dict) -> bool:
    return d.get("model_type") in _QWEN_TYPES and d.get("use_sliding_window", False) is False


# Checkpoint formats transformers dequantizes into the model's own layers for training; any other
# quant_method (bitsandbytes, GPTQ, AWQ, ...) builds quantized layers and decides (`LOADING`).
DEQUANTIZED = ("fp8", "mxfp4")
# Keys ignored only where a condition on the config holds: (condition, why).
IGNORED_IF = {
    "max_position_embeddings": (
        _static_rope,
        "rotary positions: no table or buffer has that length, and a static rope type's tables do not "
        "switch on it"),
    "sliding_window": (_window_off, "Qwen with use_sliding_window false: every layer attends fully"),
    "max_window_layers": (_window_off, "Qwen with use_sliding_window false: every layer attends fully"),
    "hidden_act": (lambda d: d.get("model_type") in ("gemma2", "gemma3_text"),
                   "Gemma's MLP reads hidden_activation; hidden_act is read by no module"),
    "quantization_config": (
        lambda d: isinstance(d.get("quantization_config"), dict)
        and d["quantization_config"].get("quant_method") in DEQUANTIZED,
        "the checkpoint's storage format (DeepSeek's fp8 blocks, GPT-OSS's MXFP4 experts), which transformers "
        "dequantizes to train (`dequantize=True`, how these models are fine-tuned): the training dtype is the "
        "setup's"),
}


# Keys whose number only scales tensors' values: whether the file gives one at all (null: none; 0:
# off) decides an operator, the number itself decides nothing zerocalc reads. A file with another
# number than the shipped model's, of the same kind (`kind`), is the shipped model. Checked, with
# torch, by tests/test_configmatch.py tracing the shipped model types with each changed.
DROPOUTS = ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop",
            "residual_dropout", "embedding_dropout", "activation_dropout", "dropout")
SCALES = {
    "attention_multiplier": "Granite's softmax scale, in place of 1/sqrt(head_dim)",
    "embedding_multiplier": "Granite multiplies the embeddings by it",
    "residual_multiplier": "Granite multiplies each block's output by it before the residual add",
    "logits_scaling": "Granite divides the logits by it",
    "logit_scale": "Command-R multiplies the logits by it",
    "query_pre_attn_scalar": "Gemma's softmax scale is its inverse square root",
    "attn_logit_softcapping": "Gemma 2's tanh cap of the attention logits (null: no cap)",
    "final_logit_softcapping": "Gemma's tanh cap of the logits (null: no cap)",
    "routed_scaling_factor": "DeepSeek multiplies the routed experts' weights by it",
    "swiglu_alpha": "GPT-OSS's gate slope inside its SwiGLU",
    "swiglu_limit": "GPT-OSS clamps gate and up to it",
    "router_jitter_noise": "Mixtral's noise on the router's input in training (0: none)",
    "input_jitter_noise": "PhiMoE's noise on the experts' input in training (0: none)",
    "clip_qkv": "OLMo clamps queries, keys and values to it (null: no clamp)",
    # 0 applies no dropout (torch returns the input); any p strictly between 0 and 1 the same kernels
    # and the same bool mask, whatever p
    **dict.fromkeys(DROPOUTS, "a dropout probability: 0 applies none; any other below 1 the same kernels"),
}


def kind(key: str, value):
    """What of a `SCALES` key's value decides: a dropout probability strictly between 0 and 1 is one
    kind, any other number one kind; 0, null and any value that is no number are each their own."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ("value", json.dumps(value))
    if value == 0:
        return "zero"
    if key in DROPOUTS:
        return "fraction" if 0 < value < 1 else ("value", float(value))
    return "number"


# A key no record names is ignored where transformers stores it as a plain attribute of the config (it
# is no keyword of the model type's config class: `matching.json`'s "keywords", `ship.config_keywords`)
# and the model's code never reads it (the record's "reads", `ship.model_reads`): OPT's `prefix`,
# StarCoder2's `norm_type`, DeepSeek's `ep_size`, GPT-OSS's `experts_per_token`. Checked on the Hub's
# files by tests/test_configmatch.py. But these, which change how a checkpoint is loaded, not the config:
LOADING = {"quantization_config": "a quantized checkpoint: from_pretrained builds quantized layers "
                                  "(bitsandbytes' 4/8-bit, GPTQ, AWQ), which zerocalc does not model"}
UNREAD = "transformers keeps it as an attribute that the model's code never reads"


def unread(key: str, record: dict) -> bool:
    """Whether `key` decides nothing for the shipped model of `record`: no keyword of its config class,
    never read by its code (`LOADING` keys excepted). False where the record cannot tell."""
    reads, keywords = record.get("reads"), recorded().get("keywords", {}).get(record["model_type"])
    return reads is not None and keywords is not None and key not in LOADING and key != "model_type" \
        and key not in keywords and key not in reads


def why_ignored(key: str, d: dict) -> str | None:
    """Why zerocalc ignores `key` in config `d` (present or not), or None where it decides."""
    if key in IGNORED:
        return IGNORED[key]
    cond, why = IGNORED_IF.get(key, (None, None))
    return why if cond is not None and cond(d) else None


def ignored(d: dict, record: dict | None = None) -> dict[str, str]:
    """The keys of config `d` zerocalc ignores, with why (those `unread` by the shipped model of `record`
    too, where given)."""
    return {k: why for k in d
            if (why := why_ignored(k, d) or (UNREAD if record and unread(k, record) else None)) is not None}


def same(a, b) -> bool:
    """JSON values equal as transformers reads them: 1 == 1.0, but true is no number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def rescaled(d: dict, record: dict) -> list[str]:
    """The `SCALES` keys of config `d` that hold another number than the shipped model of `record`,
    of the same kind: what the file changes that zerocalc reads nothing of, for the note."""
    accept = record["accept"]
    return sorted(k for k, v in d.items() if k in SCALES and k in accept
                  and not any(same(v, a) for a in accept[k]) and any(kind(k, v) == kind(k, a) for a in accept[k]))


def differences(d: dict, record: dict) -> list[str]:
    """The deciding keys on which config `d` and a shipped model's record differ, sorted: a key `d`
    gives with a value that does not resolve to the record's config, or a required key it lacks (and
    every key that carries it in the file transformers writes, `ship._with_saved_form`)."""
    if d.get("model_type") != record["model_type"]:
        return ["model_type"]
    accept, inert = record["accept"], set(record.get("inert", ()))

    def accepted(k, v) -> bool:      # a static rope of a rotary model: by what builds it (`rope_built`)
        if k in ROPE_KEYS and _static_rope(d):
            return any(same(rope_built(v), rope_built(a)) for a in accept.get(k, ()))
        if k in SCALES:
            return any(kind(k, v) == kind(k, a) for a in accept.get(k, ()))
        return any(same(v, a) for a in accept.get(k, ()))
    out = {k for k, v in d.items() if k != "model_type" and k not in inert and why_ignored(k, d) is None
           and not accepted(k, v) and not unread(k, record)}
    for k in record["required"]:     # a key, or [key, the keys that carry it in the file transformers writes]
        k, *carriers = [k] if isinstance(k, str) else k
        if k not in d and not any(c in d for c in carriers) and why_ignored(k, d) is None:
            out.add(k)
    return sorted(out)


RECORDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf", "matching.json")


@lru_cache(maxsize=1)
def recorded() -> dict:
    """matching.json: {"transformers": the version that made it, "model_types": those it implements,
    "profiles": {name: record}, "keywords": {model_type: its config class's keywords}} ({} before
    `python -m zerocalc.hf.ship --matching` made it)."""
    try:
        with open(RECORDS) as f:
            out = json.load(f)
    except OSError:
        return {}
    for record in out.get("profiles", {}).values():      # looked up per key of every file matched
        if record.get("reads") is not None:
            record["reads"] = frozenset(record["reads"])
    out["keywords"] = {kind: frozenset(names) for kind, names in out.get("keywords", {}).items()}
    return out


def records() -> dict:
    """{name: match record} of every shipped profile."""
    return recorded().get("profiles", {})


def _closeness(d: dict, record: dict, skip=()) -> tuple[int, int]:
    """How near config `d` is to a record's config, ignored keys included, `skip` left out: (keys both
    hold at other values, minus the keys both hold at the same value); smaller is nearer."""
    config = record["config"]
    both = [k for k in d if k in config and k not in skip]
    same_value = sum(1 for k in both if same(d[k], config[k]))
    return len(both) - same_value, -same_value


def canonical(d: dict) -> dict:
    """Config `d` with each key given under another name of its model type (`matching.json`'s "aliases":
    BLOOM's `n_embed` and `num_attention_heads` are `hidden_size` and `n_head`) under the field's own,
    as transformers reads it; an alias whose field `d` also gives is dropped where the two agree."""
    aliases = recorded().get("aliases", {}).get(d.get("model_type"), {})
    out = dict(d)
    for alias, field in aliases.items():
        if alias in out and field not in out:
            out[field] = out.pop(alias)
        elif alias in out and same(out[alias], out[field]):
            del out[alias]
    return out


def match(d: dict) -> tuple[list[str], str | None, list[str]]:
    """(the shipped names `d` is: several where shipped models are one architecture, as Llama-3.1-70B and
    Llama-3.3-70B, the nearest first, by the values of the keys zerocalc ignores too (Qwen2-7B's file
    is qwen2-7b, not qwen2.5-7b); else [], the nearest shipped name of its model_type and the keys it
    differs in)."""
    d = canonical(d)
    names, others = [], []
    for name, record in sorted(records().items()):
        diff = differences(d, record)
        if not diff:
            names.append(name)
        elif diff != ["model_type"]:
            others.append((len(diff), _closeness(d, record, diff), name, diff))
    names.sort(key=lambda n: _closeness(d, records()[n]))      # stable: by name among equals
    if names or not others:
        return names, None, []
    _, _, near, near_diff = min(others)
    return [], near, near_diff


def describe(d: dict, name: str, keys: list[str], most: int = 4) -> str:
    """`key = value (NAME: value)` for the first `most` keys, for a message."""
    record = records()[name]
    shipped = record["config"]

    def value(v) -> str:      # a long one (LongRoPE's factor lists) cut
        text = json.dumps(v, allow_nan=True)
        return text if len(text) <= 80 else text[:77] + "..."

    def show(k):
        mine = value(d[k]) if k in d else "absent"
        theirs = value(shipped[k]) if k in shipped else "absent"
        return f"{k} {mine} ({name}: {theirs})"
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(show(k) for k in keys[:most]) + more
