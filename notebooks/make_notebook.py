"""Writes predicted_vs_measured.ipynb (kept as code here so that diffs stay readable), then, with
--execute, runs it and saves it with its outputs (figures inline):

    python notebooks/make_notebook.py --execute

Its tables come from the same functions as `python -m validate report --markdown` and the generated
blocks of README.md and docs/accuracy.md, so the numbers are the same."""
import os
import sys

import nbformat as nbf

HERE = os.path.dirname(os.path.abspath(__file__))

cells = [
    ("md", "# Predicted vs measured\n\nzerocalc's current predictions against every H200 job committed in `data/`, "
           "with the ZeRO paper's formula and DeepSpeed's own estimator beside them. The tables are the README's "
           "and `docs/accuracy.md`'s (`python -m validate report --markdown` prints the first); "
           "each figure is also written to `docs/figures/`."),
    ("code", """%matplotlib inline
import glob, os, sys
ROOT = os.path.abspath(os.path.join(os.getcwd(), "..")) if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
sys.path.insert(0, ROOT)
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import Markdown, display
from validate import report as R
from validate.jobs import to_zerocalc
from validate.rows import job_from_row
from zerocalc.estimate import estimate
plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 10, "figure.dpi": 100})
GiB, ms = 2**30, 1e3
FIG = os.path.join(ROOT, "docs", "figures")
os.makedirs(FIG, exist_ok=True)
STAGE_COLORS = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:red"}


def log_ticks(ax, lo, hi):
    # label a log-log plot at 1-2-5 steps, in plain numbers
    ticks = [m * 10**k for k in range(-1, 6) for m in (1, 2, 5) if lo <= m * 10**k <= hi]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_ticks(ticks, [f"{t:g}" for t in ticks])
        axis.set_minor_formatter(plt.NullFormatter())
from validate.docs import committed_paths
paths = committed_paths()   # real worlds' rows; the fake-world and card rows have a section of their own
# The test suite re-predicts the committed rows once and hands them over; run alone, the notebook does it (~1 min).
cached = os.environ.get("ZEROCALC_COMMITTED_ROWS")
ok = pd.read_pickle(cached) if cached else R.committed_rows(paths)
gpu = R.with_anchors(R.device_rows(ok))   # device peaks: not the rows run beside other jobs on one GPU
display(Markdown(R.markdown_summary(ok)))"""),
    ("md", "## Memory: allocated and reserved peaks\n\nEach point is a job; the dashed line is a perfect "
           "prediction. Grey crosses: the ZeRO paper's model states for the same jobs."),
    ("code", """fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
lim = gpu[["measured", "zerocalc"]].max().max() / GiB * 1.05
for stage, g in gpu.groupby("stage"):
    axes[0].scatter(g["measured"] / GiB, g["paper"] / GiB, marker="x", s=14, color="0.6", alpha=0.7)
    axes[0].scatter(g["measured"] / GiB, g["zerocalc"] / GiB, s=14, color=STAGE_COLORS[stage], label=f"stage {stage}")
axes[0].scatter([], [], marker="x", color="0.6", label="ZeRO paper")
axes[0].plot([0, lim], [0, lim], "k--", lw=1)
axes[0].set(xlim=(0, lim), ylim=(0, lim), xlabel="measured peak allocated (GiB)", ylabel="predicted (GiB)",
            title="peak allocated: all within 5%")
axes[0].legend(loc="upper left")
dev = R.device_rows(ok)
clean = dev[R.started_clean(dev) & ~R.expandable_rows(dev) & dev["measured_peak_reserved_bytes"].notna()]
lim2 = clean["measured_peak_reserved_bytes"].max() / GiB * 1.05
for stage, g in clean.groupby("stage"):
    axes[1].scatter(g["measured_peak_reserved_bytes"] / GiB, g["now_peak_reserved_bytes"] / GiB, s=14,
                    color=STAGE_COLORS[stage], label=f"stage {stage}")
axes[1].plot([0, lim2], [0, lim2], "k--", lw=1)
axes[1].set(xlim=(0, lim2), ylim=(0, lim2), xlabel="measured peak reserved (GiB)", ylabel="predicted (GiB)",
            title="peak reserved: all within 10%")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "predicted_vs_measured.png"), dpi=100)
plt.show()"""),
    ("md", "## Against the formulas that count model states only\n\nThe ZeRO paper's figure-1 formula and "
           "DeepSpeed's own estimator (stages 1-3) count parameters, gradients and optimizer states; the peak "
           "also holds activations, DeepSpeed's buckets and the step's temporary copies. Mean |error| per stage "
           "(the table in `docs/accuracy.md`):"),
    ("code", """display(Markdown(R.markdown_anchors(R.device_rows(ok))))
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
methods = [("zerocalc_err", "zerocalc", "tab:purple"), ("deepspeed_estimator_err", "DeepSpeed's\\nestimator", "tab:gray"),
           ("paper_err", "ZeRO paper", "0.45")]
rng = np.random.default_rng(0)
for y, (col, label, color) in enumerate(methods):
    e = 100 * gpu[col].dropna()
    left.scatter(e, y + rng.uniform(-0.25, 0.25, len(e)), s=8, color=color, alpha=0.6)
left.axvspan(-5, 5, color="tab:green", alpha=0.15, label="±5%")
left.set_yticks(range(len(methods)), [m[1] for m in methods])
lo = 100 * gpu[[m[0] for m in methods]].min().min()
hi = 100 * gpu[[m[0] for m in methods]].max().max()
left.set(xlim=(lo - 5, max(hi, 10) + 5), xlabel="error against the measured peak allocated (%)",
         title="every job: formulas miss by tens of percent")
left.legend(loc="lower right")
for stage, g in gpu.groupby("stage"):
    right.scatter(100 * g["zerocalc_err"], stage + rng.uniform(-0.25, 0.25, len(g)), s=8, color=STAGE_COLORS[stage], alpha=0.7)
right.axvspan(-5, 5, color="tab:green", alpha=0.15)
right.set_yticks(range(4), [f"stage {s}" for s in range(4)])
right.set(xlim=(-5.5, 5.5), xlabel="zerocalc's error (%)", title="zerocalc, zoomed in")
right.invert_yaxis()
fig.tight_layout()
fig.savefig(os.path.join(FIG, "error_per_configuration.png"), dpi=100)
plt.show()"""),
    ("md", "## Where the peak comes from\n\nFour representative jobs: each phase's predicted peak, stacked by "
           "what holds the memory, and the measured peak of that phase (black bar). The phase that sets the "
           "peak differs by stage: the optimizer step's fp32 copies at stage 0, the gathered parameters at "
           "stage 3, activations with long sequences, the host's copies with offload."),
    ("code", """picks = [("1.4B GPT (case study), stage 0, 2 GPUs", dict(family="seed-gpt", stage=0, nproc=2, dtype="fp16", micro_batch=2, seq_len=1024)),
         ("1.4B GPT (case study), stage 3, 2 GPUs", dict(family="seed-gpt", stage=3, nproc=2, dtype="fp16", micro_batch=2, seq_len=1024)),
         ("6.7B Llama, stage 2, 2 GPUs, 2×4096", dict(num_params=6738415616, stage=2, nproc=2, micro_batch=2, seq_len=4096)),
         ("1.1B Llama, stage 3, CPU offload, 4×2048", dict(num_params=1100048384, stage=3, nproc=1, offload_param="cpu", micro_batch=4))]
parts = [("states", "states_bytes", "tab:blue"), ("gradients", "grads_bytes", "tab:orange"),
         ("buffers", "buffers_bytes", "tab:green"), ("activations", "activation_bytes", "tab:red")]
fig, axes = plt.subplots(2, 2, figsize=(10, 7))
for ax, (title, want) in zip(axes.ravel(), picks):
    rows = dev[np.logical_and.reduce([dev[k] == v for k, v in want.items()]) & (dev["offload_optimizer"].eq("none") | ("offload_param" in want))
               & dev["measured_init_peak_bytes"].notna()]
    r = rows.iloc[0]
    e = estimate(*to_zerocalc(job_from_row(r.to_dict())))
    names = [p.name for p in e.phases]
    bottom = np.zeros(len(names))
    for label, attr, color in parts:
        vals = np.array([getattr(p, attr) for p in e.phases]) / GiB
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom += vals
    measured = [(r[f"measured_{n}_peak_bytes"] - r["measured_base_allocated_bytes"]) / GiB for n in names]
    ax.scatter(names, measured, marker="_", s=900, linewidths=2.5, color="black", label="measured", zorder=3)
    ax.set_ylim(0, max(bottom.max(), max(measured)) * 1.12)
    ax.set_title(title)
    ax.set_ylabel("GiB per GPU")
handles, labels = axes[0, 0].get_legend_handles_labels()
fig.legend(handles, labels, loc="lower center", ncol=5, frameon=False)
fig.suptitle("predicted peak per phase (stacked) and measured (black)")
fig.tight_layout(rect=(0, 0.05, 1, 1))
fig.savefig(os.path.join(FIG, "phase_breakdown.png"), dpi=100)
plt.show()"""),
    ("md", "## Step time\n\nThe jobs timed as training runs (whole steps, no synchronizes between phases), each "
           "predicted on its own host's speed where the validator probed it before every timed step (these "
           "steps are often host-bound, and the host's speed is an input). A bar spans the job's own fastest to "
           "slowest step; the band is ±15%."),
    ("code", """t = ok[R.timed_whole_steps(ok) & ok["measured_peak_allocated_bytes"].notna()]   # timed_whole_steps leaves concurrent rows out
rng_ = R.step_range(t)
fig, ax = plt.subplots(figsize=(6.5, 6))
for stage, g in t.groupby("stage"):
    rg = rng_.loc[g.index]
    ax.errorbar(g["measured_step_s"] * ms, g["now_step_s"] * ms, fmt="o", ms=4, color=STAGE_COLORS[stage], label=f"stage {stage}",
                xerr=[(g["measured_step_s"] - rg["fastest"]) * ms, (rg["slowest"] - g["measured_step_s"]) * ms], elinewidth=0.6, alpha=0.8)
lo = min(t["measured_step_s"].min(), t["now_step_s"].min(), rng_["fastest"].min()) * ms * 0.8
hi = max(t["measured_step_s"].max(), t["now_step_s"].max(), rng_["slowest"].max()) * ms * 1.2
ax.plot([lo, hi], [lo, hi], "k--", lw=1)
ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="tab:green", alpha=0.12, label="±15%")
err = (t["now_step_s"] / t["measured_step_s"] - 1).abs()
ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time, median of the job's steps (ms)",
       ylabel="predicted (ms)", title=f"step time on H200: {int((err <= 0.15).sum())} of {len(t)} jobs within 15%")
log_ticks(ax, lo, hi)
ax.legend(loc="upper left")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "step_time.png"), dpi=100)
plt.show()"""),
    ("md", "Per configuration, cross-validated (`python -m validate crossval`): each quarter of the "
           "configurations predicted by the time constants fitted on the other three, so every point is one the "
           "fit never saw; a point is the median of the configuration's jobs, its bar their fastest..slowest."),
    ("code", """from validate.fit import cross_validate_time
cached = os.environ.get("ZEROCALC_COMMITTED_CROSSVAL")   # the test suite's, as for the rows above
cv = pd.read_pickle(cached) if cached else cross_validate_time(paths)[0]
by = R.by_configuration(cv.assign(now_step_s=cv["cv_step_s"])).rename(columns={"measured_step_s": "measured", "now_step_s": "predicted"})
n, within = len(by), int(((by["predicted"] / by["measured"] - 1).abs() <= 0.15).sum())
fig, ax = plt.subplots(figsize=(6.5, 6))
for stage, g in by.groupby("stage"):
    ax.errorbar(g["measured"] * ms, g["predicted"] * ms, fmt="o", ms=4, color=STAGE_COLORS[stage], label=f"stage {stage}", elinewidth=0.6,
                xerr=[(g["measured"] - g["fastest"]) * ms, (g["slowest"] - g["measured"]) * ms])
lo, hi = by[["fastest", "predicted"]].min().min() * ms * 0.8, by[["slowest", "predicted"]].max().max() * ms * 1.2
ax.plot([lo, hi], [lo, hi], "k--", lw=1)
ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="tab:green", alpha=0.12, label="±15%")
ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time, median of the jobs (ms)",
       ylabel="predicted by a fit without it (ms)", title=f"per configuration, cross-validated: {within} of {n} within 15%")
log_ticks(ax, lo, hi)
ax.legend(loc="upper left")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "step_time_crossval.png"), dpi=100)
plt.show()"""),
    ("md", "## The caching allocator, simulated\n\nReserved memory beyond the allocated peak is the caching "
           "allocator's: which segments it cudaMallocs depends on the order of allocations. `zerocalc.allocator` "
           "replays the allocations of recorded histories (model build to the end of warm-up, `data/snapshots/`); "
           "its reserved memory follows the recorded one segment by segment."),
    ("code", """from validate.snapshot import load as load_history, reserved_timelines
picks = ["t3-warmup/seed-gpt-h768-l12-s2-bf16", "t3-warmup/seed-gpt-h2048-l24-s3", "t3-warmup-b/hf-llama-h768-l12-s3"]
titles = ["160M GPT, stage 2", "1.4B GPT, stage 3 + offload", "130M Llama, stage 3"]
fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
for ax, pick, title in zip(axes, picks, titles):
    path = sorted(glob.glob(os.path.join(ROOT, "data", "snapshots", pick + "*.json.gz")))[0]
    recorded, simulated = reserved_timelines(load_history(path))
    for series, style, label in ((recorded, "-", "recorded"), (simulated, "--", "simulated")):
        ax.step([j / 1e3 for j, _ in series], [v / GiB for _, v in series], style, where="post", label=label)
    ax.set(title=title, xlabel="allocator event (thousands)")
    print(f"{title}: recorded peak {max(v for _, v in recorded) / GiB:.3f} GiB, simulated {max(v for _, v in simulated) / GiB:.3f} GiB")
axes[0].set_ylabel("reserved (GiB)")
axes[0].legend(loc="lower right")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "allocator_replay.png"), dpi=100)
plt.show()"""),
    ("md", "## The allocation sequence, generated\n\n`zerocalc.sequence` generates a configuration's allocations "
           "(init, two training steps) from the architecture and the setup, and `zerocalc.allocator` replays them: "
           "that is `estimate`'s reserved peak. Against the histories of six configurations recorded in a fresh "
           "process (x: position in each sequence, as a fraction of its events; stage 3 at N = 2 gathers on a "
           "stream of its own)."),
    ("code", """from zerocalc import allocator, sequence
fresh = [("t3-warmup-b/seed-gpt-h768-l12-s2-bf16-n1-b1x2048", "160M GPT, s2, 1×2048"),
         ("t4-warmup/hf-llama-h768-l12-s2-bf16-n1-b1x2048", "130M Llama, s2, 1×2048"),
         ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n1-b8x2048", "1.1B Llama, s2, 8×2048"),
         ("t4-warmup/hf-llama-h2048-l22-s2-bf16-n2-b2x1024", "1.1B Llama, s2, N = 2"),
         ("t4-warmup/seed-gpt-h2048-l24-s3-bf16-n1-b2x1024-gas1-384", "1.4B GPT, s3, 2×1024"),
         ("t4-warmup/hf-llama-h2048-l22-s3-bf16-n2-b2x1024", "1.1B Llama, s3, N = 2")]
every = pd.concat([pd.read_csv(p) for p in paths])
fig, axes = plt.subplots(2, 3, figsize=(10, 6))
for ax, (pick, title) in zip(axes.ravel(), fresh):
    path = sorted(glob.glob(os.path.join(ROOT, "data", "snapshots", pick + "*.json.gz")))[0]
    snap = load_history(path)
    recorded, _ = reserved_timelines(snap)
    n_rec = len(snap["device_traces"][0])
    key = os.path.basename(path)[:-len(".json.gz")]
    spec, setup = to_zerocalc(job_from_row(every[every["key"] == key].iloc[-1].to_dict()))
    events = sequence.events(spec, setup, steps=2)   # what a history spans
    made = allocator.replay(events)
    total, peak, generated = 0, 0, [(0, 0)]
    for j, delta in made.reserved_changes():
        total += delta                         # segments made, and those stage 3's init returns (empty_cache)
        peak = max(peak, total)
        generated.append((j, total))
    ax.step([j / n_rec for j, _ in recorded], [v / GiB for _, v in recorded], "-", where="post", label="recorded (H200)")
    ax.step([j / len(events) for j, _ in generated] + [1], [v / GiB for _, v in generated] + [total / GiB], "--",
            where="post", label="generated")
    ax.set_title(title, fontsize=11)
    print(f"{title}: recorded {max(v for _, v in recorded) / GiB:.3f} GiB, generated {peak / GiB:.3f} GiB")
for ax in axes[:, 0]:
    ax.set_ylabel("reserved (GiB)")
for ax in axes[1]:
    ax.set_xlabel("position in the sequence")
axes[0, 0].legend(loc="lower right", fontsize=9)
fig.tight_layout()
fig.savefig(os.path.join(FIG, "generated_sequence.png"), dpi=100)
plt.show()"""),
    ("md", "## At scale: rank 0 of N, and smaller cards\n\nLeft: rank 0 of 8 to 1,024 GPUs measured on one H200 "
           "(`validate run --fake-world`, `data/h200-fake-*.csv`), measured against predicted. Right: cards of 18-94 GB "
           "emulated by capping the caching allocator (`data/h200-cards-*.csv`, `data/h100-cards-*.csv`): each job's card over the least room "
           "zerocalc says it runs in, and whether it ran or raised OutOfMemoryError (`docs/scale.md`)."),
    ("code", """fake = R.committed_rows(committed_paths("fake"))
fake = fake[fake["nproc"] >= 8]
cards = R.card_verdicts(R.load(committed_paths("cards")))
fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
for col, meas, marker, label in (("now_peak_allocated_bytes", "measured_peak_allocated_bytes", "o", "allocated"),
                                 ("now_peak_reserved_bytes", "measured_peak_reserved_bytes", "x", "reserved")):
    ax.scatter(fake[meas].astype(float) / GiB, fake[col] / GiB, marker=marker, c=np.log2(fake["nproc"]), cmap="viridis",
               label=label)
lim = [0, fake["measured_peak_reserved_bytes"].astype(float).max() / GiB * 1.1]
ax.plot(lim, lim, "k:", lw=1)
ax.set(xlabel="measured (GiB)", ylabel="predicted (GiB)", title=f"rank 0 of N = 8-1,024 ({len(fake)} jobs)")
ax.legend(loc="upper left")
ratio = cards["capacity_bytes"] / cards["need_bytes"]
ran = cards["outcome"] == "ok"
bx.scatter(cards.loc[ran, "card_gib"], ratio[ran], marker="o", color="tab:green", label="ran")
bx.scatter(cards.loc[~ran, "card_gib"], ratio[~ran], marker="x", color="tab:red", label="OutOfMemoryError")
bx.axhline(1, color="k", ls=":", lw=1)
bx.set(xlabel="card (GB)", ylabel="card's room / predicted need", title=f"{int(cards['agrees'].sum())} of {len(cards)} as predicted")
bx.legend(loc="upper left")
fig.tight_layout()
fig.savefig(os.path.join(FIG, "scale.png"), dpi=100)
plt.show()"""),
    ("md", "## The case study's configuration\n\n`zerocalc estimate --model seed-gpt --dp 2 --stage 3 --dtype fp16 "
           "--micro-batch 2 --seq-len 1024 --prefetch-bucket-size 5e8 --param-persistence-threshold 1e6` against "
           "the jobs that ran exactly that (`docs/case-study.md`)."),
    ("code", """from zerocalc.arch import preset
from zerocalc.model import from_architecture
from zerocalc.training import Setup, Stage
e = estimate(from_architecture(preset("seed-gpt"), "seed-gpt"),
             Setup(stage=Stage(3), dp=2, dtype="fp16", micro_batch=2, seq_len=1024, prefetch_bucket_size=500_000_000,
                   param_persistence_threshold=1_000_000))
same = gpu[(gpu["family"] == "seed-gpt") & (gpu["hidden_size"] == 2048) & (gpu["stage"] == 3) & (gpu["nproc"] == 2)
           & (gpu["dtype"] == "fp16") & (gpu["micro_batch"] == 2) & (gpu["seq_len"] == 1024) & (gpu["gas"] == 1)
           & (gpu["offload_optimizer"] == "none") & ~gpu["activation_checkpointing"].astype(bool)]
print(f"case study, stage 3, N = 2, fp16 2×1024: predicted {e.peak_bytes / GiB:.2f} GiB, measured "
      f"{same['measured'].min() / GiB:.2f}-{same['measured'].max() / GiB:.2f} GiB in {len(same)} jobs")"""),
]


def build():
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb, timeout_s=900):
    import nbclient
    # The kernel computing the cross-validation imports transformers, whose tqdm warns when ipywidgets is
    # missing: a line of stderr that depends on the machine, not on the notebook (the tests' kernel reads
    # the cross-validation computed beside it and never imports it).
    os.environ.setdefault("PYTHONWARNINGS", "ignore:IProgress not found")
    nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    return nb


if __name__ == "__main__":
    nb = build()
    if "--execute" in sys.argv:
        execute(nb)
    nbf.write(nb, os.path.join(HERE, "predicted_vs_measured.ipynb"))
