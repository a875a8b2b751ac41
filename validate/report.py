"""Error tables: zerocalc's current predictions against every measured row."""
import pandas as pd

from zerocalc.estimate import estimate
from validate.jobs import to_zerocalc
from validate.rows import job_from_row

GiB = 2**30


def load(paths) -> pd.DataFrame:
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]).assign(source=p) for p in paths]
    # A job run again (--retry-failed) has several rows: the last one counts.
    return pd.concat(frames, ignore_index=True).drop_duplicates("key", keep="last")


def repredict(df: pd.DataFrame) -> pd.DataFrame:
    """Add now_* columns: the current zerocalc's prediction for each row."""
    out = df.copy()
    state, comm, peak = [], [], []
    for _, r in df.iterrows():
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        e = estimate(spec, setup)
        state.append(e.states.resident_bytes)
        comm.append(e.comm_bytes)
        peak.append(e.peak_bytes)
    out["now_state_bytes"], out["now_comm_bytes"], out["now_peak_allocated_bytes"] = state, comm, peak
    return out


def _rel(pred, meas):
    return (pred - meas) / meas


def _table(df, pred, meas, label, exact):
    lines = [f"{label}", f"{'stage':>5} {'rows':>5} {'exact':>6} {'mean |err|':>11} {'max |err|':>10}"]
    for stage, g in df.groupby("stage"):
        g = g[g[meas].notna()]
        if g.empty:
            continue
        err = _rel(g[pred].astype(float), g[meas].astype(float)).abs()
        same = int((g[pred].astype("int64") == g[meas].astype("int64")).sum()) if exact else "-"
        lines.append(f"{stage:>5} {len(g):>5} {same!s:>6} {err.mean():>10.2%} {err.max():>10.2%}")
    return lines


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
    if "measured_peak_allocated_bytes" in ok and ok["measured_peak_allocated_bytes"].notna().any():
        lines += [""] + _table(ok, "now_peak_allocated_bytes", "measured_peak_allocated_bytes",
                               "Peak allocated (torch.cuda.max_memory_allocated), predicted vs measured", False)
    scal = ok["measured_scalar_bytes"].max() if "measured_scalar_bytes" in ok else 0
    lines += ["", f"Residual not modelled: scalar tensors of <= 8 bytes (grad norm, overflow flag), at most {scal:.0f} B/rank."]
    return "\n".join(lines), exact
