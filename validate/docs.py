"""The generated parts of README.md and docs/*.md: the supported models, the examples' output and the
accuracy tables, each between markers

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

`python -m validate docs` rewrites them from the code and the committed rows (`data/h200-*.csv`);
`tests/test_docs.py` fails when one is stale, so a number in the documents is what the code gives."""
import functools
import glob
import os
import re
from functools import lru_cache

from click.testing import CliRunner

from validate import results_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ("README.md", "docs/hf-validation.md", "docs/accuracy.md", "docs/speed.md", "docs/scale.md",
             "docs/planning.md", "docs/lora.md", "docs/inputs.md", "docs/models.md", "docs/your-cluster.md")
SPEED = os.path.join(ROOT, "data", "speed.json")   # `python benchmarks/run_all.py --json data/speed.json`
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

# The README's examples: each is run through the CLI and its output shown up to the end of its table,
# with the step-time lines where it prints them.
EXAMPLES = {
    "7b-8x32gb": "estimate --params 7e9 --dp 8 --dtype fp16 --gpu-memory 32GB",
    "llama-3-8b-8x40gb": "estimate --model llama-3-8b --dp 8 --stage 2,3 --seq-len 4096 --activation-checkpointing "
                         "--gpu h100 --gpu-memory 40GB",
    "plan-70b": "plan --model llama-2-70b --gpu h100 --max-gpus 64 --seq-len 4096 --global-batch 1024 --zero-init",
    "plan-70b-64": "plan --model llama-2-70b --gpu h100 --max-gpus 64 --seq-len 4096 --global-batch 64 --zero-init",
    "own-config": "estimate --hf-config docs/examples/llama-3-8b-config.json --ds-config "
                  "docs/examples/ds_config_zero3_offload.json --dp 8 --seq-len 4096 --activation-checkpointing "
                  "--gpu-memory 24GB",
    "lora-7b": "estimate --model qwen2.5-7b --dp 8 --stage 2,3 --seq-len 2048 --micro-batch 2 "
               "--activation-checkpointing --lora-rank 16 --gpu-memory 24GB",
}
MAX_TABLE_ROWS = 3   # of a plan's ranked list; an estimate shows every stage


def committed_paths(kind: str = "real") -> list[str]:
    """The committed H200 rows of one kind: "real" the transcribed families' jobs of real worlds (HF-config
    rows, data/h200-hf-*.csv, are judged apart: validate.report.hf_section), "fake" rank 0 of a fake world
    (data/h200-fake-*.csv, and an H100's, data/h100-fake-*.csv: what the allocator holds, whatever the
    card; no time is read from them), "cards" emulated smaller cards (data/h200-cards-*.csv, and an
    H100's, data/h100-cards-*.csv: the allocator capped below either card's memory)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "data", "h200-*.csv")))
    if kind in ("fake", "cards"):
        paths += sorted(glob.glob(os.path.join(ROOT, "data", f"h100-{kind}-*.csv")))
    if kind != "real":
        return [p for p in paths if os.path.basename(p).split("-")[1] == kind]
    return [p for p in paths if not any(f"/h200-{k}-" in p for k in ("hf", "fake", "cards"))]


def supported_models() -> str:
    """The README's summary of what `--model` and `--hf-config` accept, read from
    `zerocalc.resolve.listing`: how many models of each model_type; the names are in docs/models.md."""
    from zerocalc import resolve
    rows = resolve.listing()
    by_type = {}
    for r in rows:
        by_type[r["model_type"]] = by_type.get(r["model_type"], 0) + 1
    types = ", ".join(f"{t} {n}" for t, n in sorted(by_type.items()))
    return (f"**{len(rows)} models** by `--model NAME` without torch ({types}): names in "
            "[models](docs/models.md#shipped-models); P, layers, experts, Hub ids: `zerocalc models`. `--hf-config` "
            "takes any config.json or model folder (other types: `pip install '.[trace]'`).")


def model_names() -> str:
    """Every `--model` name, one line per model_type, read from `zerocalc.resolve.listing`."""
    from zerocalc import resolve
    by_type = {}
    for r in resolve.listing():
        by_type.setdefault(r["model_type"], []).append(r["name"] + ("*" if r["source"] == "family" else ""))
    lines = [f"- **{t}** {' '.join(names)}" for t, names in sorted(by_type.items())]
    return "\n".join(lines + ["", "\\* the tensors and calls of one of the validator's families at its sizes: that family's "
                               "activation formula and, where it has one, allocation stream (`zerocalc.family`)."])


def ds_keys() -> str:
    """zerocalc.dskeys.KEYS as tables, one per class; keys that share a default and a reason share a row."""
    import json

    from zerocalc import dskeys
    titles = {"modelled": "Modelled", "not_modelled": "Not modelled: a value other than the default is named in a "
              "warning, and the answer is the default's", "no_effect": "No effect on memory or traffic: accepted "
              "silently", "refused": "Refused"}
    out = []
    for kind, title in titles.items():
        rows = {}
        for key, (k, default, why) in dskeys.KEYS.items():
            if k == kind:
                rows.setdefault((json.dumps(default), why), []).append(f"`{key}`")
        head = "| keys | default | why |\n|---|---|---|" if kind == "not_modelled" else "| keys | why |\n|---|---|"
        lines = [f"| {', '.join(keys)} | `{default}` | {why} |" if kind == "not_modelled" else
                 f"| {', '.join(keys)} | {why} |" for (default, why), keys in rows.items()]
        out += [f"**{title}** ({sum(len(k) for k in rows.values())} entries).", "", head, *lines, ""]
    return "\n".join(out).rstrip()


def hf_summary(link: bool = True) -> str:
    """The HF-config rows (data/h200-hf-*.csv, data/h100-hf-types-*.csv): jobs, families, sizes, on how many rows zerocalc's trace of
    the config gives state and communication to the byte, and on how many the peaks are within 3%
    (allocated) and 8% (reserved) of `zerocalc estimate --hf-config` (`hf_peak_errors`). `link`: the
    count links to docs/hf-validation.md (not in that document's own block)."""
    ok, err_a, err_r = hf_peak_errors()
    lo, hi = ok["num_params"].astype(float).min() / 1e9, ok["num_params"].astype(float).max() / 1e9
    n = len(ok)
    within = ("on every job" if (err_a <= 0.03).all() and (err_r <= 0.08).all() else
              f"on {(err_a <= 0.03).sum()} and {(err_r <= 0.08).sum()} of {n} jobs")
    gpus = "GPU" if ok["source"].map(os.path.basename).str.startswith("h100-").any() else "H200"    # H200s and an H100
    jobs = f"[{n} {gpus} jobs](docs/hf-validation.md)" if link else f"{n} {gpus} jobs"
    state = (ok["pred_state_bytes"] == ok["measured_state_bytes"].astype(float)).sum()
    comm = (ok["pred_comm_bytes"] == ok["measured_comm_bytes"].astype(float)).sum()
    exact = "state, comm exact" if state == comm == n else f"state exact on {state}, comm on {comm}"
    return (f"Models read from their own code ({jobs}, "
            f"{ok['hf_model_type'].nunique()} other families, {lo:.1f}–{hi:.1f}B): {exact}; peak "
            f"allocated ≤3% and reserved ≤8% {within}.")


@functools.lru_cache(maxsize=1)
def hf_peak_errors():
    """(ok rows re-predicted, |allocated error|, |reserved error|) of every HF-config row (the H200's, and
    the model types an H100 ran again, data/h100-hf-types-*.csv) against what
    `zerocalc estimate --hf-config` predicts from the config alone (`validate.report.repredict_hf`;
    allocated less what an earlier engine of the process left). Traces each config once (cached)."""
    from validate.report import hf_rows, load, own_peak_allocated, repredict_hf
    df = load(sorted(glob.glob(os.path.join(ROOT, "data", "h200-hf-*.csv")))
              + sorted(glob.glob(os.path.join(ROOT, "data", "h100-hf-types-*.csv"))))
    hf = df[hf_rows(df)]
    ok = repredict_hf(hf[hf["outcome"] == "ok"], hf)
    own = own_peak_allocated(ok).astype(float)
    resv = ok["measured_peak_reserved_bytes"].astype(float)
    return ok, ((ok["now_peak_allocated_bytes"] - own) / own).abs(), ((ok["now_peak_reserved_bytes"] - resv) / resv).abs()


def speed(name: str, measured: dict) -> str:
    """The speed figures, from one run of `benchmarks/run_all.py` (data/speed.json): each a ratio to the
    P-only cold start measured in the same run (the median of a case's ratios to the baseline run just
    before each of its runs), the absolute times beside them, the machine named. `summary`: the
    README's sentence; `table`: every case (docs/speed.md)."""
    cases = {c["key"]: c for c in measured["cases"]}
    base = cases["baseline"]
    machine = measured["machine"].split(";")[0]      # cores and CPU, without Python and the load
    if name == "summary":
        return (f"{machine}, {measured['date']}, CPU time: `estimate --params 7e9 --dp 8` "
                f"{base['cpu_s'] * 1e3:.0f} ms cold; `--model llama-2-7b --seq-len 4096 --gpu h100` "
                f"{cases['estimate-arch']['cpu_ratio']:.1f}× that; the 70B `plan` {cases['plan-70b']['cpu_ratio']:.1f}×; "
                f"`sweep` {measured['sweep_configurations'] / cases['sweep-later']['cpu_s'] / 1e6:.0f}M configurations/s.")
    if name == "table":
        lines = [f"Measured on {machine} ({measured['date']}, commit {measured['commit']}), {measured['rounds']} rounds, medians; ratio: the median of a case's ratios to "
                 "the P-only cold start run just before each of its runs (the baseline's own row: to the run before it, "
                 "this machine's noise).", "",
                 "| case | wall | ratio | CPU | ratio | CPU ratio range |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {c['case']} | {c['wall_s'] * 1e3:.0f} ms | {c['wall_ratio']:.2f}× | {c['cpu_s'] * 1e3:.0f} ms | "
                  f"{c['cpu_ratio']:.2f}× | {c['cpu_ratio_range'][0]:.2f}-{c['cpu_ratio_range'][1]:.2f}× |"
                  for c in measured["cases"]]
        if "estimate-arch-rest" in cases:
            rest = cases["estimate-arch-rest"]["cpu_ratio"]
            lines += ["", f"Less its replays, the `estimate --model llama-2-7b` case would take {rest:.2f}× the "
                      "P-only cold start in CPU time: what generating the sequences, the stage-3 walks and the "
                      "model's shapes cost beside the replays."]
        return "\n".join(lines)
    raise KeyError(name)


def example(command: str) -> str:
    """`$ zerocalc COMMAND` and its output, up to the end of the table, with the step-time lines."""
    from zerocalc.cli import main
    result = CliRunner().invoke(main, command.split())
    if result.exit_code != 0:
        raise RuntimeError(f"zerocalc {command} exited {result.exit_code}: {result.output}")
    lines = result.output.splitlines()
    limit = MAX_TABLE_ROWS if command.startswith("plan") else len(lines)
    start = next(i for i, line in enumerate(lines) if lines[i + 1:i + 2] and lines[i + 1].startswith("----"))
    shown, table_rows = [], None
    for line in lines[start:]:
        if table_rows is not None and not line.strip():
            break
        if table_rows is not None:
            table_rows += 1
        if table_rows is None or table_rows <= limit:
            shown.append(line)
        if line.startswith("----"):
            table_rows = 0
    if table_rows and table_rows > limit:
        shown.append(f"... ({table_rows - limit} more)")
    times = [ln for ln in lines if re.match(r"^\s+stage \d: ", ln) or ln.startswith("Step time on")]
    shown += [""] + times if times else []
    return "```text\n$ zerocalc " + command + "\n" + "\n".join(shown) + "\n```"


def _accuracy(name: str, rows) -> str:
    from validate import report as R
    ok = rows()
    gpu = R.device_rows(ok)
    if name == "summary":
        return R.markdown_summary(ok)
    if name == "allocated":
        return R.markdown_by_stage(gpu.assign(own=R.own_peak_allocated(gpu)), "now_peak_allocated_bytes", "own", 0.05)
    if name == "anchors":
        return R.markdown_anchors(gpu)
    if name == "reserved":
        clean = R.started_clean(gpu) & ~R.expandable_rows(gpu)
        return R.markdown_by_stage(gpu, "now_peak_reserved_bytes", "measured_peak_reserved_bytes", 0.10, clean)
    if name == "reserved-expandable":
        rows_ = R.started_clean(gpu) & R.expandable_rows(gpu)
        return R.markdown_by_stage(gpu, "now_peak_reserved_bytes", "measured_peak_reserved_bytes", 0.10, rows_)
    timed = gpu[R.timed_whole_steps(gpu)]
    if name == "step":
        return R.markdown_by_stage(timed, "now_step_s", "measured_step_s", 0.15)
    if name == "step-fitted-host":
        return R.markdown_by_stage(timed, "now_step_fitted_host_s", "measured_step_s", 0.15)
    if name == "step-offload":
        off = (timed["offload_optimizer"] != "none") | (timed["offload_param"] != "none")
        return R.markdown_by_stage(timed, "now_step_s", "measured_step_s", 0.15, off)
    if name == "step-configuration":
        return R.markdown_by_stage(R.by_configuration(timed), "now_step_s", "measured_step_s", 0.15)
    confs = R.by_configuration(timed)
    if name == "perfect-model":
        pool = R.jobs_log_deviation(timed)
        f = R.perfect_model_floor(confs, pool)
        model = int(((confs["now_step_s"] / confs["measured_step_s"] - 1).abs() <= 0.15).sum())
        return (f"It would put {f['expected']:.1f} of the {len(confs)} configurations within 15% on average "
                f"(5–95%: {f['p05']}–{f['p95']}), and all {len(confs)} with probability {f['all']:.1g}, the jobs "
                f"scattering as they did (σ = {(pool ** 2).mean() ** 0.5:.1%} in log step time between jobs of one "
                f"configuration, pooled). zerocalc puts {model} there.")
    if name == "own-steps":
        r = R.step_range(timed)
        inside = int(((timed["now_step_s"] >= r["fastest"]) & (timed["now_step_s"] <= r["slowest"])).sum())
        spread = ((r["slowest"] - r["fastest"]) / timed["measured_step_s"]).median()
        return (f"Within one job, a row's own timed steps spread by {spread:.0%} (median of (slowest − fastest) / "
                f"median), and the prediction falls inside that range on {inside} of {len(timed)} rows.")
    if name == "repeatability":
        rep = confs[confs["jobs"] >= 2]
        wide = rep[rep["slowest"] / rep["fastest"] > 1.15 / 0.85]
        return (f"{len(rep)} configurations were timed in {rep['jobs'].min()}–{rep['jobs'].max()} separate jobs; "
                f"their jobs' medians differ by {rep['span'].median():.0%} (median of (max − min) / mean; worst "
                f"{rep['span'].max():.0%}), and {len(wide)} spread so wide (slowest / fastest above 1.35) that no "
                f"single prediction is within 15% of all their jobs.")
    raise KeyError(name)


@lru_cache(maxsize=1)
def _scale_rows():
    """(the fake-world rows at N >= 8 re-predicted, the emulated cards' verdicts), made once for the
    three blocks that show them (a 405B re-prediction is seconds). The capped runs are the card files'."""
    import pandas as pd

    from validate import report as R
    fake = R.committed_rows(committed_paths("fake"))
    card_paths = committed_paths("cards")
    cards = R.card_verdicts(R.load(card_paths)) if card_paths else pd.DataFrame(
        columns=["card_gib", "predicted_fits", "outcome", "agrees", "timing_dependent"])
    return fake[fake["nproc"].astype(int) >= 8], cards


def _scale(name: str) -> str:
    """The fake-world rows at N >= 8 and the emulated cards' verdicts (docs/scale.md, the README's line)."""
    fake, cards = _scale_rows()
    alloc = (fake["now_peak_allocated_bytes"] / fake["measured_peak_allocated_bytes"].astype(float) - 1)
    reserved = (fake["now_peak_reserved_bytes"] / fake["measured_peak_reserved_bytes"].astype(float) - 1)
    exact = int(((fake["now_state_bytes"] == fake["measured_state_bytes"].astype("int64"))
                 & (fake["now_comm_bytes"] == fake["measured_comm_bytes"].astype("int64"))).sum())
    either = cards["timing_dependent"].astype(bool)
    decided, agree = int((~either).sum()), int(cards.loc[~either, "agrees"].sum())
    ran_out = int((cards["predicted_fits"].astype(bool) & (cards["outcome"] == "oom")).sum())
    if name == "summary":
        p, n = fake["num_params"].astype(float), fake["nproc"].astype(int)
        exact_text = "exact" if exact == len(fake) else f"exact on {exact}"
        gpus = "/".join(sorted({"H100" if "H100" in str(g) else "H200" for g in fake["gpu"]}, reverse=True))
        return (f"At scale (one rank of {n.min()}–{n.max():,} GPUs on one {gpus}, [{len(fake)} jobs](docs/scale.md), "
                f"{p.min() / 1e9:.1f}–{p.max() / 1e9:.0f}B): state, comm {exact_text}; allocated ≤3% on "
                f"{int((alloc.abs() <= 0.03).sum())}, reserved ≤8% on {int((reserved.abs() <= 0.08).sum())}; "
                f"emulated {cards['card_gib'].min()}–{cards['card_gib'].max()} GB cards: `fits` right on {agree} of {decided}, "
                + (f"{ran_out} said to fit ran out ([why](docs/scale.md))" if ran_out else "no fit ran out")
                + f" ({len(cards) - decided} by timing or placement: NO).")
    if name == "rows":
        from validate import report as R
        lines = ["| model | N | stage | zero.Init | micro × seq | GAS | ckpt | allocated GiB | error | reserved GiB | error |",
                 "|---|---:|---:|---|---|---:|---|---:|---:|---:|---:|"]
        for (_, r), a, v in sorted(zip(fake.iterrows(), alloc, reserved),
                                   key=lambda x: (float(x[0][1]["num_params"]), int(x[0][1]["nproc"]))):
            rank = R.fake_rank(r.to_dict())
            lines.append(f"| {float(r['num_params']) / 1e9:.1f}B | {int(r['nproc']):,}{f' (rank {rank})' if rank else ''} | {int(r['stage'])} | "
                         f"{'yes' if str(r['zero_init']) == 'True' else 'no'} | {r['micro_batch']} × {r['seq_len']} | "
                         f"{r['gas']} | {'yes' if str(r['activation_checkpointing']) == 'True' else 'no'} | "
                         f"{float(r['measured_peak_allocated_bytes']) / 2**30:.2f} | {a:+.1%} | "
                         f"{float(r['measured_peak_reserved_bytes']) / 2**30:.2f} | {v:+.1%} |")
        return "\n".join(lines)
    if name == "cards":
        lines = ["| card | runs | zerocalc: fits | ran | zerocalc: NO | raised OOM | agree | NO by timing or placement: ran / raised OOM |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for card, g in cards.groupby("card_gib"):
            t = g[g["timing_dependent"].astype(bool)]
            lines.append(f"| {card} GB | {len(g)} | {int(g['predicted_fits'].sum())} | {int((g['outcome'] == 'ok').sum())} | "
                         f"{int((~g['predicted_fits']).sum())} | {int((g['outcome'] == 'oom').sum())} | {int(g['agrees'].sum())} | "
                         f"{int((t['outcome'] == 'ok').sum())} / {int((t['outcome'] == 'oom').sum())} |")
        return "\n".join(lines)
    raise KeyError(name)


def _adapters(lora, freeze) -> str:
    """A row's PEFT config in a few words: "r 16 all-linear, dropout 0.05", "DoRA r 8 q_proj v_proj",
    or what it froze, or "full fine-tune"."""
    import json
    if str(lora) in ("", "nan", "None"):
        frozen = json.loads(freeze) if str(freeze) not in ("", "nan", "None") else []
        return "frozen " + " ".join(frozen) if frozen else "full fine-tune"
    c = json.loads(lora)
    targets = c.get("target_modules", "all-linear")
    text = f"{'DoRA' if c.get('use_dora') else 'LoRA'} r {c['r']} " + (targets if isinstance(targets, str) else " ".join(targets))
    return text + (f", dropout {c['lora_dropout']}" if c.get("lora_dropout") else "")


def _lora_rows() -> str:
    """The committed LoRA, DoRA and frozen-module H200 rows (data/lora/) re-predicted from the model each
    run recorded, and communication also from the config alone (`report.repredict_hf`'s traced profile):
    docs/lora.md's table."""
    from validate import report as R
    rows = R.repredict_hf(R.load(sorted(glob.glob(os.path.join(ROOT, "data", "lora", "*.csv")))))
    lines = ["| model | N | stage | path | adapters | ckpt | micro × seq | state | comm | comm from config "
             "| peak allocated GiB | error | peak reserved GiB | error |",
             "|---|---:|---:|---|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for _, r in rows.iterrows():
        adapters = _adapters(r.get("lora"), r.get("freeze"))
        exact = lambda now, meas: "exact" if int(now) == int(meas) else f"{now / float(meas) - 1:+.1%}"   # noqa: E731
        lines.append(f"| {r['key'].split('-')[1]} {float(r['num_params']) / 1e9:.1f}B | {r['nproc']}"
                     f"{' (fake)' if r.get('world') == 'fake' else ''} | {r['stage']} | {r.get('path', 'engine')} | "
                     f"{adapters} | {'yes' if str(r['activation_checkpointing']) == 'True' else 'no'} | "
                     f"{r['micro_batch']} × {r['seq_len']} | {exact(r['now_state_bytes'], r['measured_state_bytes'])} | "
                     f"{exact(r['now_comm_bytes'], r['measured_comm_bytes'])} | "
                     f"{exact(r['pred_comm_bytes'], r['measured_comm_bytes'])} | "
                     f"{float(r['measured_peak_allocated_bytes']) / 2**30:.2f} | "
                     f"{r['now_peak_allocated_bytes'] / float(r['measured_peak_allocated_bytes']) - 1:+.1%} | "
                     f"{float(r['measured_peak_reserved_bytes']) / 2**30:.2f} | "
                     f"{r['now_peak_reserved_bytes'] / float(r['measured_peak_reserved_bytes']) - 1:+.1%} |")
    return "\n".join(lines)


CORPUS = os.path.join(ROOT, "tests", "data", "ds-configs")
CORPUS_RUN = "estimate --model llama-3.1-8b --dp 8"   # and --micro-batch 4 where a file leaves it to Trainer


def _corpus_runs():
    """(file, exit code, warning lines, error line) of each published ds_config, run as CORPUS_RUN."""
    from zerocalc import dsconfig
    from zerocalc.cli import main
    for path in sorted(glob.glob(os.path.join(CORPUS, "*", "*.json"))):
        name = os.path.relpath(path, CORPUS)
        micro = dsconfig.load(path).get("train_micro_batch_size_per_gpu") == "auto"
        result = CliRunner().invoke(main, CORPUS_RUN.split() + ["--ds-config", path] + ["--micro-batch", "4"] * micro)
        lines = result.stderr.splitlines()
        error = next((ln.split(": ", 2)[2] for ln in lines if ln.startswith("Error: ")), None)
        yield name, result.exit_code, [ln[9:] for ln in lines if ln.startswith("warning: ")], error


def ds_corpus() -> str:
    """The published ds_configs (tests/data/ds-configs): files per project, those refused and why, and the
    keys named in a warning with how many files set each (`tests/test_dsconfig_corpus.py` checks them)."""
    import json
    with open(os.path.join(CORPUS, "sources.json")) as f:
        sources = json.load(f)
    runs = list(_corpus_runs())
    projects, refused, warned = {}, [], {}
    for name, code, warnings, error in runs:
        row = projects.setdefault(name.split("/")[0], [sources[name]["repo"], 0, 0])
        row[1 if code == 0 else 2] += 1
        if code != 0:
            refused.append(f"| `{name}` | {error} |")
        for w in warnings:
            key = re.match(r"(?:unknown key )?([\w.]+)", w).group(1)
            kind = ("unknown: DeepSpeed ignores it too" if w.startswith("unknown key") else
                    '"auto" that Trainer does not fill' if '"auto"' in w else "not modelled")
            warned.setdefault((key, kind), []).append(name)
    lines = [f"{len(runs)} files from {len(projects)} projects, each run as `zerocalc {CORPUS_RUN} --ds-config FILE` "
             "(`--micro-batch 4` where the file leaves it to Trainer).", "",
             "| project | repository | answered | refused |", "|---|---|---:|---:|"]
    lines += [f"| {p} | {repo} | {ok} | {no} |" for p, (repo, ok, no) in projects.items()]
    lines += ["", f"**Refused** ({len(refused)} files), with the line zerocalc prints:", "", "| file | why |",
              "|---|---|", *refused, "", "**Named in a warning** (the keys these files set that zerocalc does not "
              "model, or that DeepSpeed ignores):", "", "| key | files | why |", "|---|---:|---|"]
    lines += [f"| `{key}` | {len(names)} | {kind} |" for (key, kind), names in
              sorted(warned.items(), key=lambda item: (-len(item[1]), item[0]))]
    return "\n".join(lines)


def calibrate_check() -> str:
    """docs/your-cluster.md's account of `zerocalc calibrate` on the committed rows (`fit.calibrate_checks`,
    what tests/test_calibrate.py holds)."""
    from validate.fit import calibrate_checks
    from zerocalc import calibration
    c = calibrate_checks([os.path.join(ROOT, p) for p in calibration.default()["fitted_on"]])
    fitted = {f.name: f for f in c["committed"].fitted}
    shipped = calibration.default()["allocator"]["reserved_over_allocated"]

    def ms(name):
        f = fitted[f"time.{name}"]
        return f"{f.value * 1e3:.3g} ms ± {f.error:.0%}"
    ratio = fitted["allocator.reserved_over_allocated"]
    kept = ", ".join(f"`{k.name.removeprefix('time.')}`" for k in c["committed"].kept if "uncertain" in k.why)
    ho, n = c["held_out"], c["test_rows"]
    own, slow = ho["as measured"], ho[f"× {c['factor']}"]

    def err(a):
        return f"{a['mean_abs_error']:.1%}"
    return (f"On the rows the shipped calibration was fitted on (its training split of the H200 rows: {c['train_rows']} "
            "timed rows), started from the validator's usual starting point rather than from the answer, and with "
            "the device's constants held as `python -m validate fit` holds them (measured without DeepSpeed), "
            "`calibrate` gives back every step-time constant those rows determine within its fit error (the "
            f"backward launch cost per layer {ms('launch_bwd_s_per_layer')}, the stage-3 hook "
            f"{ms('module_hook_s')}, ...), keeps those they leave uncertain ({kept}) at the shipped values, and "
            f"finds the reserved/allocated ratio {ratio.value:.4g} ± {ratio.error:.1%} against the shipped "
            f"{shipped:.4g} (the HF configs' rows count in it here).\n\n"
            f"On a cluster {c['factor'] - 1:.0%} slower (every timed H200 row's step times × {c['factor']}), "
            f"fitted on three quarters of the rows (by a hash of each row's key) and judged on the other quarter "
            f"({n} rows), the shipped constants are {err(slow['shipped'])} off on average "
            f"({slow['shipped']['within_15pct']} of {n} within 15%), the calibrated ones {err(slow['calibrated'])} "
            f"({slow['calibrated']['within_15pct']} of {n}), as close as the shipped constants are on the H200's own "
            f"held-out rows ({err(own['shipped'])}, {own['shipped']['within_15pct']} of {n}; calibrated there, "
            f"{err(own['calibrated'])}). `tests/test_calibrate.py` holds both.")


def generate(name: str, rows) -> str:
    """The text of block `name`; `rows()` gives the re-predicted committed rows (only called when needed)."""
    if name == "models":
        return supported_models()
    if name == "models:names":
        return model_names()
    if name == "ds-keys":
        return ds_keys()
    if name == "ds-corpus":
        return ds_corpus()
    if name == "hf-summary":
        return hf_summary()
    if name == "hf-summary:here":      # docs/hf-validation.md's own: no link to itself
        return hf_summary(link=False)
    if name.startswith("example:"):
        return example(EXAMPLES[name.split(":", 1)[1]])
    if name.startswith("accuracy:"):
        return _accuracy(name.split(":", 1)[1], rows)
    if name.startswith("scale:"):
        return _scale(name.split(":", 1)[1])
    if name == "lora:rows":
        return _lora_rows()
    if name == "calibrate:check":
        return calibrate_check()
    if name.startswith("speed:"):
        import json
        with open(SPEED) as f:
            return speed(name.split(":", 1)[1], json.load(f))
    raise KeyError(f"unknown generated block {name!r}")


def update(text: str, rows) -> str:
    return BLOCK.sub(lambda m: m.group(1) + generate(m.group("name"), rows) + "\n" + m.group(4), text)


def cached_rows(paths=None):
    """A `rows` callable that re-predicts the committed rows once, on first use (about a minute)."""
    cache = []

    def rows():
        if not cache:
            from validate.report import committed_rows
            cache.append(committed_rows(paths or committed_paths()))
        return cache[0]
    return rows


def stale(rows=None) -> list[str]:
    """The documents whose generated blocks differ from what the code and data give now."""
    rows = rows or cached_rows()
    out = []
    for doc in DOCUMENTS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        if update(text, rows) != text:
            out.append(doc)
    return out


def write_all(rows=None) -> list[str]:
    rows = rows or cached_rows()
    changed = []
    for doc in DOCUMENTS:
        path = os.path.join(ROOT, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = update(text, rows)
        if new != text:
            results_file.replace_whole(path, new.encode("utf-8"))   # a full disk leaves the old one whole
            changed.append(doc)
    return changed
