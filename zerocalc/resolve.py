"""From what the user names to a ModelSpec: a shipped profile (with overrides), or a config.json (a
file of any name or a model directory). Torch-free: a config is traced (`zerocalc.hf.trace`, the
optional `trace` extra) only when neither a shipped profile nor one of the validator's families
(`zerocalc.family`) reads it."""
import json
import os
import sys
from dataclasses import replace
from functools import lru_cache

from zerocalc import configmatch as _configmatch
from zerocalc import family as _family
from zerocalc import profile as _profile
from zerocalc.inputs import check_hf_config, load_json_object
from zerocalc.model import ModelSpec, from_architecture, from_profile
from zerocalc.stage3_trace import held_after_forward_elements

INSTALL = "pip install 'zerocalc[trace]'"
SHAPE_FLAGS = "--vocab-size/--hidden-size/--num-layers/--num-heads (with --num-kv-heads, --ffn-hidden-size)"
# zerocalc's override flags -> the config.json keys they set
CONFIG_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
               "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
               "ffn_hidden_size": "intermediate_size", "tie_embeddings": "tie_word_embeddings"}
GPT2_KEYS = {"hidden_size": "n_embd", "num_layers": "n_layer", "num_heads": "n_head", "ffn_hidden_size": "n_inner"}


def names() -> list[str]:
    """Every --model name: the shipped profiles."""
    return sorted(_profile.shipped())


# Where each shipped profile's values were read: its Hub repository (`{"name": {"repo": ...}}`).
SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf", "sources.json")
# Tokens of a Hub repository's name that mark a release with the same tensors: instruction- or chat-tuned
# (`-Instruct`, `-chat`, Gemma's `-it`), base or pretrained (`-Base`, Gemma 3's `-pt`), the HF conversion
# (`-hf`); and Meta's `Meta-` prefix.
_VARIANT_TOKENS = frozenset(("instruct", "chat", "it", "base", "pt", "hf"))


def canonical_name(given: str) -> str | None:
    """The --model name `given` stands for, in any case: a shipped name; the Hub repository a profile was
    read from (`mistralai/Mixtral-8x7B-v0.1`, `allenai/OLMo-2-1124-7B`); or a release of either that
    differs only by `_VARIANT_TOKENS` (`Qwen/Qwen2.5-7B-Instruct`, `google/gemma-3-27b-it`). None if it
    stands for none, or for more than one."""
    text = given.strip().lower()
    if text in set(names()):
        return text
    return _hub_ids().get(_hub_id(text)) or _releases().get(release_key(_repo_name(text)))


def release_key(name: str) -> str:
    """A Hub repository's name without its variant tokens ("Meta-Llama-3-8B-Instruct" -> "llama-3-8b")."""
    name = name.lower().removeprefix("meta-")
    return "-".join(t for t in name.split("-") if t not in _VARIANT_TOKENS)


def _repo_name(given: str) -> str:
    """A Hub id's repository name, lower case ("meta-llama/Llama-3.1-8B" -> "llama-3.1-8b"), also from
    its address ("https://huggingface.co/meta-llama/Llama-3.1-8B/tree/main")."""
    return _hub_id(given).rsplit("/", 1)[-1]


def _hub_id(given: str, lower: bool = True) -> str:
    """"org/name" from a Hub id or its address (the page, a file's, a branch's), in lower case."""
    text = given.strip()
    for prefix in ("https://", "http://", "huggingface.co/", "hf.co/"):
        text = text[len(prefix):] if text.lower().startswith(prefix) else text
    text = "/".join(text.strip("/").split("/")[:2])
    return text.lower() if lower else text


@lru_cache(maxsize=1)
def _sources() -> dict[str, dict]:
    """zerocalc/hf/sources.json: {shipped name: where its values were read, ...}, read once."""
    with open(SOURCES) as f:
        return json.load(f)


@lru_cache(maxsize=1)
def hub_repos() -> dict[str, str]:
    """{shipped name: the Hub repository its values were read from} (the case study's GPT has none)."""
    return {name: v["repo"] for name, v in _sources().items() if v.get("repo")}


@lru_cache(maxsize=1)
def text_models() -> dict[str, str]:
    """{shipped name: what the Hub's checkpoint holds beside it} for a shipped text model whose Hub
    repository publishes it inside a multimodal model (Gemma 3 from 4B up)."""
    return {name: v["text_of"] for name, v in _sources().items() if v.get("text_of")}


def _hub_ids() -> dict[str, str]:
    """{lower-case Hub id: its shipped name}."""
    return {repo.lower(): name for name, repo in hub_repos().items()}


@lru_cache(maxsize=1)
def _releases() -> dict[str, str]:
    """{release key of a shipped name or of its repository's name: the shipped name}, keys that two
    shipped models share left out (such a name is not guessed)."""
    by_key: dict[str, set] = {}
    for name in names():
        by_key.setdefault(release_key(name), set()).add(name)
    for repo, name in _hub_ids().items():
        by_key.setdefault(release_key(_repo_name(repo)), set()).add(name)
    return {key: next(iter(found)) for key, found in by_key.items() if len(found) == 1}


def unknown_model(given: str) -> str:
    """What to say of a --model name that stands for no shipped model: the nearest names, and how to
    bring any model (for a Hub id, the address of its config.json)."""
    import difflib
    near = difflib.get_close_matches(release_key(_repo_name(given)), names(), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(near)}? " if near else ""
    repo = _hub_id(given, lower=False)
    where = (f"download https://huggingface.co/{repo}/resolve/main/config.json" if repo.count("/") == 1
             else "download its config.json from the Hub")
    return (f"{given!r} is not a shipped model; {hint}`zerocalc models` lists them. Any other model: {where} "
            "and give --hf-config config.json (a shipped model's own file is recognised, without torch)")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def describe_overrides(overrides: dict, derived: dict | None = None) -> str:
    parts = [f"{flag(k)} {v}" for k, v in overrides.items()]
    parts += [f"{k.replace('_', '-')} {v} derived" for k, v in (derived or {}).items()]
    return ", ".join(parts)


def preset_spec(name: str, overrides: dict) -> ModelSpec:
    """A shipped profile, with overrides. A model the validator's family is, code and sizes (a Llama,
    Mistral, GPT-2 or the seed's GPT), takes them without torch, as that family at the new sizes
    (`overridden`); another's config.json is traced again with them (needs the extra)."""
    if not overrides:
        return _shipped_spec(name)
    shipped = _shipped_spec(name)
    if _family.FAMILY in shipped.profile.source and shipped.profile.model_type in _family.CODE:
        a, derived = overridden(shipped.architecture, overrides)
        return from_architecture(a, f"{name} ({describe_overrides(overrides, derived)})")
    from zerocalc.hf.ship import configs
    with open(configs()[name]) as f:
        d = json.load(f)
    return _traced(_override_config(d, overrides), f"{name} ({describe_overrides(overrides)})", f"--model {name}")


def overridden(a, overrides: dict):
    """(a with the overrides, what was derived from them): a new hidden size without a new FFN width
    keeps the model's FFN/hidden ratio (the seed's GPT has FFN 4·hidden at every width)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    derived = {}
    if "hidden_size" in given and "ffn_hidden_size" not in given:
        derived["ffn_hidden_size"] = int(round(given["hidden_size"] * a.ffn_hidden_size / a.hidden_size))
    return replace(a, **given, **derived), derived


@lru_cache(maxsize=None)
def _shipped_spec(name: str) -> ModelSpec:
    """A shipped profile's ModelSpec, built once per process (the frozen spec then keys the stage-3
    walk's caches)."""
    return from_profile(_profile.shipped_profile(name), name)


def _override_config(d: dict, overrides: dict) -> dict:
    keys = GPT2_KEYS if d.get("model_type") == "gpt2" else {}
    d = dict(d)
    for k, v in overrides.items():
        d[keys.get(k, CONFIG_KEYS[k])] = v
    return d


def read_config(path: str) -> tuple[dict, str]:
    """(config.json's contents, the file read) of a file or a model directory. JSON is read as
    transformers reads it (Python's json: `Infinity` and `NaN` are numbers, as in Nemotron-H's file)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    # file named in every error; sizes type- and range-checked (`zerocalc.inputs`)
    return check_hf_config(load_json_object(file, "Hugging Face config.json", constants=True), file), file


def _implemented_types() -> tuple[str, set]:
    """(which transformers, the model types it implements): the installed one's, else those of the
    transformers the shipped profiles were made with (`zerocalc/hf/matching.json`)."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        return f"transformers {transformers.__version__}", set(CONFIG_MAPPING.keys())
    except ImportError:
        recorded = _configmatch.recorded()
        return f"transformers {recorded.get('transformers', '')}".strip(), set(recorded.get("model_types", ()))


def _refuse_remote_code(d: dict, given: str) -> None:
    """A model_type transformers does not implement is built by its repository's own code (its config's
    `auto_map`: chatglm, internlm2, baichuan, ...), which zerocalc never runs: refused with what works."""
    kind = d.get("model_type")
    which, known = _implemented_types()
    if not known or kind in known:
        return
    code = " (its auto_map points at the repository's own code)" if "auto_map" in d else ""
    raise ValueError(f"{given}: model_type {kind!r} is not one {which} implements{code}, and zerocalc runs no "
                     f"remote code; give --params P (its parameter count), or the shape flags {SHAPE_FLAGS}")


# Heads a config's `architectures` may name that are no causal LM: zerocalc models the LM head and its
# logits, which these replace (a reward model's score over the last token, an embedding model's bare
# decoder).
OTHER_HEADS = {"ForSequenceClassification": "a sequence-classification head (a reward model's)",
               "ForTokenClassification": "a token-classification head",
               "ForQuestionAnswering": "a question-answering head",
               "ForRewardModel": "a reward head", "ForProcessRewardModel": "a reward head"}


def _other_head(name: str) -> str | None:
    """What `name`, a class of `architectures`, is where it is no causal LM; None where it is one."""
    for suffix, what in OTHER_HEADS.items():
        if name.endswith(suffix):
            return what
    if name.endswith("Model") and not name.endswith("LMHeadModel"):
        return "the bare decoder, without an LM head (an embedding model's)"
    return None


def _refuse_other_head(d: dict, given: str) -> None:
    """A config whose `architectures` name only models that are no causal LM (LlamaForSequenceClassification,
    MistralModel) trains another head than the LM head zerocalc models: refused, naming the class, with
    the causal LM of the same decoder where it is shipped (which holds more: the LM head and its logits).
    Model types transformers does not implement are left to `_refuse_remote_code`."""
    classes = d.get("architectures")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        return
    heads = [_other_head(c) for c in classes]
    if None in heads:
        return
    known = _implemented_types()[1]
    if known and d.get("model_type") not in known:
        return
    names = _configmatch.match(d)[0]
    lm = (f"; --model {names[0]} answers its decoder as a causal LM, which holds more (the LM head and its "
          "logits)") if names else "; without \"architectures\" the file is estimated as a causal LM"
    raise ValueError(f"{given}: its architectures name {', '.join(classes)}, {heads[0]}: zerocalc models causal-LM "
                     f"training (the LM head and its logits), not that head{lm}")


def _nearest(near: str | None, diff: list[str], d: dict) -> str:
    """What to say of the nearest shipped model a config is not."""
    if near is None:
        return ""
    return (f"; it is not the shipped {near}, which differs in {_configmatch.describe(d, near, diff)}: if those "
            f"keys do not matter to you, --model {near} answers without torch")


def _text_model(d: dict) -> str:
    """What to say of a multimodal config whose text model is a shipped one (Gemma 3's Hub files: the
    text model and a vision tower, which AutoModelForCausalLM builds together)."""
    text = d.get("text_config")
    names = _configmatch.match(text)[0] if isinstance(text, dict) else []
    return (f"; its text model (text_config) is the shipped {names[0]}: --model {names[0]} answers that "
            "alone, without torch (the other towers not counted)") if names else ""


def _failure_file(d: dict) -> str | None:
    """Where a failed trace of `d` is kept (beside the trace cache, under its key and the tracer code's
    digest: another torch, transformers, TRACE_VERSION or zerocalc's tracer tries again), or None
    without the extra."""
    try:
        from zerocalc.hf import trace
        return os.path.join(trace.cache_dir(), f"{trace.cache_key(d)}-{trace.code_digest()[:12]}.failed")
    except ImportError:
        return None


def _at_a_terminal() -> bool:
    """Whether a person watches standard error: a trace not yet cached then says it has begun."""
    return sys.stderr.isatty()


def _traced(d: dict, label: str, given: str, nearest: str = "") -> ModelSpec:
    """The traced profile's ModelSpec. A config that fails to trace is kept as failed with the reason,
    not traced again on every call: the message says which file to delete to try again."""
    _refuse_remote_code(d, given)
    failed = _failure_file(d)
    if failed is None:
        raise ValueError(f"{given}: model_type {d.get('model_type')!r} is read from its own code, which needs "
                         f"the trace extra: {INSTALL}; or give --params P, or the shape flags {SHAPE_FLAGS}"
                         + nearest)
    retry = f"(kept in {failed}: delete it to trace again)"
    if os.path.exists(failed):
        with open(failed, encoding="utf-8", errors="replace") as f:
            reason = f.read().strip()
        raise ValueError(f"{given}: the trace of model_type {d.get('model_type')!r} failed when last "
                         f"traced: {reason} {retry}{nearest}")
    from zerocalc.hf import trace
    if _at_a_terminal() and not os.path.exists(trace.cache_path(d)):
        sys.stderr.write(f"tracing model_type {d.get('model_type')!r} from its code on fake tensors (seconds to "
                         f"minutes, once: kept in {trace.cache_dir()})...\n")
        sys.stderr.flush()
    try:
        p = trace.cached_trace(d, label)
    except trace.TraceExtraMissing:
        raise ValueError(f"{given}: tracing model_type {d.get('model_type')!r} needs the trace extra: {INSTALL}; "
                         f"or give --params P, or the shape flags {SHAPE_FLAGS}" + nearest)
    except ImportError as err:       # a package the model's own code needs
        raise ValueError(f"{given}: model_type {d.get('model_type')!r} is built by code that needs a package "
                         f"not installed here: {' '.join(str(err).split())}" + nearest)
    except Exception as err:     # whatever the model's own code raises on this config
        reason = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
        if "DataDependent" in type(err).__name__:     # torch's fake tensors hold no values to branch on
            reason = (f"{type(err).__name__}: its code branches on a tensor's value, which zerocalc's trace "
                      "on fake tensors cannot follow")
        os.makedirs(os.path.dirname(failed), exist_ok=True)
        with open(failed, "w", encoding="utf-8") as f:
            f.write(reason + "\n")
        raise ValueError(f"{given}: the trace of model_type {d.get('model_type')!r} failed: {reason} "
                         f"{retry}{nearest}")
    return from_profile(p, label)


def hf_config_spec(path: str, overrides: dict) -> tuple[ModelSpec, str | None]:
    """(the ModelSpec of a config.json or model directory, a note on how it was read). A config that
    is a shipped model by the keys that build it (`zerocalc.configmatch`) is that model, under its
    name, as --model NAME gives it; else one of the validator's families at its dimensions
    (`zerocalc.family`: GPT-2, Llama, Mistral), else traced."""
    d, file = read_config(path)
    label = f"{file} ({describe_overrides(overrides)})" if overrides else file
    if overrides:
        d = _override_config(d, overrides)
    d = _configmatch.canonical(d)
    _refuse_other_head(d, file)
    names, near, diff = _configmatch.match(d)
    if names:
        name = names[0]
        spec = preset_spec(name, {})
        record = _configmatch.records()[name]
        ignored = sorted(_configmatch.ignored(d, record))
        rescaled = _configmatch.rescaled(d, record)
        same = f", the same model as {', '.join(names[1:])}" if names[1:] else ""
        said = f"{file} is the shipped {name}{same} (the keys that build the model are equal" + \
            (f"; other values that change no tensor, operator or allocation: "
             f"{_configmatch.describe(d, name, rescaled, most=len(rescaled))}" if rescaled else "") + \
            (f"; ignored: {', '.join(ignored)})" if ignored else ")")
        return (replace(spec, name=label) if overrides else spec), said
    if _family.reads(d):
        return from_architecture(_family.from_config(d), label), None
    nearest = _nearest(near, diff, d) or _text_model(d)
    spec = _traced(d, label, file, nearest)
    said = f"{file} traced: it is not the shipped {near}, which differs in " \
        f"{_configmatch.describe(d, near, diff)}" if near else None
    return spec, said


def notes(spec: ModelSpec, setups, timed: bool = False) -> list[str]:
    """What the output should say about how the model was read: for a model read from its code, what
    its trace gave and, where formulas, the calibrated ratio or a Llama layer's operators stand in
    (`timed`: the step time is printed), which and why (`source["untraced"]`, `hf.trace._attempt`)."""
    p = spec.profile
    if p is None:
        return []
    stages = [s.stage for s in setups]
    out = []
    if _family.FAMILY not in p.source:
        untraced = p.source.get("untraced", {})

        def because(key: str, what: str) -> str:
            return f" ({what} could not be traced: {untraced[key]})" if key in untraced else ""
        if p.activations and any(s.param_bytes != 2 for s in setups):
            how = "the Llama formulas at its dimensions (its kept tensors are traced in bf16; this trains in fp32)"
        elif p.activations:
            how = ("the layers' and the head's kept tensors traced from its code (bf16/fp16; the loss's fp32 "
                   "tensors and checkpointing by the formulas)")
        elif p.moe_classes:
            how = (f"the Llama formulas with the {p.dims.get('experts_per_token')} routed experts' widths per token "
                   f"(balanced routing)") + because("activations", "its kept tensors")
        else:
            how = "the Llama formulas at its dimensions" + because("activations", "its kept tensors")
        if spec.frozen:
            how += ("; with frozen parameters: no gradients or optimizer state for them, less kept by frozen "
                    "linears and norms, and LoRA's inputs, dropout copies and x@A added (docs/lora.md)")
        reserved = "; ".join(dict.fromkeys(_reserved_note(spec, attention, untraced)
                                           for attention in dict.fromkeys(s.attention for s in setups)))
        line = (f"{spec.name}: {p.model_type} read from its code (parameters, module calls: exact); "
                f"activations: {how}; reserved: {reserved}")
        if timed and not p.steps:
            line += ("; step time: a Llama layer's operators and FLOPs at its dimensions"
                     + because("steps", "its own operators"))
        out.append(line)
    if spec.name in text_models():
        out.append(f"{spec.name}: the text model of {hub_repos()[spec.name]} alone; that checkpoint adds "
                   f"{text_models()[spec.name]}, not counted here: its config.json with --hf-config (the trace "
                   "extra) counts them")
    if p.moe_classes and any(int(s) == 3 for s in stages):
        out.append(f"stage 3: each {', '.join(p.moe_classes)} is one fetch unit, as "
                   f"deepspeed.utils.set_z3_leaf_modules(model, [{', '.join(p.moe_classes)}]) makes it "
                   "(needed to run at N > 1: experts that get no tokens would skip their hooks)")
    gib = max((held_after_forward_elements(spec, s) * s.param_bytes for s in setups if int(s.stage) == 3),
              default=0) / 2**30
    if gib >= 1:    # (`ModelSpec.viewed_params`)
        classes = ", ".join(sorted({m.cls for m in p.modules if m.views}))
        out.append(f"stage 3: autograd keeps views of each {classes}'s gathered parameters for backward, which "
                   f"DeepSpeed's release cannot free: up to {gib:.1f} GiB held until backward, counted in buffers; "
                   "with --activation-checkpointing a layer's forward keeps none")
    return out


def _reserved_note(spec: ModelSpec, attention: str, untraced: dict) -> str:
    """How reserved memory is predicted for a model read from its code under `attention`: its traced
    stream simulated, else the calibrated ratio and why (`profile.traced_under`)."""
    p = spec.profile
    stream = _profile.traced_under(p, attention)[1]
    # frozen parameters: the variants of PEFT's model that could not be recorded (`cli._streamed`)
    failed = "; ".join(f"{key.split(' ', 1)[1]}: {reason}" for key, reason in untraced.items()
                       if key.startswith("adapted "))
    if stream and (not spec.frozen or "trained" in stream):
        text = "its traced allocation stream through the allocator simulation"
        return text + (f"; the calibrated ratio where a variant could not be recorded from PEFT's model ({failed})"
                       if failed else "")
    if spec.frozen and failed:
        return f"the calibrated ratio (the stream of its own trained tensors could not be recorded from PEFT's model: {failed})"
    if spec.frozen:
        return ("the calibrated ratio (the stream of its own trained tensors is recorded from PEFT's model: "
                f"{INSTALL}; stage 3 also needs deepspeed)")
    own = (getattr(p, "stream", None) or {}).get("attention")
    if own is None:
        why = f": {untraced['stream']}" if "stream" in untraced else ""
        return f"the calibrated ratio (its allocation stream could not be traced{why})"
    if attention in untraced:
        return f"the calibrated ratio under {attention} (its stream under {attention} could not be traced: {untraced[attention]})"
    return f"the calibrated ratio under {attention} (its stream is traced under {own} attention only)"


def listing() -> list[dict]:
    """One row per --model name, from its shipped profile; source "family" where the validator's family
    is that model at its dimensions (its stream and activations are the family's), else "profile"; the
    Hub repository its values were read from ("" for the case study's GPT)."""
    rows = []
    for name in names():
        p = _profile.shipped_profile(name)
        rows.append({"name": name, "model_type": p.model_type, "num_params": p.num_params,
                     "num_layers": p.dims["num_layers"], "hidden_size": p.dims["hidden_size"],
                     "num_experts": p.dims.get("num_experts", 0), "experts_per_token": p.dims.get("experts_per_token", 0),
                     "source": "family" if _family.FAMILY in _shipped_spec(name).profile.source else "profile",
                     "hub_id": hub_repos().get(name, "")})
    return rows


def config_of(model: str | None, hf_config: str | None, overrides: dict) -> dict | None:
    """The config.json contents the model is built from, with the overrides: the file given, or a
    shipped model's (`zerocalc/hf/configs/`); None for neither (--params, the shape flags)."""
    from zerocalc.hf.ship import configs
    if hf_config is not None:
        d = read_config(hf_config)[0]
    elif model is not None and model in configs():
        with open(configs()[model]) as f:
            d = json.load(f)
    else:
        return None
    return _override_config(d, overrides) if overrides else d


def refuse_quantized_base(hf_config: str) -> None:
    """ValueError where a config.json's base is quantized into layers of its own (QLoRA's bitsandbytes
    4/8-bit, GPTQ, AWQ: not modelled); DeepSeek's fp8 and GPT-OSS's MXFP4 are dequantized to train."""
    d, file = read_config(hf_config)
    if d.get("quantization_config") and _configmatch.why_ignored("quantization_config", d) is None:
        method = d["quantization_config"].get("quant_method", "") if isinstance(d["quantization_config"], dict) else ""
        raise ValueError(f"{file}: quantization_config {method!r}: a quantized base (QLoRA, bitsandbytes 4/8-bit) "
                         "is not modelled; give the unquantized config")


def profile_for(model: str | None, hf_config: str | None, overrides: dict, spec: ModelSpec):
    """The profile LoRA and --freeze are computed from: a shipped model's profile as shipped (with its
    traced activations), a config.json's shipped one, else the model's own (traced, or its family's).
    ValueError where the model has no modules to name (--params). A quantized base is refused before
    the model is read (`refuse_quantized_base`, which the CLI calls first)."""
    if model is not None and not overrides and model in _profile.shipped():
        return _profile.shipped_profile(model)
    if hf_config is not None and not overrides:
        names, _, _ = _configmatch.match(read_config(hf_config)[0])
        if names:
            return _profile.shipped_profile(names[0])
    if spec.profile is not None:
        return spec.profile
    raise ValueError("LoRA and --freeze need the model's modules: give --model NAME or --hf-config config.json "
                     "(not --params or the shape flags)")
