"""The fitted constants from measured rows: the one fitting code, which `python -m validate fit` (the
shipped calibration) and `zerocalc calibrate` (a user's own) both call.

The step-time constants (`zerocalc/timing.py`) are fitted by Levenberg–Marquardt on the log ratio of
predicted to measured forward, backward, optimizer-step and (four times weighted) whole-step times,
each constant in log space, the shares (link efficiency, host_launch_share) through a logistic and
the compute efficiency as a share of its ceiling. The reserved/allocated ratio is the one minimizing
the squared relative error. docs/step-time.md has the model; docs/your-cluster.md the user's side.
"""
import numpy as np

from zerocalc.timing import STEP_CLASSES, phase_times, whole_step_s

# The time constants, fitted in log space (all positive); the shares through a logistic (0 < ε, φ ≤ 1).
SCALARS = ("efficiency", "activation_passes", "launch_fwd_s_per_layer", "launch_bwd_s_per_layer", "launch_s_per_op",
           "checkpoint_fwd_s_per_layer", "module_hook_s", "gather_call_s", "link_efficiency", "grad_hook_s",
           "grad_move_s", "host_link_bytes_per_s", "host_adam_elements_per_s", "host_pageable_bytes_per_s",
           "host_launch_share")
SHARES = ("link_efficiency", "host_launch_share", "inter_node_link_efficiency")
START = {"efficiency": 0.45, "activation_passes": 1.0, "launch_fwd_s_per_layer": 1.5e-3, "launch_bwd_s_per_layer": 2.5e-3,
         "launch_s_per_op": 1e-5,
         "checkpoint_fwd_s_per_layer": 5e-4, "module_hook_s": 5e-4, "gather_call_s": 2e-4, "link_efficiency": 0.5,
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
                  free: tuple | None = None, start: dict | None = None) -> dict:
    """The time constants minimizing the weighted log ratios of `predict(feats)` to `measured` (rows ×
    forward, backward, optimizer step, whole step; NaN: not measured, left out), the efficiency at most
    `efficiency_max`; `fixed` constants held as given. `free`: the names (`PARAMS`, `INTER_NODE`) to
    fit, the others held at `start` (default: every one of PARAMS, from START)."""
    fixed = fixed or {}
    names = PARAMS if free is None else tuple(free)
    start = start or {**START, "efficiency": min(START["efficiency"], efficiency_max / 2)}
    z0 = pack(start, efficiency_max, names)
    base = {**start, **fixed}

    def constants(z):
        k = unpack(z, efficiency_max, names)
        return {**base, **{g: ({**base[g], **v} if isinstance(v, dict) else v) for g, v in k.items()}}

    return constants(levenberg_marquardt(lambda z: log_residuals(feats, measured, constants(z)), z0))


def reserved_ratio(allocated, reserved) -> float:
    """The reserved/allocated ratio r minimizing the squared relative error of r·allocated against the
    measured reserved (the target is relative; bytes would let the largest runs decide alone):
    r = Σ(a/m) / Σ(a/m)²."""
    q = np.asarray(allocated, dtype=float) / np.asarray(reserved, dtype=float)
    return float(q.sum() / (q * q).sum())
