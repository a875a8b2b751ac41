"""The fitted constants from measured rows: the one fitting code, which `python -m validate fit` (the
shipped calibration) and `zerocalc calibrate` (a user's own) both call.

The step-time constants (`zerocalc/timing.py`) are fitted by Levenberg–Marquardt on the log ratio of
predicted to measured forward, backward, optimizer-step and (four times weighted) whole-step times,
each constant in log space, the shares (link efficiency, host_launch_share) through a logistic and
the compute efficiency as a share of its ceiling. The reserved/allocated ratio is the one minimizing
the squared relative error. docs/step-time.md has the model; docs/your-cluster.md the user's side.
"""
import os
from dataclasses import dataclass, replace

import numpy as np

from zerocalc.timing import STEP_CLASSES, phase_times, whole_step_s

# The time constants, fitted in log space (all positive); the shares through a logistic (0 < ε, φ ≤ 1).
SCALARS = ("efficiency", "activation_passes", "backward_activation_passes", "loss_passes", "loss_passes_backward",
           "launch_fwd_s_per_layer", "launch_bwd_s_per_layer", "launch_s_per_op",
           "checkpoint_fwd_s_per_layer", "module_hook_s", "gather_call_s", "reduce_call_s", "link_efficiency",
           "grad_hook_s", "grad_move_s", "host_link_bytes_per_s", "host_adam_elements_per_s",
           "host_pageable_bytes_per_s", "host_launch_share")
SHARES = ("link_efficiency", "host_launch_share", "inter_node_link_efficiency")
START = {"efficiency": 0.45, "activation_passes": 1.0, "backward_activation_passes": 2.0, "loss_passes": 1.0,
         "loss_passes_backward": 2.0, "launch_fwd_s_per_layer": 1.5e-3, "launch_bwd_s_per_layer": 2.5e-3,
         "launch_s_per_op": 1e-5,
         "checkpoint_fwd_s_per_layer": 5e-4, "module_hook_s": 5e-4, "gather_call_s": 2e-4, "reduce_call_s": 3e-4,
         "link_efficiency": 0.5,
         "grad_hook_s": 3e-5, "grad_move_s": 3e-5,
         "host_link_bytes_per_s": 25e9, "host_adam_elements_per_s": 1e9, "host_pageable_bytes_per_s": 10e9,
         "host_launch_share": 0.9,
         "step_overhead_s": dict.fromkeys(STEP_CLASSES, 0.005),
         "optimizer_s_per_element": dict.fromkeys(STEP_CLASSES, 3e-11),
         "optimizer_s_per_tensor": dict.fromkeys(STEP_CLASSES, 5e-5)}
PER_CLASS = ("step_overhead_s", "optimizer_s_per_element", "optimizer_s_per_tensor")
# Every fitted time constant by name, a per-class one as "step_overhead_s.stage3": the order of the
# vector the fit moves (`pack`). The link efficiency across nodes is fitted only by `zerocalc
# calibrate` on rows whose job spanned nodes (none of the shipped calibration's did).
PARAMS = SCALARS + tuple(f"{name}.{c}" for name in PER_CLASS for c in STEP_CLASSES)
INTER_NODE = "inter_node_link_efficiency"


def _get(k: dict, name: str) -> float:
    group, _, c = name.partition(".")
    return k[group][c] if c else k[name]


def unpack(z, efficiency_max: float = 1.0, names: tuple = PARAMS) -> dict:
    """The constants of the vector `z` (`pack`'s inverse): {name: value}, a per-class constant as
    {name: {class: value}}."""
    k = {}
    for name, v in zip(names, z):
        group, _, c = name.partition(".")
        if name == "efficiency":   # a share of its ceiling (`matmul_ceiling`), smooth up to it
            value = float(efficiency_max / (1 + np.exp(-np.clip(v, -30, 60))))
        elif name in SHARES:
            value = float(1 / (1 + np.exp(-np.clip(v, -30, 60))))   # never 0
        else:
            value = float(np.exp(np.clip(v, -60, 60)))
        if c:
            k.setdefault(group, {})[c] = value
        else:
            k[name] = value
    return k


def pack(k: dict, efficiency_max: float = 1.0, names: tuple = PARAMS) -> np.ndarray:
    """The vector the fit moves: log of each constant, logit of each share (a share at its bound
    taken a hair inside it)."""
    z = []
    for name in names:
        v = _get(k, name)
        if name == "efficiency":
            v = min(v, efficiency_max * (1 - 1e-6))
            z.append(np.log(v / (efficiency_max - v)))
        elif name in SHARES:
            v = min(max(v, 1e-6), 1 - 1e-6)
            z.append(np.log(v / (1 - v)))
        else:
            z.append(np.log(v))
    return np.array(z, dtype=float)


def predict(feats, k) -> np.ndarray:
    """(rows, 4): forward, backward, optimizer step and whole step, seconds."""
    out = []
    for f in feats:
        fwd, bwd, step, reduce = phase_times(f, k)
        out.append((fwd, bwd, step, whole_step_s(f, fwd, bwd, step, reduce)))
    return np.array(out)


def levenberg_marquardt(residuals, z, iterations=100):
    """Minimise |residuals(z)|² (numerical Jacobian); small and dependency-free."""
    r = residuals(z)
    cost, damping = r @ r, 1e-2
    for _ in range(iterations):
        jac = np.empty((len(r), len(z)))
        for j in range(len(z)):
            dz = np.zeros_like(z)
            dz[j] = 1e-6
            jac[:, j] = (residuals(z + dz) - r) / 1e-6
        a, g = jac.T @ jac, jac.T @ r
        while damping < 1e12:
            step = np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), -g)
            r_new = residuals(z + step)
            if r_new @ r_new < cost:
                improved = cost - r_new @ r_new
                z, r, cost, damping = z + step, r_new, r_new @ r_new, damping / 3
                break
            damping *= 10
        else:
            break
        if improved < 1e-10 * max(cost, 1e-30):
            break
    return z


# The whole step (median of 5-10 unsynchronized steps) is what is judged; the phases (3 steps with a
# synchronize at each boundary) only split it.
WEIGHTS = np.array([1.0, 1.0, 1.0, 4.0])


def log_residuals(feats, measured: np.ndarray, k: dict) -> np.ndarray:
    """Weighted log(predicted / measured), rows × (forward, backward, optimizer step, whole step),
    flattened; 0 where not measured (NaN)."""
    r = np.log(predict(feats, k) / measured) * WEIGHTS
    return np.nan_to_num(r, nan=0.0).ravel()


def fit_constants(feats: list[dict], measured: np.ndarray, efficiency_max: float = 1.0, fixed: dict | None = None,
                  free: tuple | None = None, start: dict | None = None, tied: dict | None = None) -> dict:
    """The time constants minimizing the weighted log ratios of `predict(feats)` to `measured` (rows ×
    forward, backward, optimizer step, whole step; NaN: not measured, left out), the efficiency at most
    `efficiency_max`; `fixed` constants held as given. `free`: the names (`PARAMS`, `INTER_NODE`) to
    fit but the fixed ones, the others held at `start` (default: every one of PARAMS, from START); `tied`:
    {name: (a free name, ±1)}, a constant scaled with another, by the same factor or its inverse (`choose`)."""
    fixed = fixed or {}
    names = tuple(n for n in (PARAMS if free is None else free) if n not in fixed)
    start = start or {**START, "efficiency": min(START["efficiency"], efficiency_max / 2)}
    z0 = pack(start, efficiency_max, names)
    base = {**start, **fixed}

    def constants(z):
        k = unpack(z, efficiency_max, names)
        k = {**base, **{g: ({**base[g], **v} if isinstance(v, dict) else v) for g, v in k.items()}}
        for member, (leader, power) in (tied or {}).items():
            factor = (_get(k, leader) / _get(start, leader)) ** power
            k = _with(k, member, _bounded(member, _get(start, member) * factor, efficiency_max))
        return k

    return constants(levenberg_marquardt(lambda z: log_residuals(feats, measured, constants(z)), z0))


def _bounded(name: str, value: float, efficiency_max: float) -> float:
    """A share at most 1, the efficiency at most its ceiling."""
    if name == "efficiency":
        return min(value, efficiency_max)
    return min(value, 1.0) if name in SHARES else value


def reserved_ratio(allocated, reserved) -> float:
    """The reserved/allocated ratio r minimizing the squared relative error of r·allocated against the
    measured reserved (the target is relative; bytes would let the largest runs decide alone):
    r = Σ(a/m) / Σ(a/m)²."""
    q = np.asarray(allocated, dtype=float) / np.asarray(reserved, dtype=float)
    return float(q.sum() / (q * q).sum())


# ---- `zerocalc calibrate`: which constants a user's rows determine, fitted; the rest kept ----

MIN_ROWS = 3            # a constant is fitted on at least this many rows that depend on it
ROW_SHARE = 0.03        # a row depends on a constant where 1% of it moves the row's time by 0.03%
INDEPENDENT = 0.1       # the part of a constant's effect no stronger constant's explains, at least
ERROR_MAX = 0.5         # a constant the rows leave more uncertain than ±50% is kept
# Rows that would determine each time constant, said beside one kept for want of them.
NEEDS = {"efficiency": "device-bound rows (large models, long sequences)",
         "activation_passes": "device-bound rows (large models, long sequences)",
         "backward_activation_passes": "device-bound rows", "loss_passes": "device-bound rows of models with large "
         "vocabularies", "loss_passes_backward": "device-bound rows of models with large vocabularies",
         "launch_fwd_s_per_layer": "host-bound rows (small models)", "launch_bwd_s_per_layer": "host-bound rows",
         "launch_s_per_op": "host-bound rows of several models", "checkpoint_fwd_s_per_layer": "rows with activation "
         "checkpointing", "module_hook_s": "stage-3 rows", "gather_call_s": "stage-3 rows at N > 1",
         "reduce_call_s": "stage-3 rows with a reduce bucket smaller than the layers' tensors (HF's auto)",
         "link_efficiency": "rows at N > 1 whose step waits on the wire", INTER_NODE: "rows of jobs across nodes",
         "grad_hook_s": "stage-2 rows", "grad_move_s": "stage-1 rows", "host_link_bytes_per_s": "offload rows",
         "host_adam_elements_per_s": "optimizer-offload rows", "host_pageable_bytes_per_s": "stage-3 optimizer-offload rows",
         "host_launch_share": "rows with the host's launch cost probed before each step (validate run on CUDA)",
         "step_overhead_s": "rows at that stage", "optimizer_s_per_element": "rows at that stage",
         "optimizer_s_per_tensor": "rows at that stage"}


def _with(k: dict, name: str, value: float) -> dict:
    group, _, c = name.partition(".")
    return {**k, group: {**k[group], c: value}} if c else {**k, name: value}


def scaled(k: dict, name: str, factor: float, tied: dict | None = None) -> dict:
    """`k` with `name` × factor, and each constant tied to it (`choose`) × factor**(its power)."""
    out = _with(k, name, _get(k, name) * factor)
    for member, (leader, power) in (tied or {}).items():
        if leader == name:
            out = _with(out, member, _get(k, member) * factor ** power)
    return out


def sensitivities(feats, k: dict, names, tied: dict | None = None) -> np.ndarray:
    """(rows, 4, constants): d log(predicted phase) / d log(constant) at `k` (with the constants tied to
    it), by a 1% step down (a share at its bound of 1 can only move down)."""
    h = 0.01
    base = np.log(predict(feats, k))
    return np.stack([(np.log(predict(feats, scaled(k, n, np.exp(-h), tied))) - base) / -h for n in names], axis=2)


def _moved(sens: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """rows × constants: whether the row's measured times depend on the constant (ROW_SHARE)."""
    return (np.abs(sens) * ~np.isnan(measured)[:, :, None]).max(axis=1) >= ROW_SHARE


def choose(sens: np.ndarray, measured: np.ndarray, names) -> tuple[list[str], dict, dict]:
    """(the constants the rows determine, {constant: (the determined one it is tied to, ±1)}, {every
    other one: why}). Determined: at least MIN_ROWS rows whose measured times depend on it (ROW_SHARE),
    and an effect on them not a combination of the stronger constants' (INDEPENDENT of its own size
    left when theirs is projected out). One whose effect is a stronger one's is tied to it: the rows
    cannot tell the two apart, so both scale by one factor (its inverse where one slows the step as the
    other speeds it), keeping the ratio between them that the base calibration has."""
    seen = ~np.isnan(measured)
    moved = _moved(sens, measured)
    cols = (sens * WEIGHTS[None, :, None] * seen[:, :, None]).reshape(-1, len(names))
    why, order = {}, []
    for j, n in enumerate(names):
        if moved[:, j].sum() < MIN_ROWS:
            need = NEEDS.get(n, NEEDS.get(n.partition(".")[0], "other rows"))
            why[n] = (f"{int(moved[:, j].sum())} rows' time depends on it by {ROW_SHARE:.0%} or more (needs {MIN_ROWS}; it "
                      f"matters in {need})")
        else:
            order.append(j)
    order.sort(key=lambda j: -np.linalg.norm(cols[:, j]))
    chosen, tied, basis = [], {}, np.zeros((cols.shape[0], 0))
    for j in order:
        c = cols[:, j]
        left = c - basis @ (basis.T @ c) if basis.shape[1] else c
        if np.linalg.norm(left) < INDEPENDENT * np.linalg.norm(c):
            peer = max(chosen, key=lambda i: abs(cols[:, i] @ c) / np.linalg.norm(cols[:, i]))
            tied[names[j]] = (names[peer], 1 if cols[:, peer] @ c > 0 else -1)
            continue
        chosen.append(j)
        basis = np.column_stack([basis, left / np.linalg.norm(left)])
    return [names[j] for j in sorted(chosen)], tied, why


def standard_errors(feats, measured: np.ndarray, k: dict, names, tied: dict | None = None) -> dict:
    """{constant: its relative standard error}: from the fit's residual variance and the Jacobian in
    log space (σ²·(JᵀJ)⁻¹, a pseudo-inverse where the rows barely separate two)."""
    seen = ~np.isnan(measured)
    r = log_residuals(feats, measured, k)
    jac = (sensitivities(feats, k, names, tied) * WEIGHTS[None, :, None] * seen[:, :, None]).reshape(-1, len(names))
    dof = max(int(seen.sum()) - len(names), 1)
    cov = (r @ r / dof) * np.linalg.pinv(jac.T @ jac)
    return {n: float(np.sqrt(max(cov[j, j], 0.0))) for j, n in enumerate(names)}


@dataclass(frozen=True)
class Fitted:
    name: str            # the calibration's key, "time.efficiency", "allocator.reserved_over_allocated"
    value: float
    shipped: float | None
    rows: int            # the rows it was fitted on (for a time constant: those that depend on it)
    error: float         # relative standard error (1σ)
    tied_to: str | None = None   # scaled with this one, which the rows cannot tell it from (`choose`)


@dataclass(frozen=True)
class Kept:
    name: str
    why: str


@dataclass(frozen=True)
class Result:
    calibration: dict
    fitted: tuple[Fitted, ...]
    kept: tuple[Kept, ...]
    notes: tuple[str, ...]
    before: dict | None   # the time model's accuracy on the timed rows, with the base constants
    after: dict | None    # and with the fitted ones (`accuracy`)


def typical_launch_s(rows) -> float | None:
    """The rows' host launch cost: the median over rows of the probes each took (`Measured.host_probe_s`)."""
    probes = [r.host_probe_s for r in rows if r.host_probe_s]
    return float(np.median(probes)) if probes else None


def row_calibration(cal: dict, row, typical: float | None) -> dict:
    """`cal` at the host the row ran on: its own per-step probes, else the rows' typical launch cost."""
    launch = row.host_launch_s or typical
    return cal if launch is None else {**cal, "time": {**cal["time"], "host_launch_s": launch}}


def time_features(rows, cal: dict, typical: float | None = None) -> list[dict]:
    from zerocalc.estimate import estimate
    from zerocalc.timing import features
    return [features(r.model, r.setup, estimate(r.model, r.setup).collectives, r.hardware, row_calibration(cal, r, typical))
            for r in rows]


def measured_times(rows) -> np.ndarray:
    """rows × (forward, backward, optimizer step, whole step) seconds, NaN where not measured (an HF
    Trainer row's phases are not split as the model's are: its whole step only)."""
    from zerocalc.measured import TIME_COLUMNS
    out = np.array([[np.nan if r.get(c) is None else r.get(c) for c in TIME_COLUMNS] for r in rows], dtype=float)
    out[[r.setup.hf_trainer for r in rows], :3] = np.nan
    return out


def accuracy(rows, feats, k: dict, target: float = 0.15) -> dict:
    """The whole step's |predicted / measured - 1| over the rows, as the calibration's `time.accuracy`
    records it (`render` quotes it beside every step time), by `timing.accuracy_regime`."""
    from zerocalc.timing import accuracy_regime
    err = np.abs(predict(feats, k)[:, 3] / measured_times(rows)[:, 3] - 1)
    regimes = [accuracy_regime(r.setup.stage, r.setup.dp, (r.setup.offload_optimizer, r.setup.offload_param)
                               != ("none", "none")) for r in rows]
    by = {g: {"rows": int(sum(x == g for x in regimes)),
              "within_15pct": int(sum(e <= target for e, x in zip(err, regimes) if x == g)),
              "mean_abs_error": round(float(np.mean([e for e, x in zip(err, regimes) if x == g])), 4)}
          for g in sorted(set(regimes))}
    return {"rows": int(len(err)), "within_15pct": int((err <= target).sum()), "mean_abs_error": round(float(err.mean()), 4),
            "by_regime": by}


def efficiency_ceiling(rows, hw_peak: float, base: dict) -> float:
    """The rows' median bf16 matmul rate over peak (`measured_matmul_tflops`, the validator's probe),
    else the base calibration's ceiling."""
    rates = [r.get("measured_matmul_tflops") for r in rows if r.get("measured_matmul_tflops")]
    if not rates:
        return base.get("efficiency_max", 1.0)
    return float(min(1.0, np.median(rates) * 1e12 / hw_peak))


def _round(name: str, v: float) -> float:
    return round(v, 4) if name in SHARES or name == "efficiency" else float(f"{v:.4g}")


# The device term's HBM passes per byte (`timing.traffic_passes`), measured on forwards and backwards
# timed without DeepSpeed (validate.fit.device_constants): step times cannot tell them from the
# efficiency, so a user's rows scale them with it, by one factor (a slower device, all of its work).
MEASURED_PASSES = ("activation_passes", "backward_activation_passes", "loss_passes", "loss_passes_backward")


def fit_time(rows, base: dict, start: dict | None = None, held: tuple = ()
             ) -> tuple[dict, list[Fitted], list[Kept], dict, dict]:
    """(the time section, its fitted constants, those kept, accuracy before and after) on the timed rows;
    the fit starts from `start`'s time constants where given (else base's), a kept one stays base's.
    `held`: kept, whatever the rows determine (as `python -m validate fit` holds those it measures). A
    constant the fit leaves uncertain (ERROR_MAX) or on which it leaves under MIN_ROWS rows depending is
    kept, with those tied to it, and the rest fitted again."""
    typical = typical_launch_s(rows)
    cal0 = {**base, "time": {**base["time"], INTER_NODE: base["time"].get(INTER_NODE, base["time"]["link_efficiency"])}}
    feats, times = time_features(rows, cal0, typical), measured_times(rows)
    k0 = cal0["time"]
    begin = {**k0, **(start or {})}
    ceiling = efficiency_ceiling(rows, rows[0].hardware.peak_flops_per_s, k0)
    names = tuple(n for n in PARAMS if n not in held and n not in MEASURED_PASSES) \
        + ((INTER_NODE,) if any(f["inter_node"] for f in feats) else ())
    free, tied, why = choose(sensitivities(feats, begin, names), times, names)
    why.update({n: "held as given" for n in held})
    passes = [n for n in MEASURED_PASSES if n not in held]
    depend = dict(zip(passes, _moved(sensitivities(feats, begin, passes), times).sum(axis=0))) if passes else {}
    for n in passes:
        if depend[n] < MIN_ROWS:
            why[n] = f"{int(depend[n])} rows' time depends on it by {ROW_SHARE:.0%} or more (needs {MIN_ROWS})"
        elif "efficiency" in free:
            tied[n] = ("efficiency", -1)
        else:
            why[n] = "moves with the efficiency, which is kept"
    k, errors, moved = k0, {}, {}
    for _ in range(len(names)):
        at = begin
        for n in why:   # a kept constant is base's
            at = _with(at, n, _get(k0, n))
        k = fit_constants(feats, times, ceiling, free=tuple(free), start=at, tied=tied) if free else k0
        errors = standard_errors(feats, times, k, free, tied) if free else {}
        moved = dict(zip(free, _moved(sensitivities(feats, k, free, tied), times).sum(axis=0))) if free else {}
        drop = {n: f"the rows leave it uncertain (±{errors[n]:.0%})" for n in free if errors[n] > ERROR_MAX}
        drop.update({n: f"as fitted, {moved[n]} rows' time depends on it (needs {MIN_ROWS})" for n in free
                     if moved[n] < MIN_ROWS and n not in drop})
        if not drop:
            break
        why.update(drop)
        why.update({m: f"moves with {leader}, which is kept: the rows cannot tell the two apart"
                    for m, (leader, _) in tied.items() if leader in drop})
        tied = {m: t for m, t in tied.items() if t[0] not in drop}
        free = [n for n in free if n not in drop]
    own = dict(zip(tied, _moved(sensitivities(feats, k, list(tied)), times).sum(axis=0))) if tied else {}
    section, fitted = dict(k0), []
    for n in free + list(tied):
        value = _round(n, _get(k, n))
        section = _with(section, n, value)
        shipped = _get(base["time"], n) if n != INTER_NODE or INTER_NODE in base["time"] else None
        leader = tied[n][0] if n in tied else None
        fitted.append(Fitted(f"time.{n}", value, shipped, int(own[n] if leader else moved[n]),
                             errors[leader or n], leader and f"time.{leader}"))
    if INTER_NODE not in free and INTER_NODE not in tied and INTER_NODE not in base["time"]:
        section.pop(INTER_NODE)
    kept = [Kept(f"time.{n}", w) for n, w in why.items() if n != INTER_NODE or names[-1] == INTER_NODE]
    if typical:
        section["host_launch_s"] = float(f"{typical:.4g}")
    section.update(efficiency_max=round(ceiling, 4), rows=len(rows))
    before = accuracy(rows, feats, k0)
    after = accuracy(rows, time_features(rows, {**base, "time": section}, typical), section)
    section.pop("accuracy_hf", None)
    section["accuracy"] = after
    return section, fitted, kept, before, after


def _ratio_error(allocated, reserved, r: float) -> float:
    """The relative standard error of the fitted ratio r: the residuals r·a/m - 1 over Σ(a/m)²."""
    q = np.asarray(allocated, float) / np.asarray(reserved, float)
    e = r * q - 1
    return float(np.sqrt((e @ e) / max(len(q) - 1, 1) / (q @ q)) / r)


def _allocator_entry(name: str, fitted_rows, every, base: dict) -> tuple[dict, Fitted]:
    a = [r.get("measured_peak_allocated_bytes") for r in fitted_rows]
    m = [r.get("measured_peak_reserved_bytes") for r in fitted_rows]
    ratio = reserved_ratio(a, m)
    worst = max(r.get("measured_peak_reserved_bytes") / r.get("measured_peak_allocated_bytes") for r in every)
    entry = {**base.get(name, {}), "reserved_over_allocated": round(ratio, 4), "reserved_extra_bytes": 0,
             "rows": len(fitted_rows), "reserved_over_allocated_worst": round(worst, 4)}
    shipped = base.get(name, {}).get("reserved_over_allocated")
    return entry, Fitted(f"{name}.reserved_over_allocated", entry["reserved_over_allocated"], shipped, len(fitted_rows),
                         _ratio_error(a, m, ratio))


def fit_memory(rows, base: dict) -> tuple[dict, list[Fitted], list[Kept]]:
    """The caching allocator's reserved/allocated ratios and the device's own memory, as `python -m
    validate fit` fits them (validate/fit.py's docstring): on rows that started clean (an earlier
    engine left under 256 MiB allocated), with the default allocator, apart with stage 3's parameter
    offload; expandable_segments' factor from configurations run with both allocators."""
    from zerocalc.measured import CLEAN_BASE_BYTES
    out, fitted, kept = {}, [], []
    mem = [r for r in rows if r.get("measured_peak_allocated_bytes") and r.get("measured_peak_reserved_bytes")]
    clean = [r for r in mem if (r.get("measured_base_allocated_bytes") or 0) < CLEAN_BASE_BYTES]
    every = [r for r in clean if not r.setup.expandable_segments]
    for name, chosen in (("allocator", [r for r in every if r.setup.offload_param == "none"]),
                         ("allocator_param_offload", [r for r in every if r.setup.offload_param != "none"])):
        if len(chosen) >= 2:
            out[name], f = _allocator_entry(name, chosen, every, base)
            fitted.append(f)
        else:
            what = "without" if name == "allocator" else "with stage 3's"
            kept.append(Kept(f"{name}.reserved_over_allocated", f"{len(chosen)} clean rows {what} parameter offload "
                             "measured allocated and reserved peaks (needs 2)"))
    pairs = _expandable_factors(clean)
    if len(pairs) >= 2:
        factor = float(np.mean(pairs))
        worst = max(r.get("measured_peak_reserved_bytes") / r.get("measured_peak_allocated_bytes")
                    for r in clean if r.setup.expandable_segments)
        out["allocator_expandable"] = {"factor": round(factor, 4), "pairs": len(pairs),
                                       "reserved_over_allocated_worst": round(worst, 4)}
        error = float(np.std(pairs, ddof=1) / np.sqrt(len(pairs)) / factor)
        fitted.append(Fitted("allocator_expandable.factor", round(factor, 4),
                             base.get("allocator_expandable", {}).get("factor"), len(pairs), error))
    else:
        kept.append(Kept("allocator_expandable.factor", f"{len(pairs)} configurations run with both allocators "
                         "(expandable_segments true and false; needs 2)"))
    context = [r.get("measured_device_overhead_bytes") for r in rows if r.get("measured_device_overhead_bytes")]
    if len(context) >= 2:
        median = float(np.median(context))
        mad = float(np.median(np.abs(np.asarray(context) - median)))
        out["device"] = {**base.get("device", {}), "context_bytes": int(median)}
        fitted.append(Fitted("device.context_bytes", int(median), base.get("device", {}).get("context_bytes"),
                             len(context), 1.858 * mad / np.sqrt(len(context)) / median))
    else:
        kept.append(Kept("device.context_bytes", "fewer than 2 rows measured what the GPU holds outside PyTorch's "
                         "cache (measured_device_overhead_bytes)"))
    return out, fitted, kept


def _expandable_factors(clean) -> list[float]:
    """Per configuration run with both allocators: its reserved/allocated ratio with
    expandable_segments:True over the ratio with the default allocator (each the mean of its rows)."""
    by = {}
    for r in clean:
        conf = (r.model, replace(r.setup, expandable_segments=False))
        ratio = r.get("measured_peak_reserved_bytes") / r.get("measured_peak_allocated_bytes")
        by.setdefault(conf, ([], []))[r.setup.expandable_segments].append(ratio)
    return [float(np.mean(on) / np.mean(off)) for off, on in by.values() if on and off]


# What `python -m validate fit` fits and `zerocalc calibrate` does not, and why.
VALIDATOR_ONLY = (
    Kept("activations.hf-llama", "fitted by `python -m validate fit` from the memory at the end of forward"),
    Kept("allocator_simulated.measured_over_simulated_worst", "fitted by `python -m validate fit`, which replays "
         "each job's process"),
    Kept("time.trainer_s_per_micro_step", "measured by the validator's HF Trainer probes (`python -m validate fit`)"),
    Kept("time.trainer_zero_grad_s_per_tensor", "measured by the validator's HF Trainer probes"))


def calibrate(rows, base: dict, paths, notes=(), start: dict | None = None, held: tuple = ()) -> Result:
    """The constants `rows` (`zerocalc.measured.Measured`) determine, fitted (from `start`'s time
    constants where given); every other one, and the `held` time constants, kept at `base`'s (the
    shipped calibration). ValueError where no row can be used."""
    import copy
    timed = [r for r in rows if r.timed and r.model.architecture is not None and r.setup.seq_len]
    skipped = sum(r.timed for r in rows) - len(timed)
    notes = list(notes) + ([f"{skipped} timed rows left out: step time needs an architecture and seq_len"]
                           if skipped else [])
    memory, fitted, kept = fit_memory(rows, base)
    if not timed and not fitted:
        raise ValueError("no usable row: none has a step time (measured_step_s, with seq_len and a model with a shape) "
                         "or allocated and reserved peaks (measured_peak_allocated_bytes, measured_peak_reserved_bytes)")
    cal = copy.deepcopy(base)
    cal.update(memory)
    before = after = None
    if timed:
        cal["time"], t_fitted, t_kept, before, after = fit_time(timed, base, start, held)
        fitted, kept = t_fitted + fitted, t_kept + kept
    else:
        kept.insert(0, Kept("time.*", "no row timed whole optimizer steps (measured_step_s with seq_len)"))
    kept += VALIDATOR_ONLY
    files = ", ".join(os.path.basename(p) for p in paths) if len(paths) <= 3 else \
        f"{len(paths)} files ({os.path.basename(paths[0])}, ...)"
    label = f"{len(timed)} timed rows of {files}" if timed else files
    cal.update(about=f"Calibrated by `zerocalc calibrate` on {label}; the constants the rows do not determine are "
                     "the shipped calibration's (`calibrated.kept`).",
               fitted_on=list(paths), calibrated_on=label,
               calibrated={"gpu": rows[0].hardware.name,
                           "fitted": {f.name: {"value": f.value, "shipped": f.shipped, "rows": f.rows,
                                               "relative_error": round(f.error, 4),
                                               **({"scaled_with": f.tied_to} if f.tied_to else {})} for f in fitted},
                           "kept": {k.name: k.why for k in kept}})
    return Result(cal, tuple(fitted), tuple(kept), tuple(notes), before, after)
