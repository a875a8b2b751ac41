"""`python -m validate fit`: the few constants the closed form cannot know, by least squares on a
training split of the measured GPU rows; the held-out split is reported, never fitted.

Constants (all named in the calibration JSON):
- activations.hf-llama.h, .kv: bytes per token per layer of Llama's attention and RMSNorm part in
  units of the dtype (the MLP's 4f is counted by hand), from the memory at the end of forward.
- allocator.reserved_over_allocated, allocator.reserved_extra_bytes: PyTorch's caching allocator
  keeps freed blocks; reserved peak ≈ ratio · allocated peak + extra (fitted on rows that start clean).
- device.context_bytes: what the GPU holds outside PyTorch's cache (CUDA context, NCCL, cuBLAS
  workspaces), the median of `measured_device_overhead_bytes`.
- time.*: the step-time model's constants (`zerocalc/timing.py`): efficiency η and the per-layer
  launch floor by a grid search, the rest by non-negative least squares on what remains, minimising
  the mean relative error of the training split.
"""
import hashlib
import json

import numpy as np
import pandas as pd

from validate.jobs import to_zerocalc
from validate.report import load, started_clean
from validate.rows import job_from_row
from zerocalc import calibration
from zerocalc.estimate import estimate

def held_out(key: str) -> bool:
    """A fixed 25% of configurations, chosen by a hash of the key: never used for fitting."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 4 == 0


def gpu_rows(paths) -> pd.DataFrame:
    df = load(paths)
    df = df[(df["outcome"] == "ok") & df["measured_peak_allocated_bytes"].notna()].copy()
    df["held_out"] = df["key"].map(held_out)
    return df


def _llama_activation_rows(df, cal):
    rows = []
    for _, r in df[(df["family"] == "hf-llama") & ~df["activation_checkpointing"].astype(bool)].iterrows():
        if int(r["stage"]) == 3 and int(r["nproc"]) > 1:
            continue   # gathered parameters sit beside the activations there
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        resident = estimate(spec, setup, cal=cal).states.resident_bytes
        tokens = int(r["micro_batch"]) * int(r["seq_len"])
        kept = r["measured_forward_end_bytes"] - r["measured_base_allocated_bytes"] - resident
        units = (kept - 4 * tokens * int(r["vocab_size"])) / (2 * tokens * int(r["num_layers"]))
        a = spec.architecture
        f_units = cal["activations"]["hf-llama"]["f"] * a.ffn_hidden_size
        rows.append((a.hidden_size, a.num_kv_heads * a.head_dim, units - f_units, r["held_out"]))
    return rows


def _nonneg_lstsq(x, y):
    """Least squares with coefficients >= 0: drop the columns that come out negative and refit."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or not keep:
            out = np.zeros(x.shape[1])
            out[keep] = coef
            return out
        keep = [k for k, c in zip(keep, coef) if c >= 0]


def time_features(df):
    from zerocalc.hardware import gpu
    from zerocalc.timing import features
    rows = []
    for _, r in df.iterrows():
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        e = estimate(spec, setup)
        rows.append(features(spec, setup, e.collectives, gpu("h200")) | {"dp": setup.dp})
    return pd.DataFrame(rows, index=df.index)


def fit_time(train: pd.DataFrame) -> dict:
    f = time_features(train)
    y = train["measured_step_s"].to_numpy(float)
    best = None
    for eta in np.linspace(0.15, 0.9, 31):
        for launch in np.linspace(0.1e-3, 3e-3, 30):
            for module in np.linspace(0.0, 1.5e-3, 16):
                cpu = f["launch_layers"] * launch + f["modules"] * module
                compute = f["gas"] * np.maximum(f["flops_over_peak"] / eta, cpu)
                x = np.vstack([f["optimizer_elements"], np.ones(len(f)),
                               np.where(f["dp"] > 1, f["wire_over_bandwidth"], 0.0)]).T
                coef = _nonneg_lstsq(x / y[:, None], (y - compute) / y)   # relative residuals
                err = np.abs((compute + x @ coef - y) / y).mean()
                if best is None or err < best[0]:
                    best = (err, eta, launch, module, coef)
    _, eta, launch, module, (per_element, step0, inv_eff) = best
    return {"efficiency": round(float(eta), 4), "launch_s_per_layer": float(launch), "module_hook_s": float(module),
            "optimizer_s_per_element": float(per_element), "step_overhead_s": float(step0),
            "link_efficiency": round(1 / float(inv_eff), 4) if inv_eff > 0 else 1.0, "rows": int(len(train))}


def fit(paths, out_path=None) -> tuple[dict, str]:
    cal = json.loads(json.dumps(calibration.default()))
    df = gpu_rows(paths)
    train = df[~df["held_out"]]
    lines = [f"{len(df)} GPU rows: {len(train)} for fitting, {len(df) - len(train)} held out"]
    act = [r for r in _llama_activation_rows(train, cal)]
    if len(act) >= 2:
        x = np.array([[h, kv] for h, kv, _, _ in act], dtype=float)
        y = np.array([u for _, _, u, _ in act])
        (ch, ckv), *_ = np.linalg.lstsq(x, y, rcond=None)
        cal["activations"]["hf-llama"].update(h=round(float(ch), 3), kv=round(float(ckv), 3))
        lines.append(f"activations.hf-llama: h {ch:.3f}, kv {ckv:.3f} (units of b per token per layer; "
                     f"{len(act)} rows)")
    clean = train[started_clean(train)]
    if len(clean) >= 2:
        x = np.vstack([clean["measured_peak_allocated_bytes"].astype(float), np.ones(len(clean))]).T
        (ratio, extra), *_ = np.linalg.lstsq(x, clean["measured_peak_reserved_bytes"].astype(float), rcond=None)
        cal["allocator"] = {"reserved_over_allocated": round(float(ratio), 4), "reserved_extra_bytes": int(extra),
                            "rows": int(len(clean))}
        lines.append(f"allocator: reserved = {ratio:.3f} × allocated + {extra / 2**30:.2f} GiB ({len(clean)} clean rows)")
    timed = train[train["measured_step_s"].notna()]
    if len(timed) >= 6:
        cal["time"] = fit_time(timed)
        t = cal["time"]
        lines.append(f"time: efficiency {t['efficiency']:.3f} of peak, launch floor {t['launch_s_per_layer'] * 1e3:.2f} "
                     f"ms/layer-pass, stage-3 hook {t['module_hook_s'] * 1e3:.3f} ms/module, optimizer "
                     f"{t['optimizer_s_per_element'] * 1e12:.1f} ps/element + {t['step_overhead_s'] * 1e3:.1f} ms, "
                     f"link efficiency {t['link_efficiency']:.3f} ({len(timed)} rows)")
    cal["device"] = {"context_bytes": int(df["measured_device_overhead_bytes"].median()),
                     "gpu": str(df["gpu"].iloc[0])}
    lines.append(f"device.context_bytes: {cal['device']['context_bytes'] / 2**30:.2f} GiB (median of {len(df)} rows)")
    cal["fitted_on"] = sorted(set(paths))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(cal, f, indent=2)
            f.write("\n")
        lines.append(f"wrote {out_path}")
    return cal, "\n".join(lines)
