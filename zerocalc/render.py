"""Estimates as a table, JSON (the contract other tools rely on) or CSV."""
import csv
import io
import json
import re

from dataclasses import fields

from zerocalc import __version__, DEEPSPEED_VERSION, reference
from zerocalc.estimate import COMMON_GPU_MEMORY
from zerocalc.timing import StepTime, accuracy_regime
from zerocalc.training import Stage
from zerocalc.units import gb, gib

COLUMNS = ("stage", "offload", "params", "grads", "optim", "buffers", "activ", "peak", "peak phase", "reserved",
           "paper", "comm GB", "×P", "host/rank", "host/node", "fits")


def _inputs(e) -> dict:
    s, m = e.setup, e.model
    inputs = {k: v for k, v in s.__dict__.items() if k not in ("stage", "optimizer", "extra")}
    inputs.update(optimizer=s.optimizer.name, optimizer_state_bytes_per_param=s.optimizer.state_bytes_per_param,
                  overlap_comm=s.overlap, model=m.name, num_params=m.num_params, num_param_tensors=len(m.param_numels),
                  gpu_memory_bytes=e.gpu_memory_bytes, deepspeed_version=DEEPSPEED_VERSION,
                  trainable_params=m.num_trainable, frozen_params=m.num_frozen)
    if m.architecture is not None:
        inputs["architecture"] = m.architecture.as_dict()
    return inputs


def shape_note(m) -> str | None:
    """What a model given by --params is taken to look like where activations or step time need a shape
    (`model.shaped`), None for a model given by its architecture."""
    a = m.architecture
    if a is None or m.name != "P-only model":
        return None
    return (f"--params: activations and step time assume a Llama-like shape of exactly P: {a.num_layers} layers × "
            f"{a.hidden_size} hidden, FFN {a.ffn_hidden_size}, vocabulary {a.vocab_size}")


def as_json(estimates, host_note: str | None = None) -> str:
    inputs = _inputs(estimates[0])
    inputs.update(host_memory_bytes=estimates[0].host_memory_bytes, host_memory_source=host_note,
                  ranks_per_node=estimates[0].host_ranks)
    doc = {"zerocalc_version": __version__, "inputs": inputs,
           "estimates": [e.as_dict() for e in estimates]}
    return json.dumps(doc, indent=2)


def duration(seconds: float) -> str:
    """A step time for people: ms under a second, s under two minutes, then min, then h."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _fits(e) -> str:
    """estimate's fits rule: NO, yes, or tight (fits at the predicted reserved, not at its worst measured miss)."""
    return "" if e.fits is None else f"NO ({', '.join(e.fails_on)})" if not e.fits else \
        "yes" if e.fits_worst_case else "tight"


def _fits_note(estimates) -> list[str]:
    """What the fits column means: reserved against the card, unless a row's verdict took the
    allocator's replay against it (`Estimate.at_capacity`: simulated, its reserved past the card)."""
    if all(e.at_capacity is None for e in estimates):
        return ["fits = reserved + CUDA context/NCCL <= --gpu-memory (tight: not at the worst miss of the reserved",
                "prediction measured, which can OOM);"]
    where = "" if {e.fits_source for e in estimates} == {"allocator"} else \
        " (where simulated; else reserved + CUDA context/NCCL <= --gpu-memory)"
    return ["fits = reserved + CUDA context/NCCL <= --gpu-memory, or else the job's allocation sequence runs on",
            f"--gpu-memory less CUDA context/NCCL without OOM{where}, the allocator freeing its cached segments",
            "and retrying where a cudaMalloc fails, as PyTorch's does, stage 3's gathered parameters freed on",
            "time or late, the segments made after a retry placed in the freed ranges or not (tight: runs",
            "only thanks to those retries, or not at the worst miss of the reserved prediction measured,",
            "which can OOM);"]


def _fits_on(e) -> str:
    """The smallest common GPU memory it fits on; "24 GB tight, 32 GB": on 24 GB only at the predicted
    reserved, on 32 GB at its worst measured miss too."""
    if e.fits_on is None:
        return f"> {list(COMMON_GPU_MEMORY)[-1]}"
    if e.fits_on == e.fits_on_worst_case:
        return e.fits_on
    return f"{e.fits_on} tight, {e.fits_on_worst_case or '> ' + list(COMMON_GPU_MEMORY)[-1]}"


def _row(e) -> list[str]:
    """The table's row: read from the estimate's properties, not `as_dict` (whose headroom may take a
    bisection of allocator replays that the table does not show)."""
    pr = e.per_rank_bytes()
    offload = "/".join(x for x in (e.setup.offload_optimizer, e.setup.offload_param) if x != "none") or "-"
    fits = _fits_on(e) if e.gpu_memory_bytes is None else _fits(e)
    if e.gpu_memory_bytes is None and e.fits_host is False:
        fits += " (host: NO)"
    act = "" if pr["activations"] is None else f"{gib(pr['activations']):.2f}"
    paper = reference.paper_model_states_bytes(e.model.num_params, e.setup.dp, e.setup.stage)
    return [str(int(e.setup.stage)), offload, f"{gib(pr['params']):.2f}", f"{gib(pr['gradients']):.2f}",
            f"{gib(pr['optimizer_states']):.2f}", f"{gib(pr['buffers']):.2f}", act,
            f"{gib(e.peak_bytes):.2f}", e.peak.name, f"{gib(e.peak_reserved_bytes):.2f}", f"{gib(paper):.2f}",
            f"{gb(e.comm_bytes):.2f}", f"{e.comm_volume_over_params:.2f}",
            f"{gib(e.host.peak_bytes):.1f}", f"{gib(e.host_node_bytes):.1f}", fits]


def _legend(estimates) -> list[str]:
    """What each column of `as_table` counts (`estimate --explain`)."""
    e0 = estimates[0]
    sources = {e.reserved_source for e in estimates}
    lines = ["GiB per rank: params, grads and buffers at their largest in a step, optim = fp32 master + moments;",
             "peak = predicted max_memory_allocated and the phase that sets it; reserved = max_memory_reserved;",
             *(_fits_note(estimates) if e0.gpu_memory_bytes is not None else
               ["fits on = the smallest GPU (16-80 GB, 141 GB) holding reserved + CUDA context/NCCL (tight: not at",
                "the reserved prediction's worst measured miss, which can OOM; then the one that holds that too);"]),
             "paper = ZeRO paper figure 1 (2+2+12 bytes/param);",
             "comm = logged GB per optimizer step per rank; ×P = ring wire volume / (P · comm dtype bytes);",
             "host/rank = the process's peak resident host memory (runtime, the model built on the CPU, DeepSpeed's",
             f"pinned and pageable buffers; docs/host-memory.md); host/node = host/rank × {e0.host_ranks} ranks per node;",
             "fits also needs host/node <= --host-memory where given, and NO names the side that does not fit.",
             "reserved: " + ("the job's allocation sequence through PyTorch's caching allocator, simulated"
                             if sources == {"simulated"} else "allocated × the reserved/allocated ratio measured "
                             "on H200" if sources == {"ratio"} else "simulated from the allocation sequence "
                             "where it is generated, a measured ratio elsewhere") + " (docs/reserved-memory.md)."]
    for e in estimates:
        late = e.peak_reserved_late_bytes
        if late is not None:
            from zerocalc.fits import LATE_RESERVED_DELAY    # simulated: the replay is imported already
            lines += [f"stage {e.setup.stage:d}: reserved {gib(late):.2f} GiB where the GPU returns released gathered "
                      f"parameters {LATE_RESERVED_DELAY} allocations late;",
                      "  runs measured at N >= 8 reserved within 8% of the range from the reserved column to that, "
                      "by their timing (docs/scale.md)."]
    return lines


def as_table(estimates, host_note: str | None = None, explain: bool = False) -> str:
    """The table and the notes that concern this answer; `explain`: the column legend too."""
    e0 = estimates[0]
    s, m = e0.setup, e0.model
    head = (f"{m.name}: P = {m.num_params:,} ({m.num_params / 1e9:.3g}B), N = {s.dp}, {s.dtype}, "
            f"{s.optimizer.name}, GAS {s.gas}, micro-batch {s.micro_batch}"
            + (f", seq {s.seq_len}" if s.seq_len else "")
            + (", expandable_segments allocator" if s.expandable_segments else "") + f"  [DeepSpeed {DEEPSPEED_VERSION}]")
    if m.frozen:
        head += f"\ntrainable {m.num_trainable:,} ({m.num_trainable / m.num_params:.2%}), frozen {m.num_frozen:,}"
    columns = list(COLUMNS[:-1]) + ["fits" if e0.gpu_memory_bytes is not None else "fits on"]
    rows = [columns] + [_row(e) for e in estimates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    note = shape_note(m)
    lines = [head] + ([note] if note else []) + [""]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if explain:
        lines += _legend(estimates)
    elif any(e.at_capacity is not None for e in estimates):   # a verdict this answer took from the allocator
        lines += _fits_note(estimates)
    offloaded = (("optim with optimizer offload", "offload_optimizer"), ("params with parameter offload", "offload_param"))
    on_host, on_nvme = ([what for what, kind in offloaded if any(_offloaded_to(e.setup, kind) == device for e in estimates)]
                        for device in ("cpu", "nvme"))
    if on_host:     # the columns are the states' sizes wherever they live; peak is the GPU's
        lines.append(f"offload: in host memory, counted in host/rank, not in peak or reserved: {', '.join(on_host)}.")
    if on_nvme:
        lines.append(f"offload to NVMe: on disk (host.nvme_bytes in --format json), not in host/rank, peak or reserved: "
                     f"{', '.join(on_nvme)}.")
    if e0.host_memory_bytes is not None:
        lines.append(f"Host memory: {gib(e0.host_memory_bytes):.0f} GiB per node"
                     + (f" ({host_note})" if host_note else "") + ".")
    for e in estimates:
        a = e.at_capacity
        if a is not None and a.timing_dependent and a.oom_placement == "below":
            lines += [f"stage {e.setup.stage:d}: NO (GPU): it runs only if cudaMalloc puts the segments it makes after "
                      "freeing its cache into the ranges it freed;",
                      f"  whether such a job runs out depends on where the driver places them; {-e.headroom_bytes / 2**30:.2f} "
                      "GiB more runs either way."]
        elif a is not None and a.timing_dependent:
            lines += [f"stage {e.setup.stage:d}: NO (GPU): it runs with the all-gather stream's frees on time, not "
                      f"{a.oom_delay} allocations late;",
                      f"  whether such a job runs out depends on the GPU's timing; {-e.headroom_bytes / 2**30:.2f} GiB "
                      "more runs under every timing."]
    tight = [e for e in estimates if e.fits and not e.fits_worst_case and not e.setup.expandable_segments]
    if tight:
        lines.append("tight: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lowered reserved on every H200 "
                     "configuration tried; --expandable-segments estimates it.")
    why = {e.peak.why for e in estimates}
    lines += [f"Peak set by: stage {e.setup.stage:d} {e.peak.name}: {e.peak.why}" for e in estimates] if len(why) > 1 \
        else [f"Peak set by {e0.peak.name}: {e0.peak.why}"]
    if e0.hardware is not None and e0.time is not None:
        lines.append("")
        k = e0.cal["time"]
        launch_s = k.get("host_launch_s") or k.get("host_launch_s_fitted")
        host = f"; a host issuing a kernel in {launch_s * 1e6:.1f} us" if launch_s else ""
        lines.append(f"Step time on {e0.hardware.name} (calibrated on {_calibrated_on(e0.cal)}{host}):")
        for e in estimates:
            t = e.time
            calls = f", all-gather calls {t.gather_calls_share:5.1%}" if e.setup.stage == 3 else ""
            lines.append(f"  stage {e.setup.stage:d}: {duration(t.step_s):>9}/step, {t.tokens_per_s:10,.0f} tokens/s, "
                         f"MFU {t.mfu:5.1%}, waiting on the wire {t.wire_share:5.1%}{calls} of the step")
        if any(e.setup.stage == 3 for e in estimates):
            lines.append("  all-gather calls = stage 3's cost per all-gather call (its hook issuing it and waiting), "
                         "not wire time.")
        acc = k.get("accuracy")
        if acc:
            shipped = "calibrated_on" not in e0.cal
            lines.append(f"Measured: {acc['within_15pct']} of {acc['rows']} {'H200 ' if shipped else ''}steps within 15% of "
                         f"this model (mean {acc['mean_abs_error']:.0%}){_by_configuration(acc)}" + (
                             "; small and stage-3 steps are host-bound and follow the host's speed, which drifted "
                             "7-25 us per launch on those VMs (--host-launch-us)." if shipped else
                             f", on the rows it was calibrated on ({e0.cal['calibrated_on']})."))
            lines += _by_regime(acc, estimates, "H200 steps" if shipped else "steps")
    elif e0.hardware is not None:
        lines.append("Step time needs an architecture and --seq-len.")
    if e0.activation_bytes is None:
        lines.append("Activations are not counted: give --model/--hf-config with --seq-len and --micro-batch.")
    if e0.setup.dp == 1:
        lines.append("N = 1: DeepSpeed still calls its collectives on the one rank (comm GB, as its comms logger "
                     "counts them); nothing crosses a wire (×P 0).")
    if e0.gpu_memory_bytes is None:
        lines.append("To check one GPU, give its memory (--gpu-memory 32GiB: a 32 GB card; 32GB is 32e9 bytes) "
                     "or --gpu.")
    if not explain:
        lines.append("What each column counts: --explain.")
    return "\n".join(lines)


# The JSON's time section, one column each (empty without --gpu, an architecture and --seq-len).
TIME_COLUMNS = tuple(f.name for f in fields(StepTime)) + ("wire_share", "gather_calls_share")


def as_csv(estimates) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["stage", "offload_optimizer", "offload_param", "params_bytes", "gradients_bytes",
                "optimizer_states_bytes", "buffers_bytes", "activations_bytes", "total_bytes", "peak_bytes",
                "peak_phase", "peak_reserved_bytes", "paper_model_states_bytes", "comm_bytes_per_step",
                "comm_volume_over_params", "fits", "fits_worst_case", "fits_on_gpu_memory_bytes",
                "fits_on_worst_case_gpu_memory_bytes", *TIME_COLUMNS, "host_peak_bytes_per_rank",
                "host_bytes_per_node", "fits_host", "fits_source", "headroom_bytes", "alloc_retries",
                "trainable_params", "frozen_params"])
    blank = lambda v: "" if v is None else v  # noqa: E731
    for e in estimates:
        d = e.as_dict()
        pr = d["per_rank_bytes"]
        time = d["time"] or {}
        w.writerow([d["stage"], d["offload_optimizer"], d["offload_param"], pr["params"], pr["gradients"],
                    pr["optimizer_states"], pr["buffers"], blank(pr["activations"]),
                    pr["total"], d["peak_bytes"], d["peak_phase"], d["peak_reserved_bytes"],
                    int(d["paper"]["model_states_bytes"]),
                    d["comm"]["bytes_per_rank_per_step"], round(d["comm"]["volume_over_params"], 6),
                    blank(d["fits"]), blank(d["fits_worst_case"]), blank(d["fits_on_gpu_memory_bytes"]),
                    blank(d["fits_on_worst_case_gpu_memory_bytes"]), *(blank(time.get(k)) for k in TIME_COLUMNS),
                    d["host"]["peak_bytes"], d["host"]["node_bytes"], blank(d["fits_host"]), blank(d["fits_source"]),
                    blank(d["headroom_bytes"]), blank(d["alloc_retries"]), e.model.num_trainable, e.model.num_frozen])
    return buf.getvalue().rstrip("\n")


def render(estimates, fmt: str, host_note: str | None = None, explain: bool = False) -> str:
    """host_note: where the host's memory came from when the user did not give it (a preset's
    assumption); the table prints it, JSON carries it in inputs. explain: the table's column legend."""
    if fmt == "table":
        return as_table(estimates, host_note, explain)
    if fmt == "json":
        return as_json(estimates, host_note)
    return as_csv(estimates)


def _plan_row(c, price):
    s, t = c.setup, c.estimate.time
    offload = "/".join(x for x in (s.offload_optimizer, s.offload_param) if x != "none") or "-"
    row = [str(s.dp), str(int(s.stage)), offload, str(s.micro_batch), str(s.gas), "yes" if s.activation_checkpointing
           else "no", f"{gib(c.estimate.device_bytes):.1f}", f"{gib(c.estimate.host_node_bytes):.0f}",
           _fits(c.estimate), duration(t.step_s),
           f"{t.tokens_per_s:,.0f}", f"{t.mfu:.1%}", f"{t.wire_share:.0%}",
           f"{t.gather_calls_share:.0%}" if s.stage == 3 else "-"]
    if price:
        row.append(f"{c.cost_per_mtoken(price):.3f}")
    return row


def plan(spec, hw, memory_bytes, ranked, rejected, price, fmt, note=None, fewest=False, host_memory_bytes=None,
         host_note=None) -> str:
    if fmt == "json":
        def one(c):
            d = {k: v for k, v in c.setup.__dict__.items() if k not in ("optimizer", "extra")}
            d["stage"] = int(c.setup.stage)
            d["device_bytes"] = c.estimate.device_bytes if c.estimate else None
            d["peak_bytes"] = c.estimate.peak_bytes if c.estimate else None
            d["host_bytes_per_rank"] = c.estimate.host.peak_bytes if c.estimate else None
            d["host_bytes_per_node"] = c.estimate.host_node_bytes if c.estimate else None
            d["fits"] = c.estimate.fits if c.estimate else None
            d["fits_worst_case"] = c.estimate.fits_worst_case if c.estimate else None
            d["fits_source"] = c.estimate.fits_source if c.estimate else None
            d["alloc_retries"] = c.estimate.alloc_retries if c.estimate else None
            d["time"] = c.estimate.time.as_dict() if c.estimate and c.estimate.time else None
            d["rejected"] = c.rejected
            return d
        doc = {"zerocalc_version": __version__, "model": spec.name, "num_params": spec.num_params,
               "trainable_params": spec.num_trainable, "frozen_params": spec.num_frozen, "gpu": hw.name,
               "gpu_memory_bytes": memory_bytes, "host_memory_bytes": host_memory_bytes,
               "host_memory_source": host_note, "note": note, "ranked": [one(c) for c in ranked]}
        if rejected is not None:
            doc["rejected"] = [one(c) for c in rejected if c.rejected]
        return json.dumps(doc, indent=2)
    head = ["GPUs", "stage", "offload", "micro", "GAS", "ckpt", "GiB/GPU", "host/node", "fits", "step", "tokens/s",
            "MFU", "wire", "calls"]
    if price:
        head.append("$/Mtok")
    rows = [head] + [_plan_row(c, price) for c in ranked]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"{spec.name}: P = {spec.num_params:,}"
             + (f" ({spec.num_trainable:,} trainable)" if spec.frozen else "") + f" on {hw.name} ({gib(memory_bytes):.0f} GiB), "
             f"{'fewest GPUs' if fewest else 'ranked by ' + ('cost' if price else 'throughput')}", ""]
    if note:
        lines.insert(1, note)
    if not ranked:
        lines.append("Nothing fits: raise --max-gpus, shorten --seq-len, or see --explain.")
    for i, r in enumerate(rows if ranked else []):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if rejected is not None:   # --explain: what each column counts
        lines += ["GiB/GPU = predicted reserved peak + CUDA context, and fits: yes, or tight (not at the reserved",
                  "prediction's worst measured miss, which can OOM), both as `estimate` gives them for the row's setup",
                  "(candidates are screened with a calibrated reserved ratio; a row the allocator simulation rejects is",
                  "dropped: --explain lists it);",
                  "step = one optimizer step; wire = share of the step waiting on bytes crossing the link; calls = stage 3's",
                  "share spent per all-gather call (its hook issuing it and waiting), not wire time;",
                  "host/node = GiB of host memory per node: each rank's peak resident set × its ranks (docs/host-memory.md)."]
    if any(c.estimate.at_capacity is not None for c in ranked):
        lines.append("A row whose GiB/GPU exceeds the card runs only because the allocator frees its cached segments "
                     "and retries a failed cudaMalloc, as PyTorch's does: tight (docs/reserved-memory.md).")
    if host_memory_bytes is not None:
        lines.append(f"Host memory: {gib(host_memory_bytes):.0f} GiB per node" + (f" ({host_note})." if host_note else "."))
    acc = ranked[0].estimate.cal["time"].get("accuracy") if ranked else None
    if acc:
        lines.append(f"Step time calibrated on {_calibrated_on(ranked[0].estimate.cal)}: {acc['within_15pct']} of "
                     f"{acc['rows']} measured steps within 15% of the model (mean {acc['mean_abs_error']:.0%}"
                     f"{_by_configuration(acc)}; README).")
    if rejected is not None:
        lines += _rejections([c for c in rejected if c.rejected])
    else:
        lines.append("What each column counts, and every setup left out and why: --explain.")
    return "\n".join(lines)


def _rejected_setup(c) -> str:
    s = c.setup
    return (f"{s.dp} GPUs stage {int(s.stage)} offload {s.offload_optimizer}/{s.offload_param} micro {s.micro_batch} "
            f"ckpt {'on' if s.activation_checkpointing else 'off'}: {c.rejected}")


def _rejections(rejected) -> list[str]:
    """`plan --explain`'s rejected setups grouped by reason (its numbers aside), most common first, each
    with the one closest to fitting (the least memory; else the fewest GPUs)."""
    groups: dict[str, list] = {}
    for c in rejected:
        groups.setdefault(re.sub(r"\d[\d,.]*", "…", c.rejected), []).append(c)
    lines = ["", f"Rejected: {len(rejected)} setups, by reason (the one closest to fitting under each):"]
    for reason, cs in sorted(groups.items(), key=lambda g: -len(g[1])):
        closest = min(cs, key=lambda c: (c.estimate.device_bytes if c.estimate else 0, c.setup.dp))
        lines += [f"  {len(cs):4d} × {reason}", f"         e.g. {_rejected_setup(closest)}"]
    return lines


def _calibrated_on(cal: dict) -> str:
    """What the calibration's time constants were fitted on: the shipped H200 runs, or the rows a user's
    calibration names (`zerocalc calibrate`)."""
    return cal.get("calibrated_on", "H200 runs")


def _by_regime(acc: dict, estimates, steps: str = "H200 steps") -> list[str]:
    """The calibration's accuracy for the regimes these estimates fall in (`timing.accuracy_regime`)."""
    by = acc.get("by_regime") or {}
    offloaded = lambda s: (s.offload_optimizer, s.offload_param) != ("none", "none")  # noqa: E731
    seen = dict.fromkeys(accuracy_regime(e.setup.stage, e.setup.dp, offloaded(e.setup)) for e in estimates)
    parts = [f"{r}: {by[r]['within_15pct']} of {by[r]['rows']} (mean {by[r]['mean_abs_error']:.0%})"
             for r in seen if r in by]
    at_two = " (N > 1 measured at N = 2 only)" if steps == "H200 steps" else ""
    return [f"  by regime, {steps} within 15%{at_two}: {'; '.join(parts)}"] if parts else []


def _by_configuration(acc: dict) -> str:
    """The calibration's per-configuration accuracy (the median of a configuration's jobs), where it has one."""
    if "configurations" not in acc:
        return ""
    return f"; {acc['configurations_within_15pct']} of {acc['configurations']} configurations by the median of their jobs"


def _offloaded_to(setup, kind: str) -> str:
    """Where an offload puts its states: stages 1-2 keep the optimizer's in host memory whatever the
    device (DeepSpeed 0.19.8 stage_1_and_2.py: any device but "none" is CPU offload)."""
    device = getattr(setup, kind)
    return "cpu" if device == "nvme" and setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS) else device
