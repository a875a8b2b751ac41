"""Jobs: one training configuration each, as a flat dict of zerocalc Setup fields plus the
architecture. The same dict drives the worker (torch side) and the prediction (zerocalc side)."""
import hashlib
import itertools
import json
from dataclasses import fields
from typing import get_args

from validate import hf_models
from zerocalc import arch as _arch
from zerocalc.model import from_architecture
from zerocalc.rows_schema import ARCH_FIELDS, SETUP_FIELDS  # noqa: F401  (a job's fields are a row's columns)
from zerocalc.states import buffer_element_bytes
from zerocalc.training import OPTIMIZERS, Setup, Stage

DS_OPTIMIZER = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "sgd-momentum": "SGD"}

DEFAULTS = {f.name: f.default for f in fields(Setup) if f.name in SETUP_FIELDS}
DEFAULTS.update(optimizer="adamw", stage=0, seq_len=128)


def make_job(arch: _arch.Architecture, nproc: int, **setup) -> dict:
    job = dict(DEFAULTS)
    job.update(setup)
    job["nproc"] = nproc
    job["arch"] = arch.as_dict()
    job["key"] = job_key(job)
    return job


def job_key(job: dict) -> str:
    """A stable name for a configuration: what resume matches on. Fields at their default are left
    out of the hash, so adding a field to Setup does not rename every configuration."""
    payload = {k: v for k, v in job.items()
               if k not in ("key", "z3_leaf_modules") and not (k in DEFAULTS and DEFAULTS[k] == v)}
    digest = hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]
    a = job["arch"]
    family = a["family"] + ("-trainer" if job.get("path") == "trainer" else "") + \
        (f"-lora{job['lora'].get('r', 8)}" if job.get("lora") else "") + ("-frozen" if job.get("freeze") else "")
    fake = ("fake" + (f"-rank{job['fake_rank']}" if job.get("fake_rank") else "")) if job.get("fake_world") else ""
    nodes = f"-nodes{job['nodes']}" if job.get("nodes", 1) > 1 else ""
    return (f"{family}-h{a['hidden_size']}-l{a['num_layers']}-s{job['stage']}-{job['dtype']}-n{job['nproc']}{fake}{nodes}"
            f"-b{job['micro_batch']}x{job['seq_len']}-gas{job['gas']}-{digest}")


def make_hf_job(entry: dict, nproc: int, **setup) -> dict:
    """A job for any HF causal LM: `entry` = {"config": a name under validate/hf_configs/ or a dict,
    "overrides": {...}}. `setup` may hold path="trainer" with ds_config="<name under hf_configs/ds>": the
    Setup fields then come from that config's "auto" values as HF Trainer fills them
    (`hf_models.resolve_auto`); a field the matrix also gives must agree. At stage 3 the model is built
    under zero.Init (as HF's integration does) unless the matrix says zero_init false."""
    name, cfg = hf_models.load_config(entry["config"], entry.get("overrides"))
    arch = hf_models.key_dims(cfg)
    setup = dict(setup)
    path = setup.pop("path", "engine")
    if path not in hf_models.PATHS:
        raise ValueError(f"path must be one of {', '.join(hf_models.PATHS)}, got {path!r}")
    job = dict(DEFAULTS)
    if path == "trainer":
        ds_name = setup.pop("ds_config")
        resolved = hf_models.resolve_auto(hf_models.load_ds_config(ds_name), arch["hidden_size"])
        clash = {k: (setup[k], v) for k, v in resolved.items() if k in setup and setup[k] != v}
        if clash:
            raise ValueError(f"{name}: the matrix and ds_config {ds_name} disagree on {clash}")
        job.update(resolved)
        job["ds_config"] = ds_name
    elif setup.get("stage") == 3:
        job["zero_init"] = True
    job.update(setup)
    job.update(path=path, nproc=nproc, arch=arch, hf={"name": name, "config": cfg, **hf_models.moe_dims(cfg)})
    if job.get("lora") is not None:
        hf_models.lora_of(job)   # a LoraConfig zerocalc cannot read is refused before any launch
    job["key"] = job_key(job)
    return job


def to_zerocalc(job: dict):
    """(ModelSpec, Setup) zerocalc predicts for this job. An HF job's ModelSpec is what its run recorded
    (`hf_models.model_spec`): None before that."""
    if job.get("hf"):
        kwargs = {k: job[k] for k in SETUP_FIELDS if k in job}
        setup = Setup(stage=Stage(job["stage"]), dp=job["nproc"], optimizer=OPTIMIZERS[job["optimizer"]],
                      hf_trainer=job.get("path") == "trainer", **kwargs)   # the path says it, not a field of the job
        return hf_models.model_spec(job, buffer_element_bytes(setup)), setup
    spec = from_architecture(_arch.Architecture(**job["arch"]))
    kwargs = {k: job[k] for k in SETUP_FIELDS if k in job}
    setup = Setup(stage=Stage(job["stage"]), dp=job["nproc"], optimizer=OPTIMIZERS[job["optimizer"]], **kwargs)
    return spec, setup


def steps_override(text: str | None) -> tuple[int, int, int] | None:
    """VALIDATE_STEPS="W,P,T": the worker's warm-up, phase and timed steps instead of its own
    (`validate.worker`); None where unset or empty. Raises ValueError saying what to give, which the
    runner checks before any launch."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[2]) < 1:
        raise ValueError(f"VALIDATE_STEPS={text!r}: give three whole numbers W,P,T (warm-up, phase and timed "
                         "steps, T at least 1), e.g. 2,1,1, or unset it")
    return tuple(int(p) for p in parts)


def with_fake_world(job: dict, rank: int = 0) -> dict:
    """The job run as rank `rank` of its nproc ranks in one process (torch's fake process group): its
    own key, so that a fake row never resumes or stands for a real one, nor one rank's for another's."""
    out = {**job, "fake_world": True}
    if rank:
        out["fake_rank"] = rank
    out["key"] = job_key(out)
    return out


def with_nodes(job: dict, nodes: int) -> dict:
    """The job with its N ranks over `nodes` nodes (`validate run --hostfile`): its own key, since its
    collectives cross the network where the one-node job's stay on NVLink; the same job on one node."""
    if nodes < 2:
        return job
    out = {**job, "nodes": nodes}
    out["key"] = job_key(out)
    return out


def to_worker(job: dict) -> dict:
    """What the worker needs: the job plus DeepSpeed's optimizer spelling."""
    out = dict(job)
    out["ds_optimizer"] = DS_OPTIMIZER[job["optimizer"]]
    out["optimizer_params"] = {"momentum": 0.9} if job["optimizer"] == "sgd-momentum" else {}
    return out


def grid(arches: list[_arch.Architecture], nproc: int, **axes) -> list[dict]:
    """Cartesian product of the axes (each a list) for every architecture."""
    names = list(axes)
    jobs = []
    for a in arches:
        for values in itertools.product(*(axes[n] for n in names)):
            jobs.append(make_job(a, nproc, **dict(zip(names, values))))
    return jobs


MATRIX_KEYS = ("nproc", "architectures", "axes", "jobs", "about", "hf_models", "hf_axes")
HF_JOB_KEYS = ("path", "ds_config", "timed_steps", "shared_gpu",   # an HF job's own fields
               "lora", "freeze")   # PEFT LoraConfig keywords; module patterns frozen (`hf_models.apply_adapters`)
# How the worker runs a job, beside what zerocalc predicts from: the caching allocator capped at
# this many bytes (a smaller card emulated), the parameters made zero without the initialisers, and
# ds_config keys zerocalc does not take as Setup fields, merged block by block into the worker's ds_config
# ({"zero_optimization": {"allgather_bucket_size": 1000}}): zerocalc predicts without them, so a row shows
# whether such a key moves anything (the evidence for dskeys' classes).
RUN_KEYS = ("allocator_capacity_bytes", "zero_weights", "ds_extra")
JOB_KEYS = tuple(sorted(set(DEFAULTS) | {"stage", "optimizer", "repeat"} | set(RUN_KEYS)))   # an axis or a job's field
ARCH_DEFAULTS = dict(family="seed-gpt", tie_embeddings=False)              # num_kv_heads, ffn: from the others


class MatrixError(ValueError):
    """A matrix file that cannot be run as written: one line naming the file, the key and what is valid."""


def _types(field_type) -> tuple:
    return tuple(get_args(field_type) or (field_type,))   # `int | None` -> (int, NoneType)


# What a matrix may give each key (a JSON number of the wrong kind would reach the worker, or change
# nothing but the key): a Setup field's own type, the architecture's, and the keys the runner adds.
VALUE_TYPES = {f.name: _types(f.type) for f in fields(Setup) if f.name in SETUP_FIELDS}
VALUE_TYPES.update({f.name: _types(f.type) for f in fields(_arch.Architecture)}, stage=(int,), optimizer=(str,),
                   repeat=(int,), nproc=(int,), allocator_capacity_bytes=(int,), zero_weights=(bool,), ds_extra=(dict,), path=(str,),
                   ds_config=(str,), timed_steps=(int,), shared_gpu=(int,), lora=(dict, type(None)), freeze=(list,),
                   seq_len=(int,))   # zerocalc may go without one; a run may not
_TYPE_WORDS = {int: "a whole number", bool: "true or false", str: "a string", float: "a number", dict: "an object",
               list: "a list", type(None): "null"}


def _check_value(path: str, where: str, name: str, value) -> None:
    kinds = VALUE_TYPES.get(name, ())
    ok = any(isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds)
    if kinds and not ok:
        raise MatrixError(f"{path}: {where}: {name} must be {' or '.join(_TYPE_WORDS[k] for k in kinds)}, "
                          f"got {json.dumps(value)}")


def _check_axes(path: str, where: str, axes: dict) -> None:
    for name, values in axes.items():
        if not isinstance(values, list) or not values:
            raise MatrixError(f"{path}: axis {name!r} of {where} must be a non-empty list, got {json.dumps(values)}")
        for v in values:
            _check_value(path, where, name, v)


def _check_keys(path: str, where: str, given, valid) -> None:
    if not isinstance(given, dict):
        raise MatrixError(f"{path}: {where} must be a JSON object, got {type(given).__name__}")
    unknown = [k for k in given if k not in valid]
    if unknown:
        raise MatrixError(f"{path}: unknown key {unknown[0]!r} in {where}; valid keys: {', '.join(valid)}")


def _architecture(path: str, where: str, a) -> _arch.Architecture:
    _check_keys(path, where, a, ARCH_FIELDS)
    missing = [k for k in ("vocab_size", "hidden_size", "num_layers", "num_heads") if k not in a]
    if missing:
        raise MatrixError(f"{path}: {where} lacks {missing[0]!r}")
    for name, value in a.items():
        _check_value(path, where, name, value)
    fields_ = {**ARCH_DEFAULTS, "num_kv_heads": a["num_heads"], "ffn_hidden_size": 4 * a["hidden_size"], **a}
    try:
        return _arch.Architecture(**fields_)
    except (TypeError, ValueError) as err:
        raise MatrixError(f"{path}: {where}: {err}")


def _hf_job(path: str, where: str, entry, nproc: int, setup: dict) -> dict:
    _check_keys(path, where + ".hf", entry, ("config", "overrides"))
    try:
        return make_hf_job(entry, nproc, **setup)
    except (TypeError, ValueError, KeyError) as err:
        raise MatrixError(f"{path}: {where}: {err}")


def _hf_jobs(path: str, spec: dict, nproc: int) -> list[dict]:
    """HF configs: {"hf_models": [{"config": name or dict, "overrides": {...}}], "hf_axes": {...}}, the
    product of the axes per model; hf_axes may be a list of such dicts, each product in turn (one per path)."""
    hf_axes = spec.get("hf_axes", {})
    jobs = []
    for i, entry in enumerate(spec.get("hf_models", [])):
        for axes in hf_axes if isinstance(hf_axes, list) else [hf_axes]:
            _check_keys(path, "hf_axes", axes, JOB_KEYS + HF_JOB_KEYS)
            _check_axes(path, "hf_axes", axes)
            names = list(axes)
            for values in itertools.product(*(axes[n] for n in names)):
                jobs.append(_hf_job(path, f"hf_models[{i}]", entry, nproc, dict(zip(names, values))))
    return jobs


def load_matrix(path: str) -> list[dict]:
    """A matrix file: {"nproc": 2, "architectures": [{...}], "axes": {"stage": [0,1,2,3], ...},
    "jobs": [{...}, ...]} — the product of the axes per architecture, plus explicit jobs. A job may carry
    "repeat": n, which only changes its key: one configuration measured n times in one sweep. Every key
    is checked (a misspelt axis would silently run the default): MatrixError names the first unknown
    one and the valid ones."""
    try:
        with open(path) as f:
            spec = json.load(f, object_pairs_hook=_no_repeated_key)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise MatrixError(f"{path}: not a readable JSON matrix ({err})")
    except RecursionError:
        raise MatrixError(f"{path}: not a readable JSON matrix (nested too deeply)")
    _check_keys(path, "the matrix", spec, MATRIX_KEYS)
    nproc = spec.get("nproc", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise MatrixError(f"{path}: nproc must be a positive integer, got {nproc!r}")
    axes = spec.get("axes", {})
    _check_keys(path, "axes", axes, JOB_KEYS)
    _check_axes(path, "axes", axes)
    for name in ("architectures", "jobs"):
        if not isinstance(spec.get(name, []), list):
            raise MatrixError(f"{path}: {name} must be a list")
    arches = [_architecture(path, f"architectures[{i}]", a) for i, a in enumerate(spec.get("architectures", []))]
    jobs = grid(arches, nproc, **axes) if arches else []
    jobs += _hf_jobs(path, spec, nproc)
    for i, extra in enumerate(spec.get("jobs", [])):
        _check_keys(path, f"jobs[{i}]", extra, JOB_KEYS + HF_JOB_KEYS + ("arch", "hf", "nproc"))
        for name, value in extra.items():
            _check_value(path, f"jobs[{i}]", name, value)
        extra = dict(extra)
        if "hf" in extra:
            jobs.append(_hf_job(path, f"jobs[{i}]", extra.pop("hf"), extra.pop("nproc", nproc), extra))
            continue
        if "arch" not in extra:
            raise MatrixError(f"{path}: jobs[{i}] lacks 'arch'")
        arch = _architecture(path, f"jobs[{i}].arch", extra.pop("arch"))
        jobs.append(make_job(arch, extra.pop("nproc", nproc), **extra))
    if not jobs:
        raise MatrixError(f"{path}: no jobs: give architectures (with axes), jobs or hf_models")
    return jobs


def _no_repeated_key(pairs: list) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of a repeated key silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out
