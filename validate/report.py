"""Error tables: zerocalc's current predictions against every measured row."""
import pandas as pd

from zerocalc.estimate import estimate
from validate.jobs import to_zerocalc
from validate.rows import job_from_row, predicted_state_bytes

GiB = 2**30
CLEAN_BASE_BYTES = 2**28   # rows whose job started with less than this left over from an earlier engine


def own_peak_allocated(df: pd.DataFrame) -> pd.Series:
    """The job's own peak: max_memory_allocated less what an earlier stage-3 engine left allocated
    (DeepSpeed 0.19.8 does not free one; see data/README.md)."""
    return df["measured_peak_allocated_bytes"] - df["measured_base_allocated_bytes"]


def started_clean(df: pd.DataFrame) -> pd.Series:
    """Rows whose reserved peak is not inflated by an earlier engine's leftovers."""
    return df["measured_base_allocated_bytes"] < CLEAN_BASE_BYTES


def load(paths) -> pd.DataFrame:
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]).assign(source=p) for p in paths]
    # A job run again (--retry-failed) has several rows: the last one counts.
    return pd.concat(frames, ignore_index=True).drop_duplicates("key", keep="last")


def repredict(df: pd.DataFrame) -> pd.DataFrame:
    """Add now_* columns: the current zerocalc's prediction for each row."""
    out = df.copy()
    cols = {"now_state_bytes": [], "now_comm_bytes": [], "now_peak_allocated_bytes": [],
            "now_peak_reserved_bytes": [], "now_peak_phase": [], "now_step_s": [], "now_forward_s": [],
            "now_backward_s": [], "now_step_phase_s": []}
    from zerocalc.hardware import gpu
    for _, r in df.iterrows():
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        e = estimate(spec, setup, hardware=gpu("h200"))
        t = e.time
        for k, v in (("now_step_s", "step_s"), ("now_forward_s", "forward_s"), ("now_backward_s", "backward_s"),
                     ("now_step_phase_s", "optimizer_s")):
            cols[k].append(getattr(t, v) if t else float("nan"))
        for k, v in (("now_state_bytes", predicted_state_bytes(e, r["backend"])), ("now_comm_bytes", e.comm_bytes),
                     ("now_peak_allocated_bytes", e.peak_bytes), ("now_peak_reserved_bytes", e.peak_reserved_bytes),
                     ("now_peak_phase", e.peak.name)):
            cols[k].append(v)
    for k, v in cols.items():
        out[k] = v
    return out


def _rel(pred, meas):
    return (pred - meas) / meas


def _table(df, pred, meas, label, exact, target=None):
    """Per stage: rows, how many are exact (or within `target`), mean and max relative error."""
    head = "exact" if exact else "in tgt"
    lines = [f"{label}", f"{'stage':>5} {'rows':>5} {head:>6} {'mean |err|':>11} {'max |err|':>10}"]
    for stage, g in df.groupby("stage"):
        g = g[g[meas].notna()]
        if g.empty:
            continue
        err = _rel(g[pred].astype(float), g[meas].astype(float)).abs()
        same = int((g[pred].astype("int64") == g[meas].astype("int64")).sum()) if exact else int((err <= target).sum())
        lines.append(f"{stage:>5} {len(g):>5} {same!s:>6} {err.mean():>10.2%} {err.max():>10.2%}")
    return lines


def _step_spread(gpu: pd.DataFrame) -> list[str]:
    """The timed steps' own spread, (slowest - fastest) / median, where the rows record every step."""
    if "measured_step_times_s" not in gpu:
        return []
    import json
    spread = []
    for text, median in zip(gpu["measured_step_times_s"], gpu["measured_step_s"]):
        times = json.loads(text) if isinstance(text, str) and text.startswith("[") else []
        if len(times) >= 2:
            spread.append((max(times) - min(times)) / median)
    if not spread:
        return []
    spread = pd.Series(spread)
    return ["", f"Spread of the timed steps within a row ({len(spread)} rows that record them): median "
                f"{spread.median():.1%}, worst {spread.max():.1%}"]


def report(paths) -> tuple[str, bool]:
    df = load(paths)
    ok = df[df["outcome"] == "ok"]
    lines = [f"{len(df)} rows from {', '.join(paths)}: " +
             ", ".join(f"{k} {v}" for k, v in df["outcome"].value_counts().items())]
    if ok.empty:
        return "\n".join(lines), False
    ok = repredict(ok)
    lines += [""] + _table(ok, "now_state_bytes", "measured_state_bytes",
                           "Resident state bytes per rank after a step (max over ranks); exact = to the byte", True)
    lines += [""] + _table(ok, "now_comm_bytes", "measured_comm_bytes",
                           "Logged communication bytes per optimizer step (all collectives)", True)
    exact = bool((ok["now_state_bytes"] == ok["measured_state_bytes"].astype("int64")).all()
                 and (ok["now_comm_bytes"] == ok["measured_comm_bytes"].astype("int64")).all())
    gpu = ok[ok["measured_peak_allocated_bytes"].notna()] if "measured_peak_allocated_bytes" in ok else ok.iloc[0:0]
    if not gpu.empty:
        from validate.fit import held_out
        gpu = gpu.assign(own_peak=own_peak_allocated(gpu),
                         split=gpu["key"].map(lambda k: "held-out" if held_out(k) else "train"))
        for split, g in [("all", gpu)] + list(gpu.groupby("split")):
            lines += [""] + _table(g, "now_peak_allocated_bytes", "own_peak",
                                   f"Peak allocated (max_memory_allocated less what an earlier engine left), {split}"
                                   f" rows; target 5%", False, 0.05)
        clean = gpu[started_clean(gpu)]
        lines += [""] + _table(clean, "now_peak_reserved_bytes", "measured_peak_reserved_bytes",
                               "Peak reserved (max_memory_reserved), rows that started clean; target 10%", False, 0.10)
        for split, g in [("all", gpu)] + list(gpu.groupby("split")):
            lines += [""] + _table(g, "now_step_s", "measured_step_s", f"Step time (median of the timed steps), {split}"
                                   " rows; target 15%", False, 0.15)
        for pred, meas, name in (("now_forward_s", "measured_forward_s", "forward"),
                                 ("now_backward_s", "measured_backward_s", "backward"),
                                 ("now_step_phase_s", "measured_step_phase_s", "optimizer step")):
            lines += [""] + _table(gpu, pred, meas, f"Step time, {name} phase alone, all rows (within 15%)", False, 0.15)
        lines += _step_spread(gpu)
    scal = ok["measured_scalar_bytes"].max() if "measured_scalar_bytes" in ok else 0
    lines += ["", f"Residual not modelled: scalar tensors of <= 8 bytes (grad norm, overflow flag), at most {scal:.0f} B/rank."]
    return "\n".join(lines), exact
