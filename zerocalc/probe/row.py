"""What a probe measured, beside what zerocalc predicts for the same job: the table printed on rank 0
and the row appended to a results CSV in the validator's format (`zerocalc.rows_schema`), which
`python -m validate report` reads. Measured values are the busiest rank's, as the validator's rows
hold them (state: the rank holding most; communication, peaks, host memory: the largest; step time:
the slowest rank's)."""
import hashlib
import json
import os
import sys
import time

import zerocalc
from zerocalc import host
from zerocalc.estimate import estimate
from zerocalc.probe import describe
from zerocalc.probe.measure import comm_by_op
from zerocalc.rows_schema import COLUMNS, SETUP_FIELDS, predicted_columns, predicted_state_bytes, render
from zerocalc.states import buffer_element_bytes
from zerocalc.training import OPTIMIZERS
from zerocalc.units import GB, GiB


def measured(ranks: list[dict], device: str) -> dict:
    """The measured_* columns from every rank's measurement (`Probe.local`)."""
    state = [r["state"]["by_device"].get(device, 0) for r in ranks]
    comm = [comm_by_op(r["comm"]) for r in ranks]
    busiest = max(range(len(ranks)), key=lambda i: state[i])
    out = {"outcome": "ok", "error": "", "measured_state_bytes": max(state), "measured_state_min_bytes": min(state),
           "measured_scalar_bytes": max(r["state"]["scalar_bytes"] for r in ranks),
           "measured_comm_bytes": max(sum(c.values()) for c in comm),
           "measured_comm_by_op": json.dumps(comm[busiest], sort_keys=True),
           "measured_comm_detail": json.dumps(ranks[busiest]["comm"], sort_keys=True),
           "measured_state_detail": json.dumps(ranks[busiest]["state"]["by_path"], sort_keys=True),
           "param_tensors": ranks[0]["param_tensors"], "sharded_param_tensors": ranks[0]["sharded_param_tensors"]}
    if device == "cuda":
        out["measured_host_state_bytes"] = max(r["state"]["by_device"].get("cpu", 0) for r in ranks)
    times = [r.get("step_s") for r in ranks]
    if None not in times and device == "cuda":   # as the validator's rows: no step time off the GPU
        out.update(measured_step_s=max(times), measured_step_times_s=json.dumps([round(max(times), 6)]))
    hosts = [r["host"] for r in ranks if r["host"].get("VmHWM")]
    if hosts:
        here = ranks[0].get("hostname")
        out.update(measured_host_peak_bytes=max(h["VmHWM"] for h in hosts),
                   measured_host_end_rss_bytes=max(h["VmRSS"] or 0 for h in hosts),
                   measured_host_node_peak_bytes=sum(r["host"]["VmHWM"] or 0 for r in ranks
                                                     if r.get("hostname") == here),
                   measured_host_available_min_bytes=min(h["MemAvailable"] or 0 for h in hosts),
                   measured_host_total_bytes=hosts[0]["MemTotal"], measured_host_hwm_reset=False)
    out.update(_device_columns([r["memory"] for r in ranks if r.get("memory")]))
    return out


def _device_columns(mem: list[dict]) -> dict:
    """Peaks per phase of the measured step and the job's before it (CUDA only): the largest rank's."""
    if not mem:
        return {}
    out = {"measured_peak_allocated_bytes": max(max(m["peak_allocated"], m.get("before", {}).get("peak_allocated", 0))
                                                for m in mem),
           "measured_peak_reserved_bytes": max(max(m["peak_reserved"], m.get("before", {}).get("peak_reserved", 0))
                                               for m in mem),
           "measured_alloc_retries": max(m["alloc_retries"] for m in mem),
           # the probe counts all the process holds: nothing is taken as left over from an earlier job
           "measured_base_allocated_bytes": 0,
           "measured_device_overhead_bytes": max(m["device_used_bytes"] - m["reserved_now"] for m in mem)}
    for ph in ("forward", "backward", "step"):
        vals = [m["phases"][ph] for m in mem if ph in m["phases"]]
        if vals:
            out[f"measured_{ph}_peak_bytes"] = max(v["peak_allocated"] for v in vals)
            out[f"measured_{ph}_end_bytes"] = max(v["end_allocated"] for v in vals)
            out[f"measured_{ph}_reserved_bytes"] = max(v["peak_reserved"] for v in vals)
        col = "measured_step_phase_s" if ph == "step" else f"measured_{ph}_s"
        out[col] = max(m["phase_seconds"].get(ph, 0) for m in mem)
    return out


def _optimizer_name(setup) -> str:
    return next(k for k, v in OPTIMIZERS.items() if v == setup.optimizer)


def _lora_column(module) -> str:
    """The active LoRA adapter's LoraConfig keywords that differ from PEFT's defaults, as JSON."""
    configs = getattr(module, "peft_config", None)
    if not configs:
        return ""
    import peft
    cfg = configs[getattr(module, "active_adapter", None) or next(iter(configs))]
    default = peft.LoraConfig().to_dict()
    clean = lambda v: sorted(v) if isinstance(v, set) else v  # noqa: E731
    d = {k: clean(v) for k, v in cfg.to_dict().items()
         if k in ("r", "target_modules") or clean(v) != clean(default.get(k))}
    d.pop("peft_type", None)
    return json.dumps(d, sort_keys=True, default=str)


def _key(columns: dict, setup, path: str) -> str:
    """A row's key: the job's shape and a digest that includes the time, so every probed run is a row."""
    payload = json.dumps([columns, repr(setup), os.uname().nodename, time.time()], sort_keys=True, default=str)
    digest = hashlib.sha1(payload.encode()).hexdigest()[:10]
    return (f"probe-{columns['family']}-{path}-s{int(setup.stage)}-{setup.dtype}-n{setup.dp}-b{setup.micro_batch}x"
            f"{setup.seq_len}-gas{setup.gas}-{digest}")


def _predictions(spec, setup, hw) -> dict:
    """zerocalc's answers for one ModelSpec: state (as the row's backend counts it, filled in by the
    caller), communication, peaks (with activations only), host peak, step time (with a GPU preset)."""
    e = estimate(spec, setup, hardware=hw)
    out = {"e": e, "comm": e.comm_bytes, "host": host.host_memory(spec, setup).peak_bytes}
    if e.activation_bytes is not None:
        out.update(peak=e.peak_bytes, reserved=e.peak_reserved_bytes)
    if hw is not None and e.time is not None:
        out["step_s"] = e.time.step_s
    return out


def report(probe, ranks: list[dict]) -> tuple[str, str | None]:
    """(the table, the file the row went to or None) for a probe's gathered measurements."""
    local, engine = ranks[0], probe.engine
    module = engine.module
    setup, notes = describe.setup_of(engine, module, local.get("batch"), probe.path, probe.overrides)
    device = "cuda" if local["device"].startswith("cuda") else "cpu"
    columns = describe.model_columns(module)
    recorded = describe.recorded_model(local["record"], columns["family"], buffer_element_bytes(setup))
    try:
        configured, how = describe.configured_spec(module, local["record"])
    except Exception as err:  # noqa: BLE001  -- without the config's answer, the recorded one stands
        configured, how = None, f"the config's model could not be read ({type(err).__name__}: {err})"
    hw = describe.gpu_preset(_device_name(device))
    row = {"backend": device, "nproc": setup.dp, "stage": int(setup.stage), "optimizer": _optimizer_name(setup),
           **{f: getattr(setup, f) for f in SETUP_FIELDS}, **columns, "num_params": recorded.num_params,
           "path": probe.path, "hf_spec": json.dumps(local["record"], separators=(",", ":")),
           "hf_resolved_ds_config": json.dumps(describe.ds_config_of(engine), sort_keys=True, default=str),
           "lora": _lora_column(module), "timed_steps": 1, "probe_step": probe.step, "probe_model": how,
           "protocol": "probe", "command": " ".join(sys.argv)}
    frozen = describe.frozen_column(module)
    if frozen:
        row["freeze"] = frozen
    row["key"] = _key(columns, setup, probe.path)
    row.update(predicted_columns(recorded, setup, device))
    row.update(measured(ranks, device))
    row.update(_environment(engine))
    ours = _predictions(configured or recorded, setup, hw)
    ours["state"] = predicted_state_bytes(ours["e"], device)
    if configured is not None:
        row.update(config_state_bytes=ours["state"], config_comm_bytes=ours["comm"],
                   config_host_peak_bytes=ours["host"], config_peak_allocated_bytes=ours.get("peak", ""),
                   config_peak_reserved_bytes=ours.get("reserved", ""), config_step_s=ours.get("step_s", ""))
    if engine_version() != zerocalc.DEEPSPEED_VERSION:
        notes.append(f"DeepSpeed {engine_version()} runs this job; zerocalc models {zerocalc.DEEPSPEED_VERSION}")
    times = [r.get("step_s") for r in ranks]
    text = table(row, ours, how, notes, hw, None if None in times else max(times))
    written = None
    if probe.out:
        append_row(probe.out, row)
        written = probe.out
    return text, written


def engine_version() -> str:
    import deepspeed
    return deepspeed.__version__


def _device_name(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch
    return torch.cuda.get_device_name()


def _environment(engine) -> dict:
    from zerocalc.probe.measure import environment
    env = {"gpu": "cpu", **environment(engine.device)}
    return {k: env.get(k, "") for k in ("gpu", "driver", "cuda", "torch", "deepspeed", "python", "date", "host",
                                        "cpus")}


def _size(nbytes, unit_bytes: int, unit: str) -> str:
    return "-" if nbytes in (None, "") else f"{nbytes / unit_bytes:,.3f} {unit}"


def _error(pred, meas) -> str:
    if pred in (None, "") or meas in (None, ""):
        return ""
    if pred == meas:
        return "exact"
    if isinstance(pred, int) and isinstance(meas, int) and abs(pred - meas) < 5e-4 * meas:
        return f"{pred - meas:+,} B"      # a few bytes off: the percentage would read 0.0%
    return f"{pred / meas - 1:+.1%}" if meas else ""


def table(row: dict, ours: dict, how: str, notes: list[str], hw, step_s: float | None = None) -> str:
    """The short table printed on rank 0: measured beside zerocalc, one line per quantity."""
    mib, mb = 2**20, 10**6
    big = max(row.get("measured_state_bytes") or 0, row.get("measured_peak_reserved_bytes") or 0) >= GiB
    unit, unit_bytes = ("GiB", GiB) if big else ("MiB", mib)
    cunit, cunit_bytes = ("GB", GB) if (row.get("measured_comm_bytes") or 0) >= GB else ("MB", mb)
    lines = [(f"state per rank ({'device' if row['backend'] == 'cuda' else 'host'} tensors)",
              row.get("measured_state_bytes"), ours["state"], unit_bytes, unit),
             ("communication per optimizer step", row.get("measured_comm_bytes"), ours["comm"], cunit_bytes, cunit)]
    if row["backend"] == "cuda":
        lines += [("peak allocated", row.get("measured_peak_allocated_bytes"), ours.get("peak"), unit_bytes, unit),
                  ("peak reserved", row.get("measured_peak_reserved_bytes"), ours.get("reserved"), unit_bytes, unit)]
    lines.append(("host peak resident set (VmHWM)", row.get("measured_host_peak_bytes"),
                  ours["host"] if row["backend"] == "cuda" else None, GiB, "GiB"))   # modelled for GPU jobs
    width = max(len(label) for label, *_ in lines + [("step time", 0, 0, 0, "")])
    offload = [f"{what} offload to {row[f'offload_{what}']}" for what in ("optimizer", "param")
               if row[f"offload_{what}"] != "none"]
    job = ", ".join([f"stage {row['stage']}", row["dtype"], f"micro-batch {row['micro_batch']} x {row['seq_len']} "
                     f"tokens", f"gas {row['gas']}"] + (["checkpointing"] if row["activation_checkpointing"] else [])
                    + offload)
    out = [f"zerocalc probe, optimizer step {row['probe_step']} of a {row['nproc']}-rank DeepSpeed job on "
           f"{row['gpu']}: {job}", f"zerocalc's model: {how}",
           f"{'':<{width}}  {'measured':>16}  {'zerocalc':>16}  {'error':>7}"]
    for label, meas, pred, ub, u in lines:
        out.append(f"{label:<{width}}  {_size(meas, ub, u):>16}  {_size(pred, ub, u):>16}  {_error(pred, meas):>7}")
    step = row.get("measured_step_s", step_s)
    pred_s = ours.get("step_s")
    out.append(f"{'step time':<{width}}  {'-' if step is None else f'{step * 1e3:,.1f} ms':>16}  "
               f"{'-' if pred_s is None else f'{pred_s * 1e3:,.1f} ms':>16}  {_error(pred_s, step):>7}")
    if hw is None and row["backend"] == "cuda":
        notes = notes + [f"no GPU preset is {row['gpu']}: no step time predicted"]
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)


def append_row(path: str, row: dict) -> None:
    """Append the row to a results CSV in the validator's format: the header first in a new file; a
    file written before one of the row's columns existed is rewritten with it added at the end."""
    header = None
    if os.path.exists(path) and os.path.getsize(path):
        import csv
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
    if not header:
        header = list(COLUMNS) + [k for k in row if k not in COLUMNS]
        with open(path, "a") as f:
            f.write(render(header, [row], with_header=True))
        return
    missing = [k for k in row if k not in header]
    if missing:
        import csv
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(render(header + missing, old + [row], with_header=True))
        os.replace(tmp, path)
        return
    with open(path, "a") as f:
        f.write(render(header, [row]))
