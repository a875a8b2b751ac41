"""Regenerate the shipped profiles: `python -m zerocalc.hf.ship [name ...]`.

Each `zerocalc/hf/configs/<name>.json` holds the published config.json values of one model (the
Hugging Face hub's file, the fields that shape the model); it is traced (`zerocalc.hf.trace`) and
written to `zerocalc/profiles/<name>.json`, which `--model <name>` reads without torch. Then every
profile's match record (`match_record`) is written to `zerocalc/hf/matching.json`, by which a
config.json is recognised as a shipped model without torch (`zerocalc.configmatch`), and the
model types transformers implements, by which a remote-code model is told so without torch. The
seed's GPT has no config.json: `python -m zerocalc.hf.familyprofile` writes its profile.
"""
import inspect
import json
import os
import sys
import time

from zerocalc import configmatch
from zerocalc import profile as P
from zerocalc.hf import trace as T

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def configs() -> dict[str, str]:
    return {f[:-5]: os.path.join(CONFIGS, f) for f in sorted(os.listdir(CONFIGS)) if f.endswith(".json")}


def resolved(d: dict) -> dict | None:
    """The config transformers builds from `d`, as JSON (its `to_dict`), without the keys zerocalc
    ignores whatever the model (`configmatch.IGNORED`); None if transformers refuses `d`."""
    try:
        out = T.hf_config(d).to_dict()
    except Exception:      # any value transformers refuses: not equivalent
        return None
    return json.loads(json.dumps({k: v for k, v in out.items() if k not in configmatch.IGNORED}, default=str))


def saved(d: dict) -> dict | None:
    """The config.json transformers writes for config `d` (save_pretrained's: the keys that differ from the
    class defaults), as JSON; None if transformers refuses `d`."""
    try:
        return json.loads(T.hf_config(d).to_json_string(use_diff=True))
    except Exception:
        return None


def _with_saved_form(d: dict, base: dict, accept: dict, required: list) -> tuple[dict, list]:
    """`accept` and `required` made to take the file transformers itself writes for `d`, as a fine-tune
    saved today carries it, where transformers reads that file as `d`: transformers 5 folds rope_scaling,
    rope_theta and partial_rotary_factor into rope_parameters and writes layer_types out. Its values are
    accepted, and a required key it lacks is met by any of the keys that carry it there (an entry
    [key, carrier, ...]): those without which the file is another config until the key is given back."""
    s = saved(d)
    if s is None or resolved(s) != base:
        return accept, required
    accept = {k: list(v) for k, v in accept.items()}
    for k, v in s.items():
        if k == "model_type" or k in configmatch.IGNORED:
            continue
        if not any(configmatch.same(v, a) for a in accept.get(k, ())):
            accept.setdefault(k, []).append(v)
    values_only = {k: v for k, v in d.items() if k not in s and k in configmatch.IGNORED}   # rope_theta

    def without(j):
        return {x: y for x, y in s.items() if x != j}
    # the keys the file adds without which it is another config: each may carry a required key it lacks
    needed = [j for j in sorted(set(s) - set(d)) if resolved(without(j)) != base]
    out = []
    for k in required:
        carriers = [] if k in s else [j for j in needed if resolved({**without(j), **values_only, k: d[k]}) == base]
        out.append([k, *carriers] if carriers else k)
    return accept, out


def _defaults(kind: str) -> dict:
    """The keyword defaults of the model type's config class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    params = inspect.signature(CONFIG_MAPPING[kind].__init__).parameters
    return {k: p.default for k, p in params.items()
            if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD}


# Keys published config.json files carry that a config class may not take as a parameter: tried too.
HUB_KEYS = ("rope_scaling", "attention_bias", "mlp_bias", "head_dim", "attention_dropout", "sliding_window",
            "use_sliding_window", "max_window_layers", "sliding_window_pattern", "rope_local_base_freq",
            "pretraining_tp", "embd_pdrop", "resid_pdrop", "attn_pdrop", "output_router_logits",
            "original_max_position_embeddings", "partial_rotary_factor", "layer_types", "use_mrope", "qkv_bias", "sliding_window_size",
            "aux_loss_alpha", "ep_size", "scoring_func", "seq_aux", "output_router_logits")
# Values tried on a key to find it inert (its value changes nothing but itself).
_PROBES = (None, False, True, 0, 1, 2, 6, 4096, 0.1, "x")


def model_reads(d: dict) -> set[str] | None:
    """The config attributes the model's own code reads while it is built and runs one forward (on fake
    tensors), with SDPA and with eager attention, through the config's attribute map too (gpt2's
    hidden_size is n_embd). The generation config's copy of the whole config (`from_model_config`,
    which keeps only generation settings) is left out; None if anything else reads the config whole
    (its `__dict__` or `to_dict`): then no key can be said unread."""
    import torch
    from unittest import mock
    from transformers import GenerationConfig
    reads = set()
    for attention in (None, "eager"):
        cfg = T.hf_config(d)
        if attention:
            cfg._attn_implementation = attention
        cls = type(cfg)

        class Spy(cls):
            def __getattribute__(self, name):
                reads.add(name)
                if not name.startswith("__") and name != "attribute_map":
                    reads.add(cls.__getattribute__(self, "attribute_map").get(name, name))
                return cls.__getattribute__(self, name)
        Spy.__name__ = Spy.__qualname__ = cls.__name__     # AutoModelForCausalLM looks the class up by name
        cfg.__class__ = Spy
        with mock.patch.object(GenerationConfig, "from_model_config", classmethod(lambda c, config: c())):
            model, mode = T.build(cfg)
        with mode:
            model(input_ids=torch.zeros(1, T.TRACE_TOKENS, dtype=torch.long), use_cache=False)
    return None if reads & {"__dict__", "to_dict"} else reads


def config_keywords(kind: str) -> list[str]:
    """The keys the model type's config class takes by name, so that one may change other attributes:
    its fields (`__init__`'s parameters), its attribute map's names both ways, and the keyword
    arguments its own and its bases' `__post_init__` and rope conversion read (legacy names, rope's
    keys). Any other key of a config.json transformers stores as an attribute and nothing else."""
    import re
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cls = CONFIG_MAPPING[kind]
    names = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    names |= set(cls.attribute_map) | set(cls.attribute_map.values())
    for klass in cls.__mro__:
        for method in ("__post_init__", "__init__", "convert_rope_params_to_dict"):
            f = klass.__dict__.get(method)
            try:
                src = inspect.getsource(f) if f else ""
            except (OSError, TypeError):       # a generated __init__: its parameters are above
                continue
            names |= set(re.findall(r"kwargs(?:\.(?:pop|get|setdefault)\(|\[)\s*[\"']([^\"']+)[\"']", src))
            names |= set(re.findall(r"[\"']([^\"']+)[\"']\s+in\s+kwargs", src))
    return sorted(names)


def config_aliases(d: dict, keywords: list[str]) -> dict[str, str]:
    """{another name: the field it sets} of config `d`'s model type: its attribute map (BLOOM's
    `num_attention_heads` is `n_head`) and the legacy keywords among `keywords` (`config_keywords`) found,
    by setting each to a probe value, to set exactly one field (BLOOM's `n_embed` is `hidden_size`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cls = CONFIG_MAPPING[d["model_type"]]
    out = dict(cls.attribute_map)
    fields = set(inspect.signature(cls.__init__).parameters)
    base = resolved(d)
    for key in sorted(set(keywords) - fields - set(out)):
        r = resolved({**d, key: 12347})
        hit = [f for f, v in (r or {}).items() if v == 12347 and base.get(f) != 12347 and f != key]
        if len(hit) == 1:
            out[key] = hit[0]
    return out


def match_record(d: dict) -> dict:
    """What a config.json may hold and still be the model of config `d` (`configmatch.differences`):
    accept: per key, the values that leave transformers' config of `d` unchanged when set in `d` (the
    value of `d`, the one transformers resolves it to, the class default, null), each tried, or that
    change only that key where the model never reads it; inert: the keys the model never reads whose
    every probed value changes nothing but themselves (any value then); required: the keys of `d`
    whose absence changes the config (but for a key the model never reads); reads: what the model's
    code reads (`model_reads`, None: all), by which `configmatch` finds a key no record names unread.
    Keys zerocalc ignores whatever the model are left out."""
    base = resolved(d)
    if base is None:
        raise ValueError(f"transformers refuses the shipped config of model_type {d.get('model_type')!r}")
    defaults = _defaults(d["model_type"])
    seen = model_reads(d)
    keys = set(d) | set(base) | set(defaults) | set(HUB_KEYS)
    reads = seen if seen is not None else keys      # read whole: every key may be read
    accept, required, inert = {}, [], []
    for key in sorted(keys):
        if key in configmatch.IGNORED or key == "model_type":
            continue

        def same_model(r) -> bool:     # transformers' config r builds the model of `d`
            return r is not None and (r == base or (key not in reads and {k: x for k, x in r.items() if k != key}
                                                    == {k: x for k, x in base.items() if k != key}))

        def equivalent(v) -> bool:
            return same_model(resolved({**d, key: v}))
        if key not in reads and key not in d and all(equivalent(v) for v in _PROBES):
            inert.append(key)
            continue
        tried = [d[key]] if key in d else []
        for v in (base.get(key), defaults.get(key), None, *(_PROBES if key not in reads else ())):
            v = json.loads(json.dumps(v, default=str))
            if not any(configmatch.same(v, t) for t in tried) and equivalent(v):
                tried.append(v)
        if tried:
            accept[key] = tried
        if key in d and not same_model(resolved({k: v for k, v in d.items() if k != key})):
            required.append(key)
    accept, required = _with_saved_form(d, base, accept, required)
    return {"model_type": d["model_type"], "config": d, "accept": accept, "required": required, "inert": inert,
            "reads": sorted(r for r in seen if not r.startswith("__")) if seen is not None else None}


def write_matching() -> None:
    """zerocalc/hf/matching.json: every shipped config's match record, the keys each model type's config
    class takes by name (`config_keywords`) and their other names (`config_aliases`), and the model types
    this transformers implements."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    transformers.logging.set_verbosity_error()    # the tried values' warnings (a token id out of range)
    out = {"transformers": transformers.__version__, "model_types": sorted(CONFIG_MAPPING.keys()), "profiles": {},
           "keywords": {}, "aliases": {}}
    for name, path in configs().items():
        with open(path) as f:
            out["profiles"][name] = record = match_record(json.load(f))
        kind = record["model_type"]
        if kind not in out["keywords"]:      # once per model type, from its first config
            out["keywords"][kind] = config_keywords(kind)
            out["aliases"][kind] = config_aliases(record["config"], out["keywords"][kind])
        print(f"{name:24s} {len(record['accept']):3d} keys accepted, reads "
              f"{'all' if record['reads'] is None else len(record['reads'])}", flush=True)
    tmp = configmatch.RECORDS + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    os.replace(tmp, configmatch.RECORDS)


def main(names=None) -> None:
    os.makedirs(P.SHIPPED_DIR, exist_ok=True)
    todo = configs()
    for name in names or todo:
        t0 = time.perf_counter()
        with open(todo[name]) as f:
            d = json.load(f)
        p = T.trace(d, name)
        P.save(p, os.path.join(P.SHIPPED_DIR, name + ".json"))
        print(f"{name:20s} {p.model_type:12s} {p.num_params:>16,} {time.perf_counter() - t0:6.1f} s", flush=True)
    write_matching()


if __name__ == "__main__":
    if sys.argv[1:] == ["--matching"]:      # the match records alone (no tracing)
        write_matching()
    else:
        main(sys.argv[1:])
