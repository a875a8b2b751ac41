"""`python -m validate fit`: the few constants the closed form cannot know, by least squares on a
training split of the measured GPU rows; the held-out split is reported, never fitted.

Constants (all named in the calibration JSON):
- activations.hf-llama.h, .kv: bytes per token per layer of Llama's attention and RMSNorm part in
  units of the dtype (the MLP's 4f is counted by hand), from the memory at the end of forward.
- allocator.reserved_over_allocated: PyTorch's caching allocator keeps freed blocks; where zerocalc
  does not simulate the allocation sequence (no architecture given, stage 3 with GAS > 1, parameter
  offload at N > 1, ...: `zerocalc.sequence.generated`), reserved peak ≈ ratio · allocated peak,
  fitted on every clean row without parameter offload (the simulation now covers nearly all of them,
  so the rows it leaves are too few to fit on), in relative error (reserved_extra_bytes, an offset, is
  kept at 0);
  reserved_over_allocated_worst, the largest measured ratio over all clean rows, for the "tight" verdict.
- allocator_param_offload.reserved_over_allocated: the same ratio on the rows with stage 3's parameter
  offload, which the default ratio's fit leaves out (their init holds the whole module before the
  partitions move to the host: 1.43-1.75× on H200).
- allocator_simulated.measured_over_simulated_worst: the largest measured/simulated reserved over the
  clean rows zerocalc simulates (either allocator setting), for their "tight" verdict.
- allocator_expandable.factor: what PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True does to the
  reserved/allocated ratio where the allocation sequence is not simulated: the mean, over the
  configurations run with both allocators, of the one ratio over the other (each configuration's rows
  averaged); applied to `allocator` or `allocator_param_offload`. Its worst: the largest ratio measured
  with the flag.
- device.context_bytes: what the GPU holds outside PyTorch's cache (CUDA context, NCCL, cuBLAS
  workspaces), the median of `measured_device_overhead_bytes`.
- time.*: the step-time model's constants (`zerocalc/timing.py`; only the offload rows depend on,
  and so set, the three host_*_per_s rates), by Levenberg–Marquardt on the
  log ratio of predicted to measured forward, backward, optimizer-step and whole-step times of the
  training split's rows timed as training runs (`report.timed_whole_steps`; all constants positive,
  the link efficiency and host_launch_share at most 1, the efficiency at most the rows' measured matmul
  rate over peak, `matmul_ceiling`). The host-side ones are at
  `time.host_launch_s_fitted`, the rows' median host launch cost; a row probed before each timed step
  is fitted at its own (`rows.measured_host_launch_s`), of which the share `host_launch_share` of the
  host-side time follows (`timing.host_scale`; only the probed rows set it).
  Measured, not fitted: HF Trainer's own loop (`trainer_host_constants`) and the device's constants
  (`device_constants`: the traffic passes and an unaligned head's efficiency, from forwards and backwards
  timed without DeepSpeed, data/h200-kernel-time.jsonl, the matmuls at `matmul_ceiling`).
"""
import hashlib
import json
import os

import numpy as np
import pandas as pd

from validate.jobs import to_zerocalc
from validate.report import (configuration, earlier_jobs, expandable_rows, hf_rows, load, predicted_reserved, process_replays,
                             started_clean, timed_whole_steps, with_configuration)
from validate.results_file import replace_whole
from validate.rows import at_row_host, h200_of, is_hf_row, job_from_row, measured_host_launch_s
from zerocalc import calibrate, calibration, sequence
from zerocalc.estimate import estimate
from zerocalc.timing import STEP_CLASSES, accuracy_regime, features

FOLDS = 4


def fold(row: dict) -> int:
    """Which of FOLDS parts of the configurations the row is in, by a hash of what it ran
    (`report.configuration`, either allocator): every job of a configuration is in the same part,
    whatever its key. Fold 0 is the held-out split; `cross_validate_time` predicts each fold from the others."""
    conf = configuration(row, allocator=False)
    return int(hashlib.sha1(conf.encode()).hexdigest(), 16) % FOLDS


def held_out(row: dict) -> bool:
    """A fixed 25% of configurations, never used for fitting (fold 0). By the key, as before, 23 of the
    100 timed configurations had jobs on both sides (a repeat, or a key an older zerocalc made, hashes
    apart), so "held-out" rows had been fitted through their configuration's other jobs."""
    return fold(row) == 0


def held_out_rows(df: pd.DataFrame) -> pd.Series:
    return pd.Series([held_out(r.to_dict()) for _, r in df.iterrows()], index=df.index, dtype=bool)


def hf_timed_rows(paths) -> pd.DataFrame:
    """The HF configs' rows timed as training runs (alone on the GPU and host): the time fit takes them
    beside the transcribed families' (as `zerocalc estimate --hf-config` predicts them, from the traced
    config), split by the same folds; the memory constants do not (their activations are traced)."""
    df = load(paths)
    df = df[(df["outcome"] == "ok") & df["measured_peak_allocated_bytes"].notna() & hf_rows(df)].copy()
    df = df[timed_whole_steps(df)]
    df["held_out"] = held_out_rows(df)
    return df


def gpu_rows(paths) -> pd.DataFrame:
    """The GPU rows the fit uses: measured, of transcribed families (HF-config rows have no activation
    model yet: validate/hf_models.py)."""
    df = load(paths)
    df = df[(df["outcome"] == "ok") & df["measured_peak_allocated_bytes"].notna() & ~hf_rows(df)].copy()
    df["held_out"] = held_out_rows(df)
    return df


def _llama_activation_rows(df, cal):
    rows = []
    for _, r in df[(df["family"] == "hf-llama") & ~df["activation_checkpointing"].astype(bool)].iterrows():
        if int(r["stage"]) == 3 and int(r["nproc"]) > 1:
            continue   # gathered parameters sit beside the activations there
        if int(r["gas"]) > 1:
            continue   # the measured forward is the last micro-step's: earlier gradients sit beside it
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        resident = estimate(spec, setup, cal=cal).states.resident_bytes
        tokens = int(r["micro_batch"]) * int(r["seq_len"])
        kept = r["measured_forward_end_bytes"] - r["measured_base_allocated_bytes"] - resident
        units = (kept - 4 * tokens * int(r["vocab_size"])) / (2 * tokens * int(r["num_layers"]))
        a = spec.architecture
        f_units = cal["activations"]["hf-llama"]["f"] * a.ffn_hidden_size
        rows.append((a.hidden_size, a.num_kv_heads * a.head_dim, units - f_units, r["held_out"]))
    return rows


def time_features(df, cal=None):
    """`timing.features` of each row, on the row's own host speed where it was probed per step; an HF
    config's row as zerocalc traces its config (`hf_models.traced_spec`, what `--hf-config` predicts)."""
    from validate import hf_models
    cal = cal or calibration.default()
    rows = []
    for _, r in df.iterrows():
        job = job_from_row(r.to_dict())
        spec, setup = to_zerocalc(job)
        if is_hf_row(r.to_dict()):
            spec = hf_models.traced_spec(job)
        rows.append(features(spec, setup, estimate(spec, setup).collectives, h200_of(r.to_dict(), setup.dp),
                             at_row_host(cal, r.to_dict())))
    return rows


# HF Trainer's calls per step that are the engine's work, not the Trainer's own (hf_trainer.TrainerClock)
ENGINE_CALLS = ("loss", "backward", "step")


def trainer_host_constants(rows: pd.DataFrame, cal: dict) -> dict:
    """HF Trainer's own host work (`timing.trainer_host_s`), measured on the Trainer rows that probed each
    call Trainer makes in their timed steps (`measured_trainer_host_s`, `hf_trainer.TrainerClock`), at
    the fitted hosts' speed (each row's per-step launch probes, `timing.host_scale`): per micro-step,
    the step less the engine's calls (its forward with the loss, backward, step) and less zero_grad,
    which is per parameter tensor (`trainer_zero_grad_s_per_tensor`); each the median over the row's
    steps, then over the rows. {} without such rows."""
    from zerocalc.timing import host_scale
    k = cal["time"]
    loop, zero_grad = [], []
    for _, r in rows.iterrows():
        text = r.get("measured_trainer_host_s")
        if not isinstance(text, str) or not text.startswith("{"):
            continue
        calls = json.loads(text)
        launch, fitted = measured_host_launch_s(r.to_dict()), k.get("host_launch_s_fitted")
        h = host_scale(launch / fitted, k) if launch and fitted else 1.0
        own = [w - sum(calls[c][i] for c in ENGINE_CALLS + ("zero_grad",)) for i, w in enumerate(calls["whole"])]
        loop.append(float(np.median(own)) / int(r["gas"]) / h)
        zero_grad.append(float(np.median(calls["zero_grad"])) / int(r["param_tensors"]) / h)
    if not loop:
        return {}
    return {"trainer_s_per_micro_step": float(f"{np.median(loop):.4g}"),
            "trainer_zero_grad_s_per_tensor": float(f"{np.median(zero_grad):.4g}"), "trainer_rows": len(loop)}


KERNEL_TIME = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "h200-kernel-time.jsonl")
# What `device_constants` measures, held as measured in the time fit
DEVICE_CONSTANTS = ("efficiency", "activation_passes", "loss_passes", "backward_activation_passes", "loss_passes_backward",
                    "unaligned_head_efficiency", "grad_copy_passes")
# Stage-2 jobs timed beside the same models' plain backwards (`grad_copy_passes`)
STAGE2_BESIDE_KERNEL_TIME = os.path.join(os.path.dirname(KERNEL_TIME), "h200-hf-types-timed.csv")


def dense_and_fused(cfg: dict) -> bool:
    """Whether a model runs only what the device term counts: dense matmuls (no MoE's grouped expert
    matmuls) and attention in a fused kernel (no ALiBi bias). OLMoE's experts and Falcon-RW's ALiBi ran
    29% and 16% slower than it (data/h200-kernel-time.jsonl): the device term has no cost for those
    operators yet. Attention dropout costs little (StarCoder2's 0.1: -2%; Granite's: 4 of 55 ms)."""
    from validate import hf_models
    alibi = (cfg.get("alibi") or cfg.get("model_type") in ("bloom", "mpt")
             or cfg.get("position_embedding_type") == "alibi")
    return not (hf_models.moe_dims(cfg) or alibi)


def kernel_rows(path: str = KERNEL_TIME) -> list[dict]:
    """The phases `validate/gpu/kernel_time.py` measured, one line per model and checkpointing (a line
    that failed left out); [] without the file."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "error" not in r]


def kernel_row_config(r: dict) -> dict:
    """The config.json a kernel-time line ran (its matrix entry's overrides applied)."""
    from validate import hf_models
    return hf_models.load_config(r["hf"]["config"], r["hf"].get("overrides"))[1]


def kernel_row_features(r: dict) -> dict:
    """`timing.features` of a kernel-time line: its model traced, stage 0 on one H200, its tokens."""
    from validate import hf_models
    from validate.jobs import make_hf_job
    from zerocalc.hardware import gpu
    job = make_hf_job(r["hf"], 1, stage=0, micro_batch=r["micro_batch"], seq_len=r["seq_len"],
                      activation_checkpointing=r["checkpointing"], dtype="bf16")
    return features(hf_models.traced_spec(job), to_zerocalc(job)[1], [], gpu("h200"))


def device_constants(efficiency: float, path: str = KERNEL_TIME) -> dict:
    """The device's traffic constants (`timing.phase_times`: μ, λ, μ_b, λ_b and an unaligned head's
    efficiency) from forwards and backwards timed alone on the GPU without DeepSpeed
    (`validate/gpu/kernel_time.py`: synchronized wall times of device-bound phases), by least squares on
    the relative error over the `dense_and_fused` models, the matmuls at `efficiency` (`matmul_ceiling`:
    with it free the rows cannot tell it from the traffic, 0.70-0.80 fit them alike):
    forward = F/(η·peak) + H·(1/η_u - 1/η) + (μ·M_layers + λ·M_loss)/hbm, backward = B/(η·peak)
    + 2·H·(1/η_u - 1/η) + (μ_b·M_layers + λ_b·M_loss + μ·M_recomputed)/hbm. {} without the file."""
    rows = kernel_rows(path)
    if not rows:
        return {}
    a, b = [], []
    for r in rows:
        if not dense_and_fused(kernel_row_config(r)):
            continue
        x = kernel_row_features(r)
        layers, loss, head = x["traffic_at_hbm_s"], x["loss_traffic_at_hbm_s"], x["unaligned_head_at_peak_s"]
        a += [[x["forward_at_peak_s"], layers, loss, 0.0, 0.0, head],
              [x["backward_at_peak_s"], x["recompute_traffic_at_hbm_s"], 0.0, layers, loss, 2 * head]]
        b += [r["forward"]["wall_s"], r["backward"]["wall_s"]]
    a, b = np.array(a), np.array(b)
    c, *_ = np.linalg.lstsq(a[:, 1:] / b[:, None], 1 - a[:, 0] / efficiency / b, rcond=None)
    err = np.abs((a[:, 0] / efficiency + a[:, 1:] @ c) / b - 1)
    out = {"efficiency": round(efficiency, 4), **{n: round(float(v), 3) for n, v in zip(DEVICE_CONSTANTS[1:5], c[:4])}}
    if a[:, 5].any():
        out["unaligned_head_efficiency"] = round(float(1 / (c[4] + 1 / efficiency)), 4)
    copies = grad_copy_passes(rows)
    return out | ({"grad_copy_passes": copies} if copies else {}) | {"device_rows": len(b),
                                                                  "device_mean_abs_error": round(float(err.mean()), 4)}


def grad_copy_passes(plain_rows: list[dict], path: str = STAGE2_BESIDE_KERNEL_TIME) -> float | None:
    """HBM passes of the stage-2 gradient hooks' device work over its 2·b·P bytes (each gradient read
    and written into its bucket; the bucket's scaling and reduction pass over it again): the median over
    the stage-2 jobs at N = 1 without checkpointing of their backward less the same model's plain
    backward (`plain_rows`, kernel-time lines of the same tokens), over `grad_hook_at_hbm_s`. None
    without such pairs."""
    from validate import hf_models
    if not os.path.exists(path):
        return None
    plain = {(json.dumps(kernel_row_config(r), sort_keys=True), r["micro_batch"], r["seq_len"]): r["backward"]["wall_s"]
             for r in plain_rows if not r["checkpointing"]}
    passes = []
    df = load([path])
    for _, r in df[(df["outcome"] == "ok") & (df["stage"].astype(int) == 2) & (df["nproc"].astype(int) == 1)
                   & ~df["activation_checkpointing"].astype(bool)].iterrows():
        job = job_from_row(r.to_dict())
        key = (json.dumps(job["hf"]["config"], sort_keys=True), job["micro_batch"], job["seq_len"])
        if key not in plain:
            continue
        spec, setup = to_zerocalc(job)
        x = features(hf_models.traced_spec(job), setup, [], h200_of(r.to_dict(), 1))
        passes.append((float(r["measured_backward_s"]) - plain[key]) / x["grad_hook_at_hbm_s"])
    return round(float(np.median(passes)), 2) if passes else None


def typical_host_launch_s(rows: pd.DataFrame) -> float:
    """The fitted hosts' launch cost, which the host-side constants are at: the median over the rows of
    each row's per-step probes, or the probe before its timed steps where it has none (noisy for one
    row, not for the median of many)."""
    per_step = [measured_host_launch_s(r.to_dict()) for _, r in rows.iterrows()]
    before = rows["measured_launch_us"].astype(float).to_numpy() * 1e-6
    values = [p if p is not None else b for p, b in zip(per_step, before)]
    return float(np.nanmedian(values))


# The fitting core is zerocalc's (`zerocalc.calibrate`, which `zerocalc calibrate` calls too).
_SCALARS, _SHARES, _PER_CLASS = calibrate.SCALARS, calibrate.SHARES, calibrate.PER_CLASS
_predict = calibrate.predict


def fit_time(train: pd.DataFrame, cal: dict | None = None, fixed: dict | None = None) -> dict:
    """Least squares on log(predicted / measured) of the forward, backward and optimizer-step times
    and (four times weighted) of the whole step, over the training rows (a Trainer row's whole step
    only: its phases are not split that way); `fixed`: constants measured, not fitted (the Trainer's)."""
    measured = train[["measured_forward_s", "measured_backward_s", "measured_step_phase_s",
                      "measured_step_s"]].to_numpy(float, copy=True)
    trainer = (train["path"] == "trainer").to_numpy() if "path" in train else np.zeros(len(train), bool)
    measured[trainer, :3] = np.nan
    ceiling = matmul_ceiling(train)
    k = fit_constants(time_features(train, cal), measured, ceiling, fixed)
    rounded = {name: (round(v, 4) if name in _SHARES or name == "efficiency" else float(f"{v:.4g}")) for name, v in k.items()
               if not isinstance(v, dict)}
    rounded.update({name: v for name, v in (fixed or {}).items() if name in DEVICE_CONSTANTS})
    rounded.update({name: {c: float(f"{x:.4g}") for c, x in k[name].items()}
                    for name in _PER_CLASS})
    return rounded | {"efficiency_max": round(ceiling, 4), "rows": int(len(train))}


def fit_time_section(train: pd.DataFrame, cal: dict) -> dict:
    """cal's "time" section fitted on `train` (`fit_time`), its host-side constants at the training rows'
    median launch cost (`typical_host_launch_s`), which it records as host_launch_s_fitted."""
    launch_s = float(f"{typical_host_launch_s(train):.4g}")
    at = {**cal, "time": {k: v for k, v in cal["time"].items() if k != "host_launch_s"} | {"host_launch_s_fitted": launch_s}}
    trainer = trainer_host_constants(train, at)
    # at the efficiency as recorded (4 digits), so the shipped constants are what it gives back
    device = device_constants(round(matmul_ceiling(train), 4))
    fixed = {k: v for k, v in (trainer | device).items() if k not in ("trainer_rows", "device_rows", "device_mean_abs_error")}
    return fit_time(train, at, fixed) | trainer | device | {"host_launch_s_fitted": launch_s}


def matmul_ceiling(rows: pd.DataFrame) -> float:
    """The most of the GPU's peak the model's FLOPs can run at: the rows' median rate of a bf16 8192^3
    matmul (`measured_matmul_tflops`, measured beside each job) over the peak; 1 where unmeasured. A
    layer's matmuls are smaller, and attention and the rest no faster. Without it the fit traded FLOP
    time against element-wise traffic: over the cross-validation folds (`cross_validate_time`) the
    efficiency came out 0.75-1.0 and the traffic passes 5.8-7.9, where the matmul ran at 0.80 of peak."""
    from zerocalc.hardware import gpu
    tflops = rows["measured_matmul_tflops"].astype(float) if "measured_matmul_tflops" in rows else pd.Series(dtype=float)
    if tflops.notna().sum() == 0:
        return 1.0
    return float(min(1.0, tflops.median() * 1e12 / gpu("h200").peak_flops_per_s))


def fit_constants(feats: list[dict], measured: np.ndarray, efficiency_max: float = 1.0, fixed: dict | None = None) -> dict:
    """`zerocalc.calibrate.fit_constants`: every time constant but the `fixed` ones, from its usual start."""
    return calibrate.fit_constants(feats, measured, efficiency_max, fixed)


def time_accuracy(timed: pd.DataFrame, cal: dict) -> dict:
    """How the fitted time model does on every row timed as training runs, held-out ones included,
    each on its own host speed where probed: what `zerocalc estimate` quotes beside its step times."""
    predicted = _predict(time_features(timed, cal), cal["time"])[:, 3]
    measured = timed["measured_step_s"].to_numpy(float)
    err = np.abs(predicted / measured - 1)
    n_confs, confs_within = configurations_within(with_configuration(timed)["conf"], predicted, measured)
    regimes = [accuracy_regime(r["stage"], int(r["nproc"]), (r["offload_optimizer"], r["offload_param"]) != ("none", "none"))
               for _, r in timed.iterrows()]
    return {"rows": int(len(err)), "within_15pct": int((err <= 0.15).sum()),
            "mean_abs_error": round(float(err.mean()), 4),
            "configurations": n_confs, "configurations_within_15pct": confs_within,
            "by_regime": accuracy_by_regime(regimes, predicted, measured)}


def accuracy_by_regime(regimes, predicted, measured, target: float = 0.15) -> dict:
    """{regime: {"rows", "within_15pct", "mean_abs_error"}}: the rows of each `timing.accuracy_regime`."""
    err = pd.Series(np.abs(np.asarray(predicted, float) / np.asarray(measured, float) - 1))
    return {k: {"rows": int(len(g)), "within_15pct": int((g <= target).sum()),
                "mean_abs_error": round(float(g.mean()), 4)} for k, g in err.groupby(np.asarray(regimes))}


def cross_validate_time(paths, progress=None) -> tuple[pd.DataFrame, list[dict]]:
    """Every timed row's whole step predicted by time constants fitted without its configuration: for
    each fold (`fold`), the constants are fitted on the other folds' timed rows, at their hosts' median
    launch cost, as `fit` does on its training split, and predict this fold's rows. Returns the timed rows
    with `fold` and `cv_step_s`, and the FOLDS fitted time sections. Only the time constants are refitted;
    the memory ones (Llama's activation units, which set the element-wise traffic M) stay the calibration's."""
    df = gpu_rows(paths)
    timed = df[timed_whole_steps(df)].copy()
    folds = np.array([fold(r.to_dict()) for _, r in timed.iterrows()])
    too_few = [k for k in range(FOLDS) if (folds != k).sum() < 14 or (folds == k).sum() == 0]
    if too_few:
        raise ValueError(f"{len(timed)} GPU rows timed as training runs (measured_step_times_s) in these files: too "
                         f"few to fit on three folds and predict the fourth (folds {too_few}); give more of data/h200-*.csv")
    predicted, sections = np.full(len(timed), np.nan), []
    for k in range(FOLDS):
        train, test = timed[folds != k], timed[folds == k]
        cal = json.loads(json.dumps(calibration.default()))
        cal["time"] = fit_time_section(train, cal)
        predicted[folds == k] = _predict(time_features(test, cal), cal["time"])[:, 3]
        sections.append(cal["time"])
        if progress:
            progress(f"fold {k + 1}/{FOLDS}: fitted on {len(train)} rows, predicted {len(test)}")
    return timed.assign(fold=folds, cv_step_s=predicted), sections


def cross_validation_report(timed: pd.DataFrame, sections: list[dict]) -> str:
    """What `python -m validate crossval` prints: the out-of-fold accuracy per row and per configuration,
    then each fitted constant's range over the folds (how firmly the rows pin it)."""
    err = np.abs(timed["cv_step_s"].to_numpy(float) / timed["measured_step_s"].to_numpy(float) - 1)
    n_confs, within = configurations_within(with_configuration(timed)["conf"],
                                            timed["cv_step_s"].to_numpy(float), timed["measured_step_s"].to_numpy(float))
    lines = [f"Step time predicted by constants fitted without the row's configuration ({FOLDS} folds by configuration):",
             f"  rows: {int((err <= 0.15).sum())} of {len(err)} within 15%, mean {err.mean():.1%}, worst {err.max():.0%}",
             f"  configurations (the median of their jobs): {within} of {n_confs} within 15%"]
    for k, section in enumerate(sections):
        e = err[timed["fold"].to_numpy() == k]
        lines.append(f"  fold {k}: {int((e <= 0.15).sum())} of {len(e)} rows within 15% (mean {e.mean():.1%}); "
                     f"efficiency {section['efficiency']:.3f}, activation passes {section['activation_passes']:.2f}")
    lines += ["", "Each constant over the folds (min - max; spread = max / min):"]
    for name in _SCALARS:
        values = [s[name] for s in sections]
        lines.append(f"  {name:28s} {min(values):10.4g} - {max(values):<10.4g} spread {_spread(values)}")
    for name in _PER_CLASS:
        for c in STEP_CLASSES:
            values = [s[name][c] for s in sections]
            lines.append(f"  {name + '.' + c:28s} {min(values):10.4g} - {max(values):<10.4g} spread {_spread(values)}")
    return "\n".join(lines)


def _spread(values) -> str:
    """max / min of a constant over the folds; a constant a fold fitted to 0 has none."""
    return f"{max(values) / min(values):5.2f}" if min(values) > 0 else "    -"


def configurations_within(confs, predicted, measured, target: float = 0.15) -> tuple[int, int]:
    """(configurations, how many of them the model puts within `target`), each configuration judged as
    `report` does: the median of its jobs' predictions against the median of their measured steps."""
    by = pd.DataFrame({"conf": list(confs), "predicted": predicted, "measured": measured}).groupby("conf").median()
    return len(by), int((np.abs(by["predicted"] / by["measured"] - 1) <= target).sum())


def _reserved_ratio(rows: pd.DataFrame) -> float:
    """The reserved/allocated ratio r minimizing the squared relative error of r·allocated against the
    measured reserved (the target is relative; bytes would let the largest runs decide alone):
    r = Σ(a/m) / Σ(a/m)²."""
    return calibrate.reserved_ratio(rows["measured_peak_allocated_bytes"], rows["measured_peak_reserved_bytes"])


def _expandable_factors(clean: pd.DataFrame) -> list[float]:
    """Per configuration run with both allocators: its reserved/allocated ratio with
    expandable_segments:True over the ratio with the default allocator (each the mean of its rows)."""
    ratio = clean["measured_peak_reserved_bytes"] / clean["measured_peak_allocated_bytes"]
    expandable = expandable_rows(clean)
    conf = pd.Series([configuration(r.to_dict(), allocator=False) for _, r in clean.iterrows()], index=clean.index,
                     dtype=object)   # not DataFrame.apply: on no rows it gives a frame, not a series
    factors = []
    for c in sorted(set(conf[expandable])):
        default = ratio[(conf == c) & ~expandable]
        if len(default):
            factors.append(float(ratio[(conf == c) & expandable].mean() / default.mean()))
    return factors


def _allocator(fitted: pd.DataFrame, every: pd.DataFrame | None = None) -> dict:
    """A calibration entry: the reserved/allocated ratio fitted on `fitted` (no offset) and, given
    `every`, the largest ratio measured on those rows, for the "tight" verdict."""
    entry = {"reserved_over_allocated": round(_reserved_ratio(fitted), 4), "reserved_extra_bytes": 0,
             "rows": int(len(fitted))}
    if every is not None:
        worst = (every["measured_peak_reserved_bytes"] / every["measured_peak_allocated_bytes"]).max()
        entry["reserved_over_allocated_worst"] = round(float(worst), 4)
    return entry


class NothingToFit(ValueError):
    """The rows given hold no GPU measurement to fit on (CPU rows, failed jobs, a header alone)."""


class CannotWrite(RuntimeError):
    """The calibration file could not be written (a full disk); the old one is left as it was."""


def fit(paths, out_path=None) -> tuple[dict, str]:
    """Raises NothingToFit where `paths` hold no measured GPU row of a transcribed family to fit on, and
    CannotWrite where out_path cannot be written."""
    cal = json.loads(json.dumps(calibration.default()))
    df = gpu_rows(paths)
    if df.empty:
        raise NothingToFit(f"no GPU row with a measured peak in {', '.join(paths)}: the constants are fitted on "
                           "jobs run with --backend cuda (CPU rows measure bytes only); nothing written")
    train = df[~df["held_out"]]
    if train.empty:
        raise NothingToFit(f"the {len(df)} GPU rows in {', '.join(paths)} are all of held-out configurations "
                           "(`fit.held_out`, a quarter of them, never fitted): give more rows; nothing written")
    lines = [f"{len(df)} GPU rows: {len(train)} for fitting, {len(df) - len(train)} held out"]
    act = [r for r in _llama_activation_rows(train, cal)]
    if len(act) >= 2:
        x = np.array([[h, kv] for h, kv, _, _ in act], dtype=float)
        y = np.array([u for _, _, u, _ in act])
        (ch, ckv), *_ = np.linalg.lstsq(x, y, rcond=None)
        cal["activations"]["hf-llama"].update(h=round(float(ch), 3), kv=round(float(ckv), 3))
        lines.append(f"activations.hf-llama: h {ch:.3f}, kv {ckv:.3f} (units of b per token per layer; "
                     f"{len(act)} rows)")
    expandable = expandable_rows(train)
    simulated = train.apply(lambda r: sequence.generated(*to_zerocalc(job_from_row(r.to_dict()))), axis=1)
    every = train[started_clean(train) & ~expandable]
    param_offload = every["offload_param"] != "none"
    off, clean = every[param_offload], every[~param_offload]
    if len(off) >= 2:
        cal["allocator_param_offload"] = _allocator(off, every)   # its "tight" verdict: the worst of all
        lines.append(f"allocator_param_offload: reserved = {cal['allocator_param_offload']['reserved_over_allocated']:.3f}"
                     f" × allocated ({len(off)} clean rows with parameter offload)")
    if len(clean) >= 2:
        # One ratio: an offset fitted beside it came out negative on these rows, which would put a
        # small model's reserved below its allocated.
        a = cal["allocator"] = _allocator(clean, every)
        lines.append(f"allocator: reserved = {a['reserved_over_allocated']:.3f} × allocated ({len(clean)} clean rows "
                     f"without parameter offload), worst measured ratio "
                     f"{a['reserved_over_allocated_worst']:.3f} ({len(every)} clean rows)")
    sim = train[started_clean(train) & simulated]
    if len(sim) >= 2:
        all_rows = load(paths)
        all_rows = all_rows[~hf_rows(all_rows)]
        replays = process_replays(all_rows, earlier_jobs(all_rows))
        predicted = sim.apply(lambda r: predicted_reserved(estimate(*to_zerocalc(job_from_row(r.to_dict()))),
                                                           r.to_dict(), replays.get(r.name)), axis=1)
        worst = float((sim["measured_peak_reserved_bytes"].astype(float) / predicted).max())
        cal["allocator_simulated"] = {"measured_over_simulated_worst": round(worst, 4), "rows": int(len(sim))}
        lines.append(f"allocator_simulated: measured reserved at most {worst:.3f} × simulated ({len(sim)} clean rows)")
    factors = _expandable_factors(train[started_clean(train)])
    if len(factors) >= 2:
        worst = (train["measured_peak_reserved_bytes"] / train["measured_peak_allocated_bytes"])[
            started_clean(train) & expandable].max()
        a = cal["allocator_expandable"] = {"factor": round(float(np.mean(factors)), 4), "pairs": len(factors),
                                           "reserved_over_allocated_worst": round(float(worst), 4)}
        lines.append(f"allocator_expandable: reserved/allocated × {a['factor']:.3f} (mean over {len(factors)} "
                     f"configurations run with both allocators: {min(factors):.3f}-{max(factors):.3f}), worst measured "
                     f"ratio {a['reserved_over_allocated_worst']:.3f}")
    timed = train[timed_whole_steps(train)]
    hf = hf_timed_rows(paths)
    if len(timed) >= 14:
        cal["time"] = fit_time_section(pd.concat([timed, hf[~hf["held_out"]]]), cal)
        cal["time"]["accuracy"] = time_accuracy(df[timed_whole_steps(df)], cal)
        if len(hf):
            cal["time"]["accuracy_hf"] = time_accuracy(hf, cal)
        t = cal["time"]
        lines.append(f"time: host launch cost {t['host_launch_s_fitted'] * 1e6:.2f} us (the rows' median: the "
                     f"host-side constants below are at it; {t['host_launch_share']:.0%} of them follows a row's own "
                     "per-step probes); "
                     f"efficiency {t['efficiency']:.3f} of peak; element-wise traffic {t['activation_passes']:.2f} "
                     f"passes of the activations at HBM bandwidth; host floor {t['launch_fwd_s_per_layer'] * 1e3:.2f} "
                     f"(forward, +{t['checkpoint_fwd_s_per_layer'] * 1e3:.2f} checkpointed) and "
                     f"{t['launch_bwd_s_per_layer'] * 1e3:.2f} (backward) ms per layer pass, + {t['launch_s_per_op'] * 1e6:.1f} us "
                     "per dispatched operator; stage-3 hook "
                     f"{t['module_hook_s'] * 1e3:.3f} ms per module step, {t['gather_call_s'] * 1e3:.3f} ms per all-gather "
                     f"call, {t.get('reduce_call_s', 0.0) * 1e3:.3f} ms per reduce-scatter call; link efficiency "
                     f"{t['link_efficiency']:.3f}; gradient hook {t['grad_hook_s'] * 1e6:.1f} us "
                     f"per tensor (stage 2), end-of-backward move {t['grad_move_s'] * 1e6:.1f} us per tensor (stage 1); offload host: link {t['host_link_bytes_per_s'] / 1e9:.1f} GB/s, CPU Adam "
                     f"{t['host_adam_elements_per_s'] / 1e9:.2f}e9 elements/s, pageable upload "
                     f"{t['host_pageable_bytes_per_s'] / 1e9:.1f} GB/s ({int(timed['offload_optimizer'].ne('none').sum())} offload rows); optimizer step " + ", ".join(
                         f"{c} {t['step_overhead_s'][c] * 1e3:.1f} ms + {t['optimizer_s_per_element'][c] * 1e12:.1f} ps/element"
                         f" + {t['optimizer_s_per_tensor'][c] * 1e6:.1f} us/tensor"
                         for c in t["step_overhead_s"]) + f" ({len(timed)} rows of the transcribed families, "
                     f"{int((~hf['held_out']).sum())} of HF configs)")
        if "trainer_s_per_micro_step" in t:
            lines.append(f"time: HF Trainer's own loop {t['trainer_s_per_micro_step'] * 1e3:.2f} ms per micro-step, its "
                         f"zero_grad {t['trainer_zero_grad_s_per_tensor'] * 1e6:.2f} us per parameter tensor (measured on "
                         f"{t['trainer_rows']} Trainer rows' probes, not fitted)")
        for name in ("accuracy", "accuracy_hf"):
            if name in t:
                a = t[name]
                lines.append(f"time {name}: {a['within_15pct']} of {a['rows']} rows within 15% (mean |err| "
                             f"{a['mean_abs_error']:.1%}), {a['configurations_within_15pct']} of {a['configurations']} "
                             "configurations")
    cal["device"] = {"context_bytes": int(df["measured_device_overhead_bytes"].median()),
                     "gpu": str(df["gpu"].iloc[0])}
    lines.append(f"device.context_bytes: {cal['device']['context_bytes'] / 2**30:.2f} GiB (median of {len(df)} rows)")
    kept = [name for name in ("activations.hf-llama", "allocator_param_offload", "allocator", "allocator_simulated",
                              "allocator_expandable", "time") if not any(line.startswith(name + ":") for line in lines)]
    if kept:
        lines.append(f"too few rows to fit, kept as they were: {', '.join(kept)}")
    cal["fitted_on"] = sorted(set(paths))
    if out_path:
        try:   # the old file or the new one, whole, whatever stops the write
            replace_whole(out_path, (json.dumps(cal, indent=2) + "\n").encode())
        except OSError as err:
            raise CannotWrite(f"could not write {out_path}: {err.strerror or err}; it is as it was before") from err
        lines.append(f"wrote {out_path}")
    return cal, "\n".join(lines)


def calibrate_checks(paths, factor: float = 1.3) -> dict:
    """What `zerocalc calibrate` gives on the committed H200 rows (`paths`, the shipped calibration's
    `fitted_on`), held by tests/test_calibrate.py and shown in docs/your-cluster.md:
    "committed": the calibration of the fit's training split (started from the usual start, the device's
    constants held as `fit` holds them), beside the shipped one; "held_out": the mean |error| on a quarter
    of the timed rows (by a hash of each key) of the shipped constants and of those calibrated on the other
    three quarters, on the rows as measured and with every time × `factor` (a slower cluster)."""
    import dataclasses
    from zerocalc import measured
    from zerocalc.hardware import gpu
    rows, _ = measured.read(paths, gpu("h200"))
    raw = {r["_where"]: r for p in paths for r in measured.read_csv(p)[1]}
    shipped = calibration.default()
    held = tuple(n for n in DEVICE_CONSTANTS if n in calibrate.PARAMS)
    train = [r for r in rows if not held_out(raw[r.where])]
    committed = calibrate.calibrate(train, shipped, paths, start={**calibrate.START, "efficiency": 0.45}, held=held)

    def quarter(r) -> bool:
        return int(hashlib.sha1(r.key.encode()).hexdigest(), 16) % 4 == 0

    def times(rs, f):
        return [dataclasses.replace(r, values={k: v * f if k in measured.TIME_COLUMNS else v
                                               for k, v in r.values.items()}) for r in rs]

    def errors(fit_rows, test_rows) -> dict:
        cal = calibrate.calibrate(fit_rows, shipped, ["rows.csv"]).calibration
        typical = calibrate.typical_launch_s(fit_rows)
        return {name: calibrate.accuracy(test_rows, calibrate.time_features(test_rows, c, typical), c["time"])
                for name, c in (("shipped", shipped), ("calibrated", cal))}
    timed = [r for r in rows if r.timed]
    fit_rows, test_rows = [r for r in timed if not quarter(r)], [r for r in timed if quarter(r)]
    return {"committed": committed, "train_rows": len([r for r in train if r.timed]),
            "held_out": {"as measured": errors(fit_rows, test_rows),
                         f"× {factor}": errors(times(fit_rows, factor), times(test_rows, factor))},
            "factor": factor, "test_rows": len(test_rows)}
