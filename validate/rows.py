"""Tidy rows: one per configuration, the busiest rank's measurement beside zerocalc's prediction."""
import json
import os

import zerocalc
from zerocalc.probe.measure import comm_by_op as _comm_by_op
from zerocalc.rows_schema import (ARCH_FIELDS, COLUMNS, CONFIG_COLUMNS, HF_COLUMNS, HOST_COLUMNS,  # noqa: F401
                                  HOST_PHASES, MEASURED_COLUMNS, PHASES, PREDICTED_COLUMNS, RUN_COLUMNS,
                                  SETUP_FIELDS, predicted_state_bytes)
from zerocalc.rows_schema import cast as _cast, field_kind as _field_kind, predicted_columns as _predicted  # noqa: F401
from validate.jobs import to_zerocalc


def _hf_config_columns(job):
    hf = job["hf"]
    return {"path": job.get("path", "engine"), "hf_name": hf["name"], "hf_model_type": hf["config"]["model_type"],
            "hf_num_experts": hf.get("num_experts", ""), "hf_experts_per_token": hf.get("experts_per_token", ""),
            "hf_config": json.dumps(hf["config"], sort_keys=True), "ds_config": job.get("ds_config", ""),
            "timed_steps": job.get("timed_steps", ""),
            "lora": json.dumps(job["lora"], sort_keys=True) if job.get("lora") else "",
            "freeze": json.dumps(job["freeze"]) if job.get("freeze") else "",
            # launches sharing the GPU while this one ran: peaks are per process and hold; step times do not
            "shared_gpu": job.get("shared_gpu", "")}


def _run_columns(job):
    out = {"world": "fake" if job.get("fake_world") else None, "rank": job.get("fake_rank") or None,
           "nodes": job.get("nodes"),
           "allocator_capacity_bytes": job.get("allocator_capacity_bytes"),
           "zero_weights": True if job.get("zero_weights") else None,
           "ds_extra": json.dumps(job["ds_extra"], sort_keys=True) if job.get("ds_extra") else None}
    return {k: v for k, v in out.items() if v is not None}


def _config(job, backend):
    row = {"key": job["key"], "backend": backend, "nproc": job["nproc"], "stage": job["stage"],
           "optimizer": job["optimizer"]}
    row.update(_run_columns(job))
    row.update({f: job.get(f) for f in SETUP_FIELDS})
    row.update({f: job["arch"].get(f) for f in ARCH_FIELDS})
    spec, setup = to_zerocalc(job)
    if job.get("hf"):
        row.update(_hf_config_columns(job))
    row["num_params"] = spec.num_params if spec is not None else ""
    return row, spec, setup


def rejection(job: dict, backend: str) -> str | None:
    """Why zerocalc cannot predict this job (its Setup or architecture refused, or the estimate
    failed), None when it can: such a job is not launched but written as an `error` row with the
    reason, so the sweep goes on and a resume does not stop on it."""
    try:
        _, spec, setup = _config(job, backend)
        _predicted(spec, setup, backend)
    except Exception as err:  # noqa: BLE001  -- any refusal is the row's reason
        return f"zerocalc rejects this job: {type(err).__name__}: {err}"[:500]
    return None


def rejected_row(job: dict, reason: str, backend: str, command: str) -> dict:
    """The row of a job zerocalc rejects (`rejection`): its configuration, no prediction, outcome error."""
    row = {"key": job["key"], "backend": backend, "nproc": job.get("nproc"), "stage": job.get("stage"),
           "optimizer": job.get("optimizer")}
    row.update({f: job.get(f) for f in SETUP_FIELDS})
    row.update({f: job.get("arch", {}).get(f) for f in ARCH_FIELDS})
    row.update(outcome="error", error=reason, command=command, zerocalc_version=zerocalc.__version__)
    return row


def _every_ranks_probes(ranks: list[dict], name: str) -> list[list[float]] | None:
    """Each rank's per-step probes `name`, in rank order, where every rank took one before every timed
    step (a rank off CUDA has none for the launch probe); None otherwise, so a column is never half filled."""
    probes = [r.get(name) for r in ranks]
    if not all(probes) or any(None in p for p in probes) or len({len(p) for p in probes}) != 1:
        return None
    return probes


def make_row(job: dict, result: dict, backend: str, command: str) -> dict:
    ranks = [r for r in result["ranks"] if r is not None]
    seen = next((r for r in ranks if r.get("hf_spec")), None)
    if job.get("hf") and seen:   # what the run built: zerocalc predicts from its parameter tensors
        job = {**job, "hf_spec": seen["hf_spec"]}
    row, spec, setup = _config(job, backend)
    row.update(_predicted(spec, setup, backend))
    if job.get("hf") and seen:
        row.update(hf_spec=json.dumps(seen["hf_spec"], separators=(",", ":")),
                   z3_leaf_modules=json.dumps(seen.get("z3_leaf_modules", [])),
                   hf_resolved_ds_config=json.dumps(seen["resolved_ds_config"], sort_keys=True)
                   if seen.get("resolved_ds_config") else "")
    outcomes = sorted({r["outcome"] for r in ranks})
    row["outcome"] = "ok" if outcomes == ["ok"] else next(o for o in ("oom", "error", "crash") if o in outcomes)
    row["error"] = next((r.get("error", "") for r in ranks if r["outcome"] != "ok"), "")
    oom_at = next((r["oom_at"] for r in ranks if r.get("oom_at")), None)
    if oom_at:
        row["oom_at"] = oom_at
    env = result.get("env", {})
    row.update({"gpu": env.get("gpu", "cpu"), "driver": env.get("driver", ""), "cuda": env.get("cuda", ""),
                "torch": env.get("torch"), "deepspeed": env.get("deepspeed"), "python": env.get("python"),
                "date": env.get("date"), "host": env.get("host"), "cpus": env.get("cpus", ""), "command": command,
                # VALIDATE_PROTOCOL=concurrent: jobs run beside others on one GPU (step times not theirs)
                "protocol": os.environ.get("VALIDATE_PROTOCOL", "")})
    ok = [r for r in ranks if r["outcome"] == "ok"]
    if not ok:
        return row
    device = "cuda" if backend == "cuda" else "cpu"
    state = [r["state"]["by_device"].get(device, 0) for r in ok]
    comm = [_comm_by_op(r["comm"]) for r in ok]
    comm_total = [sum(c.values()) for c in comm]
    busiest = max(range(len(ok)), key=lambda i: state[i])
    row.update({
        "measured_state_bytes": max(state),
        "measured_state_min_bytes": min(state),
        "measured_scalar_bytes": max(r["state"]["scalar_bytes"] for r in ok),
        "measured_host_state_bytes": max(r["state"]["by_device"].get("cpu", 0) for r in ok) if device == "cuda" else "",
        "measured_comm_bytes": max(comm_total),
        "measured_comm_by_op": json.dumps(comm[busiest], sort_keys=True),
        "measured_comm_detail": json.dumps(ok[busiest]["comm"], sort_keys=True),
        "measured_state_detail": json.dumps(ok[busiest]["state"]["by_path"], sort_keys=True),
        "loss_first": ok[0]["losses"][0],
        "loss_last": ok[0]["losses"][-1],
        "losses": json.dumps([round(x, 4) for x in ok[0]["losses"]]),
        "param_tensors": ok[0].get("param_tensors", ""),
        "sharded_param_tensors": ok[0].get("sharded_param_tensors", ""),
    })
    for name in ("trainer_phased_s", "trainer_host_s"):   # a Trainer job's calls per step (hf_trainer.TrainerClock)
        if ok[0].get(name):
            row[f"measured_{name}"] = json.dumps(ok[0][name], sort_keys=True)
    row.update(host_columns([r["host_memory"] for r in ok if r.get("host_memory")]))
    mem = [r["memory"] for r in ok if r.get("memory")]
    if mem:
        row["measured_peak_allocated_bytes"] = max(m["peak_allocated"] for m in mem)
        row["measured_peak_reserved_bytes"] = max(m["peak_reserved"] for m in mem)
        row["measured_alloc_retries"] = max(m["alloc_retries"] for m in mem)
        row["measured_base_allocated_bytes"] = max(m["base_allocated"] for m in mem)
        for ph in PHASES + tuple("first_" + p for p in PHASES[1:]):
            vals = [m["phases"][ph] for m in mem if ph in m["phases"]]
            if vals:
                row[f"measured_{ph}_peak_bytes"] = max(v["peak_allocated"] for v in vals)
                row[f"measured_{ph}_end_bytes"] = max(v["end_allocated"] for v in vals)
                # Which phase grows the allocator's cache: the reserved peak is set in init and the
                # warm-up steps (first_*), not in the measured steps (data/snapshots/).
                row[f"measured_{ph}_reserved_bytes"] = max(v["peak_reserved"] for v in vals)
        slowest = max(ok, key=lambda r: r["step_s"])
        row["measured_step_s"] = slowest["step_s"]
        row["measured_step_times_s"] = json.dumps([round(t, 6) for t in slowest.get("step_times_s", [])])
        # per timed step: the host's launch speed just before it, the slowest of the ranks' (the ranks
        # wait for each other in every collective, so the slower host sets the pace), and where the
        # slowest step's rank spent its host time (measure.HostCounters; data/README.md)
        issue = _every_ranks_probes(ok, "host_issue_s")
        if issue:
            row["measured_step_issue_us"] = json.dumps([round(max(t) * 1e6, 3) for t in zip(*issue)])
            # every rank's probes too, in rank order: at N = 2 the slower rank's ran 11-12 us where the
            # host's N = 1 rows probed 10-11 (data/README.md, t9), so whether the max, the mean or one
            # rank follows the step best is still open
            if len(issue) > 1:
                row["measured_step_issue_by_rank_us"] = json.dumps([[round(t * 1e6, 3) for t in i] for i in issue])
        # per timed step: the host's Python speed just before it (measure.host_python_s), the slowest rank's
        python = _every_ranks_probes(ok, "host_python_s")
        if python:
            row["measured_step_python_us"] = json.dumps([round(max(t) * 1e6, 4) for t in zip(*python)])
        if slowest.get("main_cpu") is not None:   # VALIDATE_PIN_CPUS=main: timed with the main thread alone on a core
            row["cpus"] = f"{row.get('cpus') or ''}, main thread alone on CPU {slowest['main_cpu']}".lstrip(", ")
        if slowest.get("step_host_s"):
            row["measured_step_host_s"] = json.dumps([round(t, 6) for t in slowest["step_host_s"]])
        for name in ("runq_s", "steal_s", "gc_s", "sm_mhz"):
            values = [c[name] for c in slowest.get("step_counters", [])]
            if values and None not in values:
                row[f"measured_step_{name}"] = json.dumps([round(v, 6) for v in values])
        probe = slowest.get("probe") or {}
        if probe:   # the slowest rank's host and GPU speed beside its step times
            row["measured_launch_us"] = round(probe["launch_s"] * 1e6, 3)
            row["measured_matmul_tflops"] = round(probe["matmul_flops_per_s"] / 1e12, 1)
        for ph in ("forward", "backward", "step"):
            col = "measured_step_phase_s" if ph == "step" else f"measured_{ph}_s"
            row[col] = max(m["phase_seconds"].get(ph, 0) for m in mem)
        # What the device holds beyond PyTorch's cache: CUDA context, NCCL, cuBLAS workspaces.
        row["measured_device_overhead_bytes"] = max(m["device_used_bytes"] - m["reserved_now"] for m in mem)
    return row


def host_columns(hosts: list[dict]) -> dict:
    """The HOST_COLUMNS from every rank's `HostRecorder.summary()`: the busiest rank's (highest peak)."""
    if not hosts:
        return {}

    def peak(h):
        return max((h["phases"][ph]["hwm_bytes"] or 0) for ph in HOST_PHASES[1:] if ph in h["phases"])
    busiest = max(hosts, key=peak)
    ph = busiest["phases"]
    seen = [p for p in HOST_PHASES[1:] if p in ph]
    out = {"measured_host_peak_bytes": peak(busiest),
           "measured_host_peak_phase": max(seen, key=lambda p: ph[p]["hwm_bytes"] or 0),
           "measured_host_baseline_bytes": ph["start"]["rss_bytes"],
           "measured_host_node_peak_bytes": sum(peak(h) for h in hosts),
           "measured_host_pinned_bytes": max((ph[p]["pinned_bytes"] or 0) for p in seen) or "",
           "measured_host_ds_pinned_bytes": ph[seen[-1]]["ds_pinned_bytes"],
           "measured_host_available_min_bytes": min(h["phases"][p]["available_bytes"] or 0 for h in hosts
                                                    for p in h["phases"]),
           "measured_host_total_bytes": ph["start"]["total_bytes"],
           "measured_host_hwm_reset": all(h["hwm_reset"] for h in hosts)}
    for p in seen:
        out[f"measured_host_{p}_hwm_bytes"] = ph[p]["hwm_bytes"]
        out[f"measured_host_{p}_rss_bytes"] = ph[p]["rss_bytes"]
        out[f"measured_host_{p}_pinned_bytes"] = ph[p]["pinned_bytes"]
    return out


def failed_row(job: dict, outcome: str, log_tail: str, backend: str, command: str) -> dict:
    row, spec, setup = _config(job, backend)
    row.update(_predicted(spec, setup, backend))
    lines = [ln for ln in log_tail.splitlines() if ln.strip()]
    row.update(outcome=outcome, error=" | ".join(lines[-3:])[:500], command=command)
    return row


def describe(row: dict) -> str:
    if row["outcome"] != "ok":
        return f"{row['outcome']}: {row.get('error', '')[:120]}"
    s = f"state {row['measured_state_bytes']:,} vs {row['predicted_state_bytes']:,}, " \
        f"comm {row['measured_comm_bytes']:,} vs {row['predicted_comm_bytes']:,}"
    if row.get("measured_peak_allocated_bytes"):
        predicted = row.get("predicted_peak_allocated_bytes")
        s += f", peak {row['measured_peak_allocated_bytes'] / 2**30:.2f} vs " + \
             (f"{predicted / 2**30:.2f} GiB" if predicted else "(not predicted) GiB") + \
             f", reserved {row['measured_peak_reserved_bytes'] / 2**30:.2f} GiB, {row['measured_step_s'] * 1e3:.0f} ms/step"
    if row.get("measured_host_peak_bytes") and row.get("predicted_host_peak_bytes"):
        s += f", host peak {row['measured_host_peak_bytes'] / 2**30:.2f} vs {row['predicted_host_peak_bytes'] / 2**30:.2f} GiB"
    return s


def job_from_row(row: dict) -> dict:
    """The job a CSV row measured, to predict it again with the current zerocalc. Columns a row lacks or
    leaves empty (written before a Setup or Architecture field existed, or read beside newer files)
    take the field's default (None for a dimension a probed model of the user's own has not)."""
    from dataclasses import MISSING, fields
    from zerocalc.arch import Architecture
    from zerocalc.training import Setup
    arch = {f.name: _cast(row.get(f.name), _field_kind(f)) for f in fields(Architecture)}
    arch = {f.name: (None if f.default is MISSING else f.default) if arch[f.name] is None else arch[f.name]
            for f in fields(Architecture)}
    job = {"key": row["key"], "nproc": int(row["nproc"]), "stage": int(row["stage"]), "optimizer": row["optimizer"],
           "arch": arch}
    for f in fields(Setup):
        if f.name in SETUP_FIELDS:
            value = _cast(row.get(f.name), _field_kind(f))
            job[f.name] = f.default if value is None else value
    nodes = _cast(row.get("nodes"), int)
    if nodes and nodes > 1:
        job["nodes"] = nodes
    if is_hf_row(row):
        job["path"] = row.get("path") or "engine"
        config = row.get("hf_config")
        job["hf"] = {"name": row.get("hf_name"),
                     "config": json.loads(config) if isinstance(config, str) and config.startswith("{") else {}}
        if isinstance(row.get("hf_spec"), str) and row["hf_spec"].startswith("{"):
            job["hf_spec"] = json.loads(row["hf_spec"])
        for key in ("lora", "freeze"):
            if isinstance(row.get(key), str) and row[key][:1] in ("{", "["):   # not "": every str holds it
                job[key] = json.loads(row[key])
        leaves = row.get("z3_leaf_modules")
        if isinstance(leaves, str) and leaves.startswith("["):   # the stage-3 leaf classes the run set
            job["z3_leaf_modules"] = json.loads(leaves)
    return job


def is_hf_row(row: dict) -> bool:
    """A row of an HF config (validate/hf_models.py) or of a model recorded as it ran (a probed job of the
    user's own, `zerocalc.probe`: `hf_spec` without a config) rather than a transcribed family."""
    return any(isinstance(row.get(c), str) and row[c].startswith("{") for c in ("hf_config", "hf_spec"))


def measured_host_launch_s(row: dict) -> float | None:
    """How fast the row's host issued work while its steps were timed: seconds to issue one tiny kernel,
    the median of the probes taken just before each timed step (`measured_step_issue_us`, rows from
    the t6 files on); None for a row without them. The one probe taken before the timed steps
    (`measured_launch_us`) is not used: on these VMs the host's speed often changed between it and
    the steps (9.7 us before, 7.3 during)."""
    import statistics
    per_step = row.get("measured_step_issue_us")
    if isinstance(per_step, str) and per_step.startswith("["):
        values = json.loads(per_step)
        if values:
            return statistics.median(values) * 1e-6
    return None


def at_row_host(cal: dict, row: dict) -> dict:
    """cal with the row's measured host launch speed as the host's (`zerocalc.timing.host_scale`);
    cal itself for a row without per-step probes (taken as the fitted hosts' median)."""
    launch = measured_host_launch_s(row)
    return cal if launch is None else {**cal, "time": {**cal["time"], "host_launch_s": launch}}


def h200_of(row: dict, dp: int):
    """The H200 the validator's rows ran on, with the row's node layout: `nodes` > 1 puts N / nodes
    ranks on each node, so collectives across them run at the network's pace (zerocalc.measured)."""
    from zerocalc.hardware import gpu
    from zerocalc.measured import hardware_of
    nodes = _cast(row.get("nodes"), int) or 1
    return hardware_of({"nodes": str(nodes), "_where": row.get("source") or "a row"}, gpu("h200"), dp)
