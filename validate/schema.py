"""What a results file's rows may hold, checked as they are read back (`validate report`, `fit`,
`crossval`, `host`): a file edited by hand or written by another tool stops the command with one line
naming the file, the line and the column, instead of a traceback deep in a table or a silent wrong
number. Columns a file lacks that later validators added read as their defaults (`rows.job_from_row`)
or as not measured; the columns every results file has must be there."""
import json
import math
from dataclasses import MISSING, fields

from validate import results_file
from validate.jobs import SETUP_FIELDS, to_zerocalc
from validate.rows import COLUMNS, _field_kind
from zerocalc.arch import Architecture, validate_architecture
from zerocalc.training import OPTIMIZERS, Setup, validate_setup

OUTCOMES = ("ok", "oom", "error", "crash", "timeout")   # what the runner writes (validate.rows, runner)
REQUIRED = ("key", "outcome", "backend", "nproc", "stage", "optimizer") + tuple(
    f.name for f in fields(Architecture) if f.default is MISSING)
# A model of one's own recorded as it ran (`zerocalc.probe`: `hf_spec`, no HF config) has no architecture's
# dimensions: zerocalc predicts it from the record.
RECORDED_MAY_LACK = tuple(f.name for f in fields(Architecture) if f.default is MISSING and f.name != "family")
MEASURED_WHEN_OK = ("measured_state_bytes", "measured_comm_bytes")          # every ok row, CPU or GPU
MEASURED_WITH_PEAK = ("measured_peak_reserved_bytes", "measured_base_allocated_bytes")   # every GPU row
# Scalars beside the byte counts (every *_bytes column): finite numbers (a loss may be nan: it diverged).
NUMBERS = ("num_params", "param_tensors", "sharded_param_tensors", "measured_alloc_retries", "measured_step_s",
           "measured_forward_s", "measured_backward_s", "measured_step_phase_s", "measured_launch_us",
           "measured_matmul_tflops", "shared_gpu", "timed_steps", "allocator_capacity_bytes")
LOSSES = ("loss_first", "loss_last")
NUMBER_LISTS = ("losses", "measured_step_times_s", "measured_step_issue_us", "measured_step_python_us",
                "measured_step_host_s", "measured_step_runq_s", "measured_step_steal_s", "measured_step_gc_s",
                "measured_step_sm_mhz")
JSON_VALUES = ("predicted_comm_by_op", "measured_comm_by_op", "measured_comm_detail", "measured_state_detail",
               "measured_step_issue_by_rank_us", "measured_trainer_phased_s", "measured_trainer_host_s", "hf_config",
               "hf_spec", "z3_leaf_modules", "hf_resolved_ds_config", "lora", "freeze")
_KINDS = {f.name: _field_kind(f) for f in fields(Setup) if f.name in SETUP_FIELDS}
_KINDS.update({f.name: _field_kind(f) for f in fields(Architecture)}, nproc=int, stage=int,
              measured_host_hwm_reset=bool)
_BOOLS = ("True", "False", "true", "false", "1", "0", "1.0", "0.0")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _value_problem(col: str, text: str) -> str | None:
    """What is wrong with one non-empty value of a column of known kind, in words; None if nothing."""
    kind = _KINDS.get(col)
    if kind is int or col in NUMBERS or col.endswith("_bytes") or col in LOSSES:
        x = _number(text)
        if x is None or (not math.isfinite(x) and col not in LOSSES):
            return f"{text!r} is not a number"
        if kind is int and x != int(x):
            return f"{text!r} is not a whole number"
    elif kind is bool and text not in _BOOLS:
        return f"{text!r} is not True or False"
    elif col in NUMBER_LISTS or col in JSON_VALUES:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return f"{text[:40]!r} is not JSON"
        if col in NUMBER_LISTS and not (isinstance(value, list) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            return f"{text[:40]!r} is not a list of numbers"
    return None


def _row_problem(row: dict) -> tuple[str | None, str] | None:
    """(the column, what is wrong) for the first fault of one row read back as text; column None where
    the fault is between columns (zerocalc's own message then names them). None for a good row."""
    from validate.rows import job_from_row
    recorded = row.get("hf_spec", "").startswith("{") and not row.get("hf_config")
    for col in REQUIRED:
        if not row[col] and not (recorded and col in RECORDED_MAY_LACK):
            return col, "empty"
    for col, allowed in (("outcome", OUTCOMES), ("backend", ("cpu", "cuda")), ("optimizer", tuple(OPTIMIZERS))):
        if row[col] not in allowed:
            return col, f"{row[col]!r} is not one of {', '.join(allowed)}"
    for col, text in row.items():
        problem = text and _value_problem(col, text)
        if problem:
            return col, problem
    if int(float(row["nproc"])) < 1:
        return "nproc", f"{row['nproc']!r}: a job has at least one rank"
    if row["outcome"] != "ok":   # a job zerocalc rejected is an error row of the setup it refused
        return None
    for col in MEASURED_WHEN_OK + (MEASURED_WITH_PEAK if row.get("measured_peak_allocated_bytes") else ()):
        if not row.get(col):
            return col, ("empty" if col in row else "missing") + " on an ok row" + (
                " with a GPU peak" if col in MEASURED_WITH_PEAK else "")
    job = job_from_row(row)
    try:
        if "hf" not in job:   # an HF config's row: zerocalc reads what its run recorded, not a family
            validate_architecture(Architecture(**job["arch"]))
        validate_setup(Setup(stage=job["stage"], dp=job["nproc"], optimizer=OPTIMIZERS[job["optimizer"]],
                             **{k: job[k] for k in SETUP_FIELDS}))
    except (ValueError, TypeError) as err:
        return None, str(err)
    if "hf" not in job:
        return None
    try:   # what report and fit predict an HF config's row from: what its run recorded
        if to_zerocalc(job)[0] is None:
            return "hf_spec", "empty on an ok row of an HF config"
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        return "hf_spec", f"not what a run records ({type(err).__name__}: {err})"
    return None


def check(parsed: results_file.Parsed, path: str) -> None:
    """Raise ResultsFileError naming the file, line and column of the first thing in `parsed` that no
    validator wrote: a column every results file has missing or named twice, the header line repeated
    (files joined end to end), or a value of the wrong kind (a word where a count belongs, an unknown
    outcome, a setup zerocalc refuses)."""
    twice = results_file.repeated_column(parsed.header)
    if twice:
        raise results_file.ResultsFileError(f"{path}, line 1: column {twice!r} appears twice in the header")
    missing = [c for c in REQUIRED if c not in parsed.header]
    if missing:
        raise results_file.ResultsFileError(f"{path}: no column {missing[0]!r}, which every results file has "
                                            f"({', '.join(REQUIRED)})")
    for row, line in zip(parsed.rows, parsed.lines):
        if list(row.values()) == parsed.header:
            raise results_file.ResultsFileError(f"{path}, line {line} repeats the header line (files joined end "
                                                "to end?): remove it")
        problem = _row_problem(row)
        if problem:
            col, what = problem
            where = f"{path}, line {line}" + (f", column {col}" if col else "")
            raise results_file.ResultsFileError(f"{where}: {what}")


def read_checked(path: str) -> results_file.Parsed:
    """A results file's whole rows (`results_file.read`) once `check` finds nothing wrong with them;
    ResultsFileError for a file that is not a results file at all (no header, someone else's CSV)."""
    parsed = results_file.read(path)
    if not parsed.header:
        raise results_file.ResultsFileError(f"{path} has no header line: not a validator results file")
    if not results_file.is_results_header(parsed.header):
        raise results_file.ResultsFileError(f"{path} is not a validator results file (its header starts "
                                            f"{','.join(parsed.header[:3])[:60]!r})")
    check(parsed, path)
    return parsed


def defaults_for_missing(header: list[str]) -> dict:
    """{column: value} for the columns a file lacks (written before they existed) that readers index
    without asking: a Setup or Architecture field's default, as `rows.job_from_row` reads it, and None
    (not measured) for a measured number. Text and JSON columns stay absent, as readers expect."""
    default = {f.name: f.default for f in fields(Setup) if f.name in SETUP_FIELDS}
    default.update({f.name: f.default for f in fields(Architecture) if f.default is not MISSING})
    numbers = [c for c in COLUMNS if c.endswith("_bytes") or c in NUMBERS + LOSSES]
    return {c: default.get(c) for c in list(default) + numbers if c not in header}
