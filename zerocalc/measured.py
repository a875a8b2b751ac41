"""Measured rows, a user's own or the validator's (`python -m validate run`), read with the csv module:
each row becomes what zerocalc predicts from (the model, the setup, the hardware) beside what was
measured. `zerocalc calibrate` fits on them and `zerocalc report` judges the model by them.

A row names its model by `model` (a --model name), `hf_config` (a config.json's path, or its JSON as
the validator writes it) or the architecture's columns (family, vocab_size, hidden_size, num_layers,
num_heads, ...); its setup by `nproc` (or `dp`), `stage` and any Setup field (dtype, micro_batch,
seq_len, gas, ...; the rest at DeepSpeed's defaults), `nodes` where the job spanned nodes; and its
measurements by `measured_step_s` (seconds per optimizer step) and, where taken, the validator's
other `measured_*` columns. docs/your-cluster.md lists the columns.
"""
import csv
import json
import math
import os
import statistics
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from zerocalc import arch as _arch
from zerocalc.hardware import Hardware
from zerocalc.inputs import InputError
from zerocalc.model import ModelSpec, from_architecture, from_profile
from zerocalc.training import OPTIMIZERS, Setup, Stage, validate_setup

ARCH_REQUIRED = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads")
SETUP_COLUMNS = tuple(f.name for f in fields(Setup) if f.name not in ("extra", "optimizer", "stage", "dp"))
# What was measured, by column: seconds, bytes, rates; every one optional but one of the first and
# the allocated/reserved pair (what calibrate fits on).
TIME_COLUMNS = ("measured_forward_s", "measured_backward_s", "measured_step_phase_s", "measured_step_s")
MEMORY_COLUMNS = ("measured_peak_allocated_bytes", "measured_peak_reserved_bytes", "measured_base_allocated_bytes",
                  "measured_device_overhead_bytes", "measured_matmul_tflops", "measured_launch_us", "host_launch_us")
CLEAN_BASE_BYTES = 2**28   # a row whose job started with this much left by an earlier engine is not clean


class RowsError(InputError):
    """Rows zerocalc cannot read: one line naming the file, the row and the column."""


@dataclass(frozen=True)
class Measured:
    where: str                    # "file:line"
    key: str                      # the row's key, else where
    model: ModelSpec
    setup: Setup
    hardware: Hardware
    values: dict                  # the measured_* columns present, as floats
    timed: bool                   # whole optimizer steps timed as training runs them
    host_launch_s: float | None   # the host's launch cost during its steps (per-step probes), if taken
    host_probe_s: float | None    # any probe of it (per-step, before the steps, or the user's)

    def get(self, name: str) -> float | None:
        return self.values.get(name)

    @property
    def inter_node(self) -> bool:
        return self.setup.dp > self.hardware.gpus_per_node


def read_csv(path: str) -> tuple[list[str], list[dict]]:
    """(the header, one dict per row with "_where": "file:line"); RowsError for a file that is not a CSV."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise RowsError(f"{path}: empty, no header line")
            rows = []
            for i, values in enumerate(reader, start=2):
                if not any(v.strip() for v in values):
                    continue
                if len(values) != len(header):
                    raise RowsError(f"{path}:{i}: {len(values)} fields where the header has {len(header)}")
                rows.append({**dict(zip(header, values)), "_where": f"{path}:{i}"})
    except OSError as err:
        raise RowsError(f"{path}: cannot read it ({err.strerror or err})")
    except (UnicodeDecodeError, csv.Error) as err:
        raise RowsError(f"{path}: not a CSV file ({err})")
    return header, rows


def check_header(path: str, header: list[str]) -> None:
    """A header that names a model, a setup and something measured, else RowsError saying what lacks."""
    cols = set(header)
    if not ({"model", "hf_config"} & cols or set(ARCH_REQUIRED) <= cols):
        raise RowsError(f"{path}: no model column: give `model` (a --model name), `hf_config` or the architecture's "
                        f"{', '.join(ARCH_REQUIRED)} (docs/your-cluster.md)")
    for need in (("nproc", "dp"), ("stage",)):
        if not set(need) & cols:
            raise RowsError(f"{path}: no `{need[0]}` column" + (" (or `dp`): the data-parallel ranks N" if len(need) > 1
                                                                 else ": the ZeRO stage, 0-3"))
    if not {"measured_step_s", "measured_peak_allocated_bytes"} & cols:
        raise RowsError(f"{path}: nothing measured: give `measured_step_s` (seconds per optimizer step) and/or "
                        "`measured_peak_allocated_bytes` with `measured_peak_reserved_bytes`")


def _text(row: dict, col: str) -> str:
    v = row.get(col)
    return v.strip() if isinstance(v, str) else ""


def _cast(row: dict, col: str, kind, default=None):
    """The column's value as `kind` (int, float, bool, str), `default` where absent or empty; RowsError
    naming the row and column for a value of the wrong type."""
    text = _text(row, col)
    if text in ("", "nan", "NaN", "None"):
        return default
    try:
        if kind is bool:
            if text in ("True", "true", "1", "1.0"):
                return True
            if text in ("False", "false", "0", "0.0"):
                return False
            raise ValueError
        if kind is int:
            try:
                return int(text)
            except ValueError:
                value = float(text)
                if not value.is_integer():
                    raise
                return int(value)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        return text
    except (ValueError, OverflowError):
        what = {bool: "true or false", int: "a whole number", float: "a finite number"}[kind]
        raise RowsError(f"{row['_where']}: {col} = {text[:40]!r}: must be {what}")


def _field_kind(f):
    from typing import get_args
    kinds = [t for t in (get_args(f.type) or (f.type,)) if t is not type(None)]
    return kinds[0]


@lru_cache(maxsize=None)
def _arch_spec(a: _arch.Architecture) -> ModelSpec:
    return from_architecture(a)


def _json(row: dict, col: str):
    text = _text(row, col)
    if not text or text[0] not in "{[":
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise RowsError(f"{row['_where']}: {col} is not valid JSON")


def moe_blocks_as_leaves(recorded_leaves, stage: int) -> bool:
    """Whether a measured job's MoE blocks are predicted as stage-3 leaves (`from_profile`'s `z3_leaf_moe`):
    as zerocalc takes them, unless a stage-3 run recorded that it set none (`z3_leaf_modules` []: the
    validator sets leaves only for blocks with a `gate`, which Granite-MoE's and GPT-OSS's lack)."""
    return not (isinstance(recorded_leaves, list) and not recorded_leaves and stage == 3)


def _adapted(profile, row: dict, name: str, wrapper: bool):
    """The spec of `profile` with the row's LoRA (`lora`: PEFT LoraConfig keywords) and frozen modules
    (`freeze`: module patterns), as the validator's rows record them; the plain spec without."""
    from zerocalc import adapters
    lora, freeze = _json(row, "lora"), tuple(_json(row, "freeze") or ())
    leaf_moe = moe_blocks_as_leaves(_json(row, "z3_leaf_modules"), _cast(row, "stage", int))
    if not lora and not freeze:
        return from_profile(profile, name, z3_leaf_moe=leaf_moe, wrapper=wrapper)
    peft = adapters.from_peft_config({"peft_type": "LORA", **lora}, f"{row['_where']}: lora") if lora else None
    return adapters.spec(profile, peft, freeze, name, wrapper=wrapper, z3_leaf_moe=leaf_moe)


class NeedsTrace(Exception):
    """A row whose model must be traced from its code, without the trace extra installed."""


def model_of(row: dict, folder: str) -> ModelSpec:
    """The row's model: `hf_config` (JSON or a path), else `model`, else a model recorded as it ran
    (`hf_spec` without the architecture's columns: the probe's rows of a model of one's own), else the
    architecture's columns."""
    from zerocalc import resolve
    wrapper = _text(row, "path") == "engine"   # the validator's direct path wraps the model (`profile.traces`)
    cfg = _json(row, "hf_config")
    if cfg is not None:
        try:
            from zerocalc.hf import trace
            name = _text(row, "hf_name")
            return _adapted(trace.cached_trace(cfg, name), row, name, wrapper)
        except ImportError:
            raise NeedsTrace(row["_where"])
        except (ValueError, TypeError, RuntimeError) as err:
            raise RowsError(f"{row['_where']}: hf_config could not be traced: {str(err)[:200]}")
    if _text(row, "hf_config"):
        path = _text(row, "hf_config")
        beside = os.path.join(folder, path)   # a relative path: beside the CSV where it is there
        path = beside if not os.path.isabs(path) and os.path.exists(beside) else path
        try:
            return resolve.hf_config_spec(path, {})[0]
        except ImportError:
            raise NeedsTrace(row["_where"])
        except ValueError as err:
            raise RowsError(f"{row['_where']}: hf_config: {str(err)[:200]}")
    if _text(row, "model"):
        name = resolve.canonical_name(_text(row, "model"))
        if name is None:
            raise RowsError(f"{row['_where']}: model {_text(row, 'model')!r} is not a --model name "
                            "(`zerocalc models` lists them); give hf_config or the architecture's columns")
        if _json(row, "lora") or _json(row, "freeze"):
            return _adapted(resolve.profile_for(name, None, {}, resolve.preset_spec(name, {})), row, name, False)
        return resolve.preset_spec(name, {})
    record = _json(row, "hf_spec")
    if record and not _text(row, "vocab_size"):   # a model of one's own recorded by zerocalc.probe: tensors, no shape
        from zerocalc.probe.record import recorded_spec
        try:
            return recorded_spec(record, _text(row, "hf_name") or _text(row, "family"), wrapper)
        except (KeyError, TypeError, ValueError) as err:
            raise RowsError(f"{row['_where']}: hf_spec is not a recorded model ({type(err).__name__}: {err})")
    missing = [c for c in ARCH_REQUIRED if not _text(row, c)]
    if missing:
        raise RowsError(f"{row['_where']}: no model: {missing[0]} is empty (give model, hf_config or the architecture)")
    values = {f.name: _cast(row, f.name, _field_kind(f)) for f in fields(_arch.Architecture)}
    heads, hidden = values["num_heads"], values["hidden_size"]
    values["num_kv_heads"] = values["num_kv_heads"] or heads
    values["ffn_hidden_size"] = values["ffn_hidden_size"] or 4 * hidden
    values["tie_embeddings"] = bool(values["tie_embeddings"])
    a = _arch.Architecture(**{k: v for k, v in values.items() if v is not None})
    try:
        return _arch_spec(a)
    except ValueError as err:
        raise RowsError(f"{row['_where']}: {err}")


def setup_of(row: dict) -> Setup:
    """The row's Setup: N from `nproc` (or `dp`), the stage, the optimizer and every Setup field it has."""
    dp = _cast(row, "nproc", int) or _cast(row, "dp", int)
    stage = _cast(row, "stage", int)
    if dp is None or stage is None:
        raise RowsError(f"{row['_where']}: {'nproc' if dp is None else 'stage'} is empty")
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise RowsError(f"{row['_where']}: " + (f"stage = {stage}: must be 0, 1, 2 or 3" if dp >= 1 else
                                               f"nproc = {dp}: must be at least 1"))
    optimizer = _text(row, "optimizer") or "adamw"
    if optimizer not in OPTIMIZERS:
        raise RowsError(f"{row['_where']}: optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    kwargs = {}
    for f in fields(Setup):
        if f.name in SETUP_COLUMNS:
            value = _cast(row, f.name, _field_kind(f))
            if value is not None:
                kwargs[f.name] = value
    if _text(row, "path") == "trainer":
        kwargs["hf_trainer"] = True
    try:
        s = Setup(stage=Stage(stage), dp=dp, optimizer=OPTIMIZERS[optimizer], **kwargs)
        validate_setup(s)
    except ValueError as err:
        raise RowsError(f"{row['_where']}: {err}")
    return s


def hardware_of(row: dict, hw: Hardware, dp: int) -> Hardware:
    """`hw` with the row's node layout: `nodes` > 1 puts N / nodes ranks on each node."""
    nodes = _cast(row, "nodes", int, 1)
    if nodes < 1 or dp % nodes:
        raise RowsError(f"{row['_where']}: nodes = {nodes}: must divide nproc {dp}")
    return replace(hw, gpus_per_node=dp // nodes) if nodes > 1 else hw


def _median_probe(row: dict) -> float | None:
    """The median of the launch probes taken before each timed step (`measured_step_issue_us`), seconds."""
    values = _json(row, "measured_step_issue_us")
    return statistics.median(values) * 1e-6 if values else None


def is_validator_row(row: dict) -> bool:
    """A row `python -m validate run` wrote (it carries the prediction made at its run)."""
    return "predicted_state_bytes" in row


def timed(row: dict) -> bool:
    """Whole optimizer steps timed as training runs them: a user's `measured_step_s`; of a validator
    row, only those timed without phase synchronizes (`measured_step_times_s`), alone on the GPU (not
    protocol concurrent or shared_gpu > 1) and in a real world (not world fake)."""
    if _cast(row, "measured_step_s", float) is None:
        return False
    if _text(row, "world") == "fake" or _text(row, "protocol") == "concurrent" or (_cast(row, "shared_gpu", float) or 1) > 1:
        return False
    if not is_validator_row(row):
        return True
    return _text(row, "measured_step_times_s") not in ("", "[]") and _text(row, "measured_step_times_s")[0] == "["


def measured(row: dict, hw: Hardware, folder: str) -> Measured:
    """One row read (RowsError for a value of the wrong type; NeedsTrace for an HF config without the extra)."""
    setup = setup_of(row)
    values = {c: v for c in TIME_COLUMNS + MEMORY_COLUMNS if (v := _cast(row, c, float)) is not None}
    per_step = _median_probe(row)
    probe = per_step or (values.get("measured_launch_us") or values.get("host_launch_us") or 0) * 1e-6 or None
    user = values.get("host_launch_us")
    return Measured(row["_where"], _text(row, "key") or row["_where"], model_of(row, folder), setup,
                    hardware_of(row, hw, setup.dp), values, timed(row), per_step or (user and user * 1e-6), probe)


def read(paths, hw: Hardware) -> tuple[list[Measured], list[str]]:
    """Every ok row of the files (a row with an outcome other than ok is left out), and a note for each
    kind of row left out. RowsError for a file or row that cannot be read."""
    rows, notes, failed, untraced = [], [], 0, []
    for path in paths:
        header, raw = read_csv(path)
        check_header(path, header)
        folder = os.path.dirname(os.path.abspath(path))
        for row in raw:
            if _text(row, "outcome") not in ("", "ok"):
                failed += 1
                continue
            try:
                rows.append(measured(row, hw, folder))
            except NeedsTrace as err:
                untraced.append(str(err))
    if failed:
        notes.append(f"{failed} rows left out: their job did not end ok (outcome)")
    if untraced:
        notes.append(f"{len(untraced)} rows left out (e.g. {untraced[0]}): their hf_config must be traced from its code: "
                     "pip install 'zerocalc[trace]'")
    return rows, notes
