"""Regenerate the shipped profiles: `python -m zerocalc.hf.ship [name ...]`.

Each `zerocalc/hf/configs/<name>.json` holds the published config.json values of one model (the
Hugging Face hub's file, the fields that shape the model); it is traced (`zerocalc.hf.trace`) and
written to `zerocalc/profiles/<name>.json`, which `--model <name>` reads without torch. Then every
profile's match record (`match_record`) is written to `zerocalc/hf/matching.json`, by which a
config.json is recognised as a shipped model without torch (`zerocalc.configmatch`), and the
model types transformers implements, by which a remote-code model is told so without torch.
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


def _defaults(kind: str) -> dict:
    """The keyword defaults of the model type's config class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    params = inspect.signature(CONFIG_MAPPING[kind].__init__).parameters
    return {k: p.default for k, p in params.items()
            if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD}


def match_record(d: dict) -> dict:
    """What a config.json may hold and still be the model of config `d` (`configmatch.differences`):
    accept: per key, the values that leave transformers' config of `d` unchanged when set in `d`
    (the value of `d`, the one transformers resolves it to, the class default, null), each tried;
    required: the keys of `d` whose absence changes it (their default differs). Keys zerocalc ignores
    whatever the model are left out."""
    base = resolved(d)
    if base is None:
        raise ValueError(f"transformers refuses the shipped config of model_type {d.get('model_type')!r}")
    defaults = _defaults(d["model_type"])
    accept, required = {}, []
    for key in sorted(set(d) | set(base) | set(defaults)):
        if key in configmatch.IGNORED or key == "model_type":
            continue
        tried = [d[key]] if key in d else []
        for v in (base.get(key), defaults.get(key), None):
            if key in base or key in defaults or v is None:
                v = json.loads(json.dumps(v, default=str))
                if not any(configmatch.same(v, t) for t in tried) and resolved({**d, key: v}) == base:
                    tried.append(v)
        if tried:
            accept[key] = tried
        if key in d and resolved({k: v for k, v in d.items() if k != key}) != base:
            required.append(key)
    return {"model_type": d["model_type"], "config": d, "accept": accept, "required": required}


def write_matching() -> None:
    """zerocalc/hf/matching.json: every shipped config's match record, and the model types this
    transformers implements."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    transformers.logging.set_verbosity_error()    # the tried values' warnings (a token id out of range)
    out = {"transformers": transformers.__version__, "model_types": sorted(CONFIG_MAPPING.keys()), "profiles": {}}
    for name, path in configs().items():
        with open(path) as f:
            out["profiles"][name] = match_record(json.load(f))
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
