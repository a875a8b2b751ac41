"""Writes predicted_vs_measured.ipynb (kept as code here so that diffs stay readable)."""
import nbformat as nbf

cells = [
    ("md", "# Predicted vs measured peak memory and step time\n\nzerocalc's current predictions against every H200 "
           "configuration in `data/` (`python -m validate report` prints the same errors as a table). "
           "Beside them, the ZeRO paper's formula and DeepSpeed's own estimator, which count model states "
           "only. Figures are written to `docs/figures/`."),
    ("code", """import os, sys
ROOT = os.path.abspath(os.path.join(os.getcwd(), "..")) if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
sys.path.insert(0, ROOT)
import glob
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from validate.report import load, own_peak_allocated, repredict, started_clean
from validate.rows import job_from_row
from validate.jobs import to_zerocalc
from validate.fit import held_out_rows
from zerocalc import reference
from zerocalc.estimate import estimate
GiB = 2**30
FIG = os.path.join(ROOT, "docs", "figures")
os.makedirs(FIG, exist_ok=True)
paths = sorted(glob.glob(os.path.join(ROOT, "data", "h200-*.csv")))
df = repredict(load(paths))
df = df[df["outcome"] == "ok"].copy()
df["measured"] = own_peak_allocated(df) / GiB
df["predicted"] = df["now_peak_allocated_bytes"] / GiB
df["held_out"] = held_out_rows(df)
df["paper"] = [reference.paper_model_states_bytes(r.num_params, r.nproc, r.stage) / GiB for r in df.itertuples()]
df["ds_estimator"] = [(reference.deepspeed_estimator_gpu_bytes(r.num_params, max(to_zerocalc(job_from_row(r._asdict()))[0].param_numels), r.nproc, r.stage) or float("nan")) / GiB for r in df.itertuples()]
print(len(df), "configurations from", [os.path.basename(p) for p in paths])"""),
    ("code", """fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
lim = max(df["measured"].max(), df["predicted"].max()) * 1.08
for stage, g in df.groupby("stage"):
    axes[0].scatter(g["measured"], g["predicted"], label=f"stage {stage}", s=30)
    axes[0].scatter(g["measured"], g["paper"], marker="x", s=18, color="gray", alpha=0.6)
axes[0].plot([0, lim], [0, lim], "k--", lw=1, label="identity")
axes[0].plot([0, lim], [0, 1.05 * lim], "k:", lw=0.7)
axes[0].plot([0, lim], [0, 0.95 * lim], "k:", lw=0.7, label="±5%")
axes[0].scatter([], [], marker="x", color="gray", label="ZeRO paper formula")
axes[0].set(xlim=(0, lim), ylim=(0, lim), xlabel="measured peak allocated (GiB)", ylabel="predicted (GiB)",
            title="zerocalc vs H200 (x: the paper's model states)")
axes[0].legend(fontsize=8)
clean = df[started_clean(df)]
for source, marker, label in (("simulated", "o", "allocation sequence simulated"),
                              ("ratio", "^", "calibrated ratio (not generated)")):
    g = clean[clean["now_reserved_source"] == source]
    axes[1].scatter(g["measured_peak_reserved_bytes"] / GiB, g["now_peak_reserved_bytes"] / GiB, c=g["stage"],
                    vmin=0, vmax=3, marker=marker, s=30, label=label)
lim2 = clean["measured_peak_reserved_bytes"].max() / GiB * 1.08
axes[1].plot([0, lim2], [0, lim2], "k--", lw=1)
axes[1].plot([0, lim2], [0, 1.1 * lim2], "k:", lw=0.7)
axes[1].plot([0, lim2], [0, 0.9 * lim2], "k:", lw=0.7, label="±10%")
axes[1].set(xlim=(0, lim2), ylim=(0, lim2), xlabel="measured peak reserved (GiB)", ylabel="predicted (GiB)",
            title="reserved (rows that started clean; colour: stage 0 dark to 3 yellow)")
for handle in axes[1].legend(fontsize=8).legend_handles[:2]:   # the marker says the source, not the stage
    handle.set_color("gray")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "predicted_vs_measured.png"), dpi=110)"""),
    ("code", """df["err_pct"] = 100 * (df["predicted"] - df["measured"]) / df["measured"]
df["paper_err_pct"] = 100 * (df["paper"] - df["measured"]) / df["measured"]
df["ds_err_pct"] = 100 * (df["ds_estimator"] - df["measured"]) / df["measured"]
d = df.sort_values(["stage", "num_params"]).reset_index(drop=True)
fig, ax = plt.subplots(figsize=(12, 4.5))
ax.bar(d.index - 0.25, d["err_pct"], width=0.25, label="zerocalc")
ax.bar(d.index, d["paper_err_pct"], width=0.25, label="ZeRO paper (model states)")
ax.bar(d.index + 0.25, d["ds_err_pct"], width=0.25, label="DeepSpeed estimator (stages 2, 3)")
ax.axhspan(-5, 5, color="green", alpha=0.1)
ax.set(ylabel="error vs measured peak (%)", xlabel="configuration (sorted by stage, then size)", ylim=(-100, 60))
ax.set_xticks(d.index, [f"s{s}" for s in d["stage"]], fontsize=7)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIG, "error_per_configuration.png"), dpi=110)
print(d.groupby("stage")[["err_pct", "paper_err_pct", "ds_err_pct"]].agg(lambda x: x.abs().mean()).round(1))
print("held-out mean |error| %:", d.loc[d.held_out, "err_pct"].abs().mean().round(2))"""),
    ("code", """# Phase breakdown of a few configurations: the case study (1.4B GPT, N = 2) at stages 0 and 3, and a 7B.
picks = df[(df["hidden_size"].isin([2048, 4096])) & (df["nproc"] == 2)].sort_values(["hidden_size", "stage"])
fig, axes = plt.subplots(1, len(picks), figsize=(3.2 * len(picks), 4.5), sharey=False)
for ax, (_, r) in zip(axes, picks.iterrows()):
    spec, setup = to_zerocalc(job_from_row(r.to_dict()))
    e = estimate(spec, setup)
    names = [p.name for p in e.phases]
    parts = {"states": [p.states_bytes for p in e.phases], "gradients": [p.grads_bytes for p in e.phases],
             "buffers": [p.buffers_bytes for p in e.phases], "activations": [p.activation_bytes for p in e.phases]}
    bottom = [0] * len(names)
    for label, vals in parts.items():
        ax.bar(names, [v / GiB for v in vals], bottom=bottom, label=label)
        bottom = [b + v / GiB for b, v in zip(bottom, vals)]
    measured = [(r[f"measured_{n}_peak_bytes"] - r["measured_base_allocated_bytes"]) / GiB for n in names]
    ax.plot(names, measured, "k_", markersize=25, mew=2, label="measured")
    ax.set_title(f"{r['family']} {r['num_params']/1e9:.1f}B s{r['stage']} N={r['nproc']}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
axes[0].set_ylabel("GiB")
axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(os.path.join(FIG, "phase_breakdown.png"), dpi=110)"""),
    ("code", """# Step time: the rows timed as training runs (whole steps, no phase synchronizes), predicted on each
# row's own host speed where the validator probed it before every timed step (the host's speed is an
# input: these steps are host-bound); each bar spans the row's own fastest..slowest step, the band is
# the issue's ±15%.
from validate.report import step_range, timed_whole_steps
t = df[timed_whole_steps(df)].copy()
r = step_range(t)
ms = 1e3
fig, ax = plt.subplots(figsize=(6.5, 6))
for stage, g in t.groupby("stage"):
    rg = r.loc[g.index]
    ax.errorbar(g["measured_step_s"] * ms, g["now_step_s"] * ms, fmt="o", ms=5, label=f"stage {stage}",
                xerr=[(g["measured_step_s"] - rg["fastest"]) * ms, (rg["slowest"] - g["measured_step_s"]) * ms], elinewidth=0.8)
lim = max(t["measured_step_s"].max(), t["now_step_s"].max()) * ms * 1.1
ax.plot([0, lim], [0, lim], "k--", lw=1, label="identity")
ax.fill_between([0, lim], [0, 0.85 * lim], [0, 1.15 * lim], color="green", alpha=0.08, label="±15%")
ax.set(xlim=(0, lim), ylim=(0, lim), xlabel="measured step time, median (ms)", ylabel="predicted (ms)",
       title=f"step time on H200 ({len(t)} rows; bars: the row's own steps)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIG, "step_time.png"), dpi=110)
err = (t["now_step_s"] / t["measured_step_s"] - 1).abs()
print(f"step time: mean |error| {err.mean():.1%}, {int((err <= 0.15).sum())} of {len(t)} within 15%")
fitted = (t["now_step_fitted_host_s"] / t["measured_step_s"] - 1).abs()
print(f"at the fitted hosts' median speed (zerocalc estimate without --host-launch-us): mean |error| "
      f"{fitted.mean():.1%}, {int((fitted <= 0.15).sum())} of {len(t)} within 15%")"""),
    ("code", """# Step time per configuration, cross-validated (`python -m validate crossval`): each quarter of the
# configurations predicted by the time constants fitted on the other three, so every point is one the fit
# never saw; a point is the median of the configuration's jobs, its bar their fastest..slowest.
from validate.fit import cross_validate_time
from validate.report import by_configuration
cv, _ = cross_validate_time(paths)
by = by_configuration(cv.assign(now_step_s=cv["cv_step_s"])).rename(
    columns={"measured_step_s": "measured", "now_step_s": "predicted"})
n, within = len(by), int(((by["predicted"] / by["measured"] - 1).abs() <= 0.15).sum())
fig, ax = plt.subplots(figsize=(6.5, 6))
for stage, g in by.groupby("stage"):
    ax.errorbar(g["measured"] * ms, g["predicted"] * ms, fmt="o", ms=5, label=f"stage {stage}", elinewidth=0.8,
                xerr=[(g["measured"] - g["fastest"]) * ms, (g["slowest"] - g["measured"]) * ms])
lo, hi = by[["measured", "predicted"]].min().min() * ms * 0.8, by[["measured", "predicted"]].max().max() * ms * 1.25
ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="green", alpha=0.08, label="±15%")
ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time, median of the jobs (ms)",
       ylabel="predicted by a fit without this configuration (ms)",
       title=f"per configuration, cross-validated: {within} of {n} within 15%")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(FIG, "step_time_crossval.png"), dpi=110)
print(f"cross-validated: {within} of {n} configurations within 15%")"""),
    ("md", "## The caching allocator, simulated\n\nReserved memory beyond the allocated peak is the caching "
           "allocator's: which segments it cudaMallocs depends on the order of allocations. `zerocalc.allocator` "
           "replays the allocations of recorded histories (model build to the end of warm-up, `data/snapshots/`); "
           "its reserved memory follows the recorded one segment by segment."),
    ("code", """from validate.snapshot import load as load_history, reserved_timelines
picks = ["t3-warmup/seed-gpt-h768-l12-s2-bf16", "t3-warmup/seed-gpt-h2048-l24-s3", "t3-warmup-b/hf-llama-h768-l12-s3"]
titles = ["160M GPT, stage 2, 1×2048 (1 stream)", "1.4B GPT, stage 3 + offload (3 streams)",
          "130M Llama, stage 3 (init empties the cache)"]
fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
for ax, pick, title in zip(axes, picks, titles):
    path = sorted(glob.glob(os.path.join(ROOT, "data", "snapshots", pick + "*.json.gz")))[0]
    recorded, simulated = reserved_timelines(load_history(path))
    for series, style, label in ((recorded, "-", "recorded by the allocator"), (simulated, "--", "zerocalc.allocator")):
        ax.step([j for j, _ in series], [v / GiB for _, v in series], style, where="post", label=label)
    ax.set(title=title, xlabel="allocator event", ylabel="reserved since model build (GiB)")
    ax.legend(fontsize=8)
    print(f"{pick}: recorded peak {max(v for _, v in recorded) / GiB:.3f} GiB, simulated {max(v for _, v in simulated) / GiB:.3f} GiB")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "allocator_replay.png"), dpi=110)"""),
    ("md", "## The allocation sequence, generated\n\n`zerocalc.sequence` generates a configuration's allocations "
           "(init, two training steps) from the architecture and the setup, and `zerocalc.allocator` replays them: "
           "that is `estimate`'s reserved peak wherever the sequence is generated (stages 0-3, optimizer offload). "
           "Against the histories of six configurations recorded in a fresh process (x: position in each sequence, "
           "as a fraction of its events; the generated one leaves out what is constant and tiny; stage 3 at N = 2 "
           "gathers on a stream of its own)."),
    ("code", """import pandas as pd
from zerocalc import allocator, sequence
fresh = [("t3-warmup-b/seed-gpt-h768-l12-s2-bf16-n1-b1x2048", "160M GPT, stage 2, 1×2048, checkpointed"),
         ("t4-warmup/hf-llama-h768-l12-s2-bf16-n1-b1x2048", "130M Llama, stage 2, 1×2048, checkpointed"),
         ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n1-b8x2048", "1.1B Llama, stage 2, 8×2048, checkpointed"),
         ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n2-b2x1024", "1.1B Llama, stage 2, N = 2, 2×1024"),
         ("t4-warmup/seed-gpt-h2048-l24-s3-bf16-n1-b2x1024-gas1-384", "1.4B GPT, stage 3, 2×1024"),
         ("t4-warmup/hf-llama-h2048-l22-s3-bf16-n2-b2x1024", "1.1B Llama, stage 3, N = 2, 2×1024")]
rows = pd.concat([pd.read_csv(p) for p in paths])
fig, axes = plt.subplots(2, 3, figsize=(15, 8))
for ax, (pick, title) in zip(axes.ravel(), fresh):
    path = sorted(glob.glob(os.path.join(ROOT, "data", "snapshots", pick + "*.json.gz")))[0]
    snap = load_history(path)
    recorded, _ = reserved_timelines(snap)
    n_rec = len(snap["device_traces"][0])
    key = os.path.basename(path)[:-len(".json.gz")]
    spec, setup = to_zerocalc(job_from_row(rows[rows["key"] == key].iloc[-1].to_dict()))
    events = sequence.events(spec, setup, steps=2)   # what a history spans
    made = allocator.replay(events)
    total, peak, generated = 0, 0, [(0, 0)]
    for j, delta in made.reserved_changes():
        total += delta                         # segments made, and those stage 3's init returns (empty_cache)
        peak = max(peak, total)
        generated.append((j, total))
    ax.step([j / n_rec for j, _ in recorded], [v / GiB for _, v in recorded], "-", where="post", label="recorded (H200)")
    ax.step([j / len(events) for j, _ in generated] + [1], [v / GiB for _, v in generated] + [total / GiB], "--",
            where="post", label="generated + simulated")
    ax.set(title=title, xlabel="position in the sequence", ylabel="reserved (GiB)")
    ax.legend(fontsize=8)
    print(f"{title}: recorded {max(v for _, v in recorded) / GiB:.3f} GiB, generated {peak / GiB:.3f} GiB")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "generated_sequence.png"), dpi=110)"""),
    ("code", """# The case study's configuration: zerocalc estimate --model seed-gpt --dp 2 --stage 3 --seq-len 1024 --micro-batch 2 --dtype fp16
from zerocalc.model import from_architecture
from zerocalc.arch import preset
from zerocalc.training import Setup, Stage
e = estimate(from_architecture(preset("seed-gpt"), "seed-gpt"), Setup(stage=Stage(3), dp=2, seq_len=1024, micro_batch=2, dtype="fp16"))
case = df[(df["hidden_size"] == 2048) & (df["family"] == "seed-gpt") & (df["nproc"] == 2) & (df["stage"] == 3)].iloc[0]
print(f"case study, stage 3, N = 2: predicted {e.peak_bytes / GiB:.2f} GiB, measured {case['measured']:.2f} GiB")"""),
]
nb = nbf.v4.new_notebook()
nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "notebooks/predicted_vs_measured.ipynb")
