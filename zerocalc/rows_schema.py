"""The tidy row's schema: one measured configuration per row, its setup and model columns, zerocalc's
prediction beside what was measured, and where it ran. `validate` writes these rows for the jobs it
runs, `zerocalc.probe` for a user's own job, and `python -m validate report` reads both; the column
names, how a column's text is read back (`cast`), how a row is written as one CSV line (`render`)
and the predicted columns (`predicted_columns`) live here so that both writers share them.
Torch-free, as the rest of zerocalc."""
import csv
import io
import json
from dataclasses import fields
from typing import get_args

from zerocalc.arch import Architecture
from zerocalc.training import Setup

# Setup fields a row carries as columns (stage, optimizer and dp have columns of their own names)
SETUP_FIELDS = tuple(f.name for f in fields(Setup) if f.name not in ("extra", "optimizer", "stage", "dp", "hf_trainer"))
ARCH_FIELDS = tuple(f.name for f in fields(Architecture))

PHASES = ("init", "forward", "backward", "step")
CONFIG_COLUMNS = ("key", "backend", "nproc", "stage", "optimizer") + SETUP_FIELDS + ARCH_FIELDS + ("num_params",)
PREDICTED_COLUMNS = ("predicted_state_bytes", "predicted_comm_bytes", "predicted_comm_by_op",
                     "predicted_peak_allocated_bytes", "predicted_peak_phase", "predicted_host_peak_bytes",
                     "predicted_host_phase", "zerocalc_version")
HOST_PHASES = ("start", "build", "init", "first_step", "end")
# Host memory per rank (validate.measure.HostRecorder): the busiest rank's peak resident set over the job
# (VmHWM) and per phase, its resident set and pinned bytes at each phase's end, the host's MemAvailable at
# its lowest and MemTotal; the node's peak is the sum of the ranks' peaks (an upper bound: they need not
# peak at once).
HOST_COLUMNS = ("measured_host_peak_bytes", "measured_host_peak_phase", "measured_host_baseline_bytes",
                "measured_host_node_peak_bytes", "measured_host_pinned_bytes", "measured_host_ds_pinned_bytes",
                "measured_host_available_min_bytes", "measured_host_total_bytes", "measured_host_hwm_reset") + tuple(
    f"measured_host_{ph}_{what}_bytes" for ph in HOST_PHASES[1:] for what in ("hwm", "rss", "pinned"))
MEASURED_COLUMNS = ("outcome", "error", "measured_state_bytes", "measured_state_min_bytes", "measured_scalar_bytes",
                    "measured_host_state_bytes", "measured_comm_bytes", "measured_comm_by_op", "loss_first", "loss_last", "losses",
                    "param_tensors", "sharded_param_tensors",
                    "measured_peak_allocated_bytes", "measured_peak_reserved_bytes", "measured_alloc_retries",
                    "measured_base_allocated_bytes", "measured_step_s", "measured_forward_s", "measured_backward_s",
                    "measured_step_phase_s", "measured_step_times_s", "measured_launch_us", "measured_matmul_tflops",
                    "measured_step_issue_us", "measured_step_issue_by_rank_us", "measured_step_python_us", "measured_step_host_s", "measured_step_runq_s",
                    "measured_step_steal_s", "measured_step_gc_s", "measured_step_sm_mhz",
                    "measured_device_overhead_bytes") + HOST_COLUMNS + tuple(
    f"measured_{ph}_{what}_bytes" for ph in PHASES + tuple("first_" + p for p in PHASES[1:])
    for what in ("peak", "end", "reserved"))
ENV_COLUMNS = ("gpu", "driver", "cuda", "torch", "deepspeed", "python", "date", "host", "cpus", "command", "protocol",
               "measured_comm_detail", "measured_state_detail")
COLUMNS = CONFIG_COLUMNS + PREDICTED_COLUMNS + MEASURED_COLUMNS + ENV_COLUMNS

# An HF config's rows (validate/hf_models.py) and a recorded model's (zerocalc.probe) carry what was built
# and how it ran; other rows leave these columns out (a writer adds a column when a row first has it).
HF_COLUMNS = ("path", "hf_name", "hf_model_type", "hf_num_experts", "hf_experts_per_token", "hf_config",
              "ds_config", "hf_resolved_ds_config", "z3_leaf_modules", "timed_steps", "shared_gpu", "hf_spec", "lora", "freeze",
              "measured_trainer_phased_s", "measured_trainer_host_s")
# How a job ran, where not as a real job of nproc ranks on a whole GPU (`validate.jobs.RUN_KEYS`):
# world "fake" for one rank of nproc in one process (rank 0 unless `rank` says), the allocator's cap in
# bytes (an emulated card),
# zero weights, the nodes its ranks spanned (`validate run --hostfile`), the ds_config keys added to the
# worker's beyond the Setup's (JSON); and where an out-of-memory error was raised. Rows without them leave them out.
RUN_COLUMNS = ("world", "rank", "allocator_capacity_bytes", "zero_weights", "nodes", "ds_extra", "oom_at")
# A row of a user's own job (zerocalc.probe): the optimizer step it measured and the prediction from the
# model's own config (an HF model: its shipped profile or trace), beside the recorded one in predicted_*.
PROBE_COLUMNS = ("probe_step", "probe_model", "config_state_bytes", "config_comm_bytes",
                 "config_peak_allocated_bytes", "config_peak_reserved_bytes", "config_host_peak_bytes",
                 "config_step_s")


def field_kind(f):
    """The plain type of a dataclass field: bool, int, float or str (`int | None` -> int)."""
    kinds = [t for t in (get_args(f.type) or (f.type,)) if t is not type(None)]
    return kinds[0]


def cast(value, kind):
    """A column's value read back as `kind` (`field_kind`); None for an empty cell."""
    if value is None or value == "" or (isinstance(value, float) and value != value):
        return None
    if kind is bool:   # a bool column beside empty ones reads back as 1.0 / 0.0 from a set of files
        return bool(value) if isinstance(value, (bool, int, float)) else str(value) in ("True", "true", "1")
    if kind is int:
        try:
            return int(value)            # exact, also for 2**63 - 1
        except ValueError:
            return int(float(value))     # "5e8"
    return kind(value)


def one_line(value) -> str:
    """A cell as written: every row is one physical line, so newlines inside a value become " | "."""
    text = "" if value is None else str(value)
    if "\n" in text or "\r" in text:
        text = " | ".join(p for p in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if p.strip())
    return text


def render(header: list[str], rows: list[dict], with_header: bool = False) -> str:
    """Rows as CSV lines in `header`'s order (a column a row lacks is empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if with_header:
        w.writerow(header)
    for row in rows:
        w.writerow([one_line(row.get(k, "")) for k in header])
    return buf.getvalue()


def predicted_state_bytes(e, backend: str) -> int:
    """What a row's `measured_state_bytes` holds: the device's tensors; on the CPU backend the
    device is the host, so offloaded state counts too."""
    return e.states.total_bytes if backend == "cpu" else e.states.resident_bytes


def predicted_columns(spec, setup, backend: str) -> dict:
    """zerocalc's prediction as the predicted_* columns; for a model known by its parameter tensors
    only (no architecture: a recorded model, until a profile gives its activations) states,
    communication and host memory, the device peak left empty."""
    import zerocalc
    from zerocalc import host
    from zerocalc.estimate import estimate
    if spec is None:
        return {"zerocalc_version": zerocalc.__version__}
    e = estimate(spec, setup)
    h = host.host_memory(spec, setup)
    per_op = {}
    for c in e.collectives:
        per_op[c.op] = per_op.get(c.op, 0) + c.bytes
    out = {"predicted_state_bytes": predicted_state_bytes(e, backend), "predicted_comm_bytes": e.comm_bytes,
           "predicted_comm_by_op": json.dumps(per_op, sort_keys=True), "predicted_host_peak_bytes": h.peak_bytes,
           "predicted_host_phase": h.peak_phase, "zerocalc_version": zerocalc.__version__}
    if spec.architecture is not None:
        out.update(predicted_peak_allocated_bytes=e.peak_bytes, predicted_peak_phase=e.peak.name)
    return out
