"""`zerocalc report` and `zerocalc calibrate`'s printout: measured rows (`zerocalc.measured`) beside
zerocalc's predictions for them, as an error table, a figure (matplotlib, the `plot` extra) and the
list of constants a calibration fitted and kept. The predictions are what `zerocalc estimate` gives
for each row's model and setup, its step time at the host speed the row measured (docs/your-cluster.md)."""
from dataclasses import dataclass

import numpy as np

from zerocalc import calibrate
from zerocalc.measured import CLEAN_BASE_BYTES
from zerocalc.timing import accuracy_regime
from zerocalc.units import gib

TARGET = 0.15   # the step-time error counted as close, as docs/accuracy.md counts it


@dataclass(frozen=True)
class Compared:
    where: str
    key: str
    regime: str
    step_s: float | None              # measured, then predicted
    predicted_step_s: float | None
    allocated_bytes: float | None     # the job's own peak (less what an earlier engine left)
    predicted_allocated_bytes: int | None
    reserved_bytes: float | None      # where the job started clean
    predicted_reserved_bytes: int | None

    @property
    def step_error(self) -> float | None:
        return None if self.predicted_step_s is None else self.predicted_step_s / self.step_s - 1


def compare(rows, cal: dict, memory: bool = True) -> list[Compared]:
    """Each row's measurements beside the predictions with calibration `cal`."""
    from zerocalc.estimate import estimate
    timed = [r for r in rows if r.timed and r.model.architecture is not None and r.setup.seq_len]
    typical = cal["time"].get("host_launch_s") or calibrate.typical_launch_s(rows)
    steps = calibrate.predict(calibrate.time_features(timed, cal, typical), cal["time"])[:, 3] if timed else []
    predicted = dict(zip((r.where for r in timed), steps))
    out = []
    for r in rows:
        s = r.setup
        regime = accuracy_regime(s.stage, s.dp, (s.offload_optimizer, s.offload_param) != ("none", "none"))
        base = r.get("measured_base_allocated_bytes") or 0
        allocated = r.get("measured_peak_allocated_bytes")
        reserved = r.get("measured_peak_reserved_bytes") if base < CLEAN_BASE_BYTES else None
        e = estimate(r.model, s, cal=cal) if memory and (allocated or reserved) else None
        out.append(Compared(r.where, r.key, regime, r.get("measured_step_s") if r.where in predicted else None,
                            predicted.get(r.where), allocated and allocated - base, e and e.peak_bytes,
                            reserved, e and reserved and e.peak_reserved_bytes))
    return out


def _label(key: str) -> str:
    """A row's key to 40 characters, without the validator's digest at its end."""
    head, _, tail = key.rpartition("-")
    key = head if head and len(tail) == 10 and all(ch in "0123456789abcdef" for ch in tail) else key
    return key if len(key) <= 40 else key[:39] + "…"


def _pct(x) -> str:
    return "" if x is None else f"{x:+.1%}"


def _summary(label: str, pairs, target: float) -> str:
    err = np.abs(np.array([p / m - 1 for m, p in pairs]))
    return (f"  {label}: {int((err <= target).sum())} of {len(err)} rows within {target:.0%} (mean |error| {err.mean():.1%}, "
            f"worst {err.max():.0%})")


def table(compared: list[Compared], label: str) -> str:
    """The error table: one line per row, then each quantity's summary (step time also by regime)."""
    lines = [f"Predicted against measured, {label}:",
             f"  {'row':40s} {'regime':20s} {'step ms':>9s} {'pred':>9s} {'err':>7s} {'alloc GiB':>10s} {'pred':>7s} "
             f"{'err':>7s} {'resv GiB':>9s} {'pred':>7s} {'err':>7s}"]
    for c in compared:
        def cell(m, p, scale, width):
            return (f"{m * scale:{width}.2f} {p * scale:7.2f} {_pct(p / m - 1):>7s}" if m and p
                    else f"{'':{width}s} {'':7s} {'':7s}")
        step = (f"{c.step_s * 1e3:9.1f} {c.predicted_step_s * 1e3:9.1f} {_pct(c.step_error):>7s}" if c.step_s
                else f"{'':9s} {'':9s} {'':7s}")
        lines.append(f"  {_label(c.key):40s} {c.regime:20s} {step} {cell(c.allocated_bytes, c.predicted_allocated_bytes, 1 / 2**30, 10)} "
                     f"{cell(c.reserved_bytes, c.predicted_reserved_bytes, 1 / 2**30, 9)}")
    lines.append("Summary:")
    summarized = len(lines)
    steps = [(c.step_s, c.predicted_step_s) for c in compared if c.step_s]
    if steps:
        lines.append(_summary("step time", steps, TARGET))
        for regime in sorted({c.regime for c in compared if c.step_s}):
            lines.append(_summary(f"  {regime}", [(c.step_s, c.predicted_step_s) for c in compared
                                                  if c.step_s and c.regime == regime], TARGET))
    for name, m, p, target in (("peak allocated", "allocated_bytes", "predicted_allocated_bytes", 0.03),
                               ("peak reserved", "reserved_bytes", "predicted_reserved_bytes", 0.08)):
        pairs = [(getattr(c, m), getattr(c, p)) for c in compared if getattr(c, m) and getattr(c, p)]
        if pairs:
            lines.append(_summary(name, pairs, target))
    if len(lines) == summarized:
        lines.append("  nothing to compare: no row has a step time with seq_len and a model with a shape, or a "
                     "measured peak")
    return "\n".join(lines)


def figure(compared: list[Compared], path: str, label: str) -> None:
    """Predicted against measured step time (and peak reserved, where measured), log-log, the ±15% band
    shaded, written to `path`. ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter
    panels = [("step time (s)", [(c.step_s, c.predicted_step_s) for c in compared if c.step_s], TARGET),
              ("peak reserved (GiB)", [(gib(c.reserved_bytes), gib(c.predicted_reserved_bytes)) for c in compared
                                       if c.reserved_bytes and c.predicted_reserved_bytes], 0.08)]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5 * max(len(panels), 1), 4.5), squeeze=False)
    for ax, (what, pairs, target) in zip(axes[0], panels):
        m, p = np.array(pairs).T
        lo, hi = min(m.min(), p.min()) / 1.3, max(m.max(), p.max()) * 1.3
        x = np.geomspace(lo, hi, 50)
        ax.fill_between(x, x * (1 - target), x * (1 + target), color="0.9", label=f"±{target:.0%}")
        ax.plot(x, x, color="0.5", lw=0.8)
        ax.scatter(m, p, s=14)
        ax.set(xscale="log", yscale="log", xlabel=f"measured {what}", ylabel=f"predicted {what}", xlim=(lo, hi), ylim=(lo, hi))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
        ax.legend(loc="upper left", frameon=False)
    fig.suptitle(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibration_text(result, rows_read: int, out_path: str) -> str:
    """What `zerocalc calibrate` prints: each fitted constant beside the shipped value with its fit
    error and rows, each kept one and why, and the step time's error before and after."""
    lines = [f"Calibrated on {result.calibration['calibrated_on']} ({rows_read} rows read; GPU "
             f"{result.calibration['calibrated']['gpu']})."]
    lines += [f"  note: {n}" for n in result.notes]
    lines.append("Fitted (value, the shipped value, fit error as one standard error, rows it was fitted on):")
    for f in result.fitted:
        shipped = "" if f.shipped is None else f"{f.shipped:.4g}"
        tied = f"  (scaled with {f.tied_to}: the rows cannot tell them apart)" if f.tied_to else ""
        lines.append(f"  {f.name:48s} {f.value:11.4g}  shipped {shipped:>10s}  ±{f.error:6.1%}  {f.rows:5d} rows{tied}")
    lines.append("Kept at the shipped calibration's (these rows do not determine them):")
    lines += [f"  {k.name}: {k.why}" for k in result.kept]
    if result.after:
        b, a = result.before, result.after
        lines.append(f"Step time on these {a['rows']} rows: mean |error| {a['mean_abs_error']:.1%} ({a['within_15pct']} within "
                     f"15%) with the fitted constants, {b['mean_abs_error']:.1%} ({b['within_15pct']}) with the shipped ones.")
    lines.append(f"wrote {out_path}: give it to estimate, plan or sweep as --calibration {out_path}")
    return "\n".join(lines)
