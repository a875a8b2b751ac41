"""Error tables: zerocalc's current predictions against every measured row."""
import io
import json

import numpy as np
import pandas as pd

from zerocalc import sequence
from validate import schema
from zerocalc.estimate import estimate
from validate.jobs import to_zerocalc
from validate.rows import (_cast, at_row_host, h200_of, is_hf_row, job_from_row, measured_host_launch_s,
                           predicted_state_bytes)

GiB = 2**30
CLEAN_BASE_BYTES = 2**28   # rows whose job started with less than this left over from an earlier engine


def own_peak_allocated(df: pd.DataFrame) -> pd.Series:
    """The job's own peak: max_memory_allocated less what an earlier stage-3 engine left allocated
    (DeepSpeed 0.19.8 does not free one; see data/README.md)."""
    return df["measured_peak_allocated_bytes"] - df["measured_base_allocated_bytes"]


def started_clean(df: pd.DataFrame) -> pd.Series:
    """Rows whose reserved peak is not inflated by an earlier engine's leftovers."""
    return df["measured_base_allocated_bytes"] < CLEAN_BASE_BYTES


def expandable_rows(df: pd.DataFrame) -> pd.Series:
    """Rows run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (older files lack the column)."""
    if "expandable_segments" not in df:
        return pd.Series(False, index=df.index)
    return df["expandable_segments"].map(lambda v: bool(_cast(v, bool)))   # read as job_from_row reads it


def timed_whole_steps(df: pd.DataFrame) -> pd.Series:
    """Rows whose step time is what training sees: whole optimizer steps timed without phase
    synchronizes, every one kept (`measured_step_times_s`; data/README.md), alone on their GPU (not
    `concurrent`), in a real world (not `fake_world`). Earlier rows timed phase-synchronized steps, often beside another job on the same
    host: their step times are kept but neither fitted nor judged."""
    if "measured_step_times_s" not in df:
        return pd.Series(False, index=df.index)
    text = df["measured_step_times_s"].fillna("").astype(str)
    return text.str.startswith("[") & (text != "[]") & ~concurrent(df) & ~fake_world(df)


def fake_world(df: pd.DataFrame) -> pd.Series:
    """Rows measured as rank 0 of a fake world (`validate run --fake-world`): memory and bytes are the
    job's, times and losses are not (collectives move nothing)."""
    if "world" not in df:
        return pd.Series(False, index=df.index)
    return df["world"].fillna("").astype(str) == "fake"


def concurrent(df: pd.DataFrame) -> pd.Series:
    """Rows measured beside other jobs on the same GPU and host (`protocol` "concurrent", written from
    VALIDATE_PROTOCOL: the host-memory rows; an HF matrix's `shared_gpu` > 1): their step times are not
    the job's own."""
    out = pd.Series(False, index=df.index)
    if "protocol" in df:
        out |= df["protocol"].fillna("").astype(str) == "concurrent"
    if "shared_gpu" in df:
        out |= pd.to_numeric(df["shared_gpu"], errors="coerce").fillna(1) > 1
    return out


def step_range(df: pd.DataFrame) -> pd.DataFrame:
    """Fastest and slowest of each row's timed steps (NaN where not recorded)."""
    times = df["measured_step_times_s"].map(lambda t: json.loads(t) if isinstance(t, str) and t.startswith("[") else [])
    return pd.DataFrame({"fastest": times.map(lambda t: min(t) if t else float("nan")),
                         "slowest": times.map(lambda t: max(t) if t else float("nan"))}, index=df.index)


# Architecture fields added after the held-out split was fixed (`fit.fold` hashes this string): left out
# at their defaults, so every configuration keeps the fold it had.
_LATER_ARCH_FIELDS = {"attention_bias": False, "mlp_bias": False}


def configuration(row: dict, allocator: bool = True) -> str:
    """What a row ran, without its key: rows of one configuration measured more than once (a repeat,
    or a key made by an older zerocalc) share it. allocator=False: the same with either allocator."""
    job = job_from_row(row)
    job.pop("key")
    job.pop("z3_leaf_modules", None)   # what the run set (of its model and stage), not what it asked for
    for name, default in _LATER_ARCH_FIELDS.items():   # at its default, a later field leaves the string as it was
        if job["arch"].get(name) == default:
            job["arch"].pop(name)
    if not allocator:
        job.pop("expandable_segments", None)
    return json.dumps(job, sort_keys=True)


def read_results(path: str) -> tuple[pd.DataFrame, list[str]]:
    """One results file's whole rows, and a note for each row skipped: a half row at the end (a sweep
    killed mid-write; the next resume drops it) or a row whose field count is not the header's (a row
    an older validator appended onto a half one)."""
    parsed = schema.read_checked(path)
    df = pd.read_csv(io.StringIO(parsed.text), keep_default_na=False, na_values=[""])
    later = schema.defaults_for_missing(parsed.header)   # columns added since the file was written
    if later:
        df = pd.concat([df, pd.DataFrame({c: [np.nan if v is None else v] * len(df) for c, v in later.items()},
                                         index=df.index)], axis=1)
    notes = [f"{path}: skipped a row whose field count is not the header's {len(parsed.header)} ({r[:50]!r}...)"
             for r in parsed.bad]
    if parsed.partial:
        notes.append(f"{path}: skipped a half-written last row ({len(parsed.partial.encode())} bytes, "
                     f"{parsed.partial[:50]!r}...)")
    return df, notes


def load(paths) -> pd.DataFrame:
    """Every file's whole rows, each with its `source`; notes on skipped rows in `df.attrs["notes"]`."""
    frames, notes = [], []
    for p in paths:
        df, skipped = read_results(p)
        frames.append(df.copy().assign(source=p))   # a copy: read_results grows it a column at a time
        notes += skipped
    # A job run again in its file (--retry-failed) has several rows there: the last one counts. One
    # configuration measured in several files (a repeat) keeps a row per file.
    out = pd.concat(frames, ignore_index=True).drop_duplicates(["key", "source"], keep="last")
    out.attrs["notes"] = notes
    return out


def earlier_jobs(df: pd.DataFrame) -> dict:
    """For each row (by index), the rows run before it in the same validator process, in order (the
    worker runs a matrix's jobs one after another in one process; a row whose job started with less
    than cuBLAS's workspace allocated is the first of a process), or None where that is not known (a
    job before it in the process did not finish)."""
    out = {}
    for _, g in (df.groupby("source", sort=False) if "source" in df else [(None, df)]):
        process = None
        for i, r in g.sort_index().iterrows():
            base = r.get("measured_base_allocated_bytes")
            if r.get("outcome") == "ok" and not pd.isna(base) and base < sequence.CUBLAS_WORKSPACE_BYTES:
                process = []
            out[i] = None if process is None else list(process)
            if process is not None:
                process = process + [r.to_dict()] if r.get("outcome") == "ok" else None
    return out


def process_chains(every: pd.DataFrame, earlier: dict) -> list[list[dict]]:
    """Each validator process's rows in order, as far as any of its rows reaches (`earlier_jobs`
    gives each later job the jobs before it), one list per (file, first job's key)."""
    chains = {}
    for i, prior in earlier.items():
        if prior:
            chain = (every.loc[i].get("source"), prior[0]["key"])
            rows_ = prior + [every.loc[i].to_dict()]
            if len(rows_) > len(chains.get(chain, [])):
                chains[chain] = rows_
    return list(chains.values())


def process_replays(every: pd.DataFrame, earlier: dict) -> dict:
    """For each later job of a validator process whose earlier jobs are known (`earlier_jobs`), its
    reserved peak simulated after them, by index; None where a job of the process is not generated.
    One replay per process (`sequence.process_peaks_reserved_bytes`), not one per row, on the rank the
    process ran as (a fake world's, `fake_rank`; rank 0 otherwise)."""
    peaks = {}
    for rows_ in process_chains(every, earlier):
        jobs = [to_zerocalc(job_from_row(r)) for r in rows_]
        for r, peak in zip(rows_, sequence.process_peaks_reserved_bytes(jobs, fake_rank(rows_[0]))):
            peaks[(r.get("source"), r["key"])] = peak
    return {i: peaks.get((every.loc[i].get("source"), every.loc[i]["key"]))
            for i, prior in earlier.items() if prior}


def predicted_reserved(e, row: dict, replayed: int | None = None) -> int:
    """zerocalc's reserved peak for a measured row. `estimate` predicts a fresh process. A later job of
    the validator's process (its measured_base_allocated_bytes is at least one cuBLAS workspace) is
    simulated after the jobs run before it in that process (`replayed`, from `process_replays`: what
    they left cached decides where this one's blocks go), or, where those are not known or not
    generated (None), with the workspaces made before init (`sequence.events(..., fresh_process=False)`).
    The ratio is used as estimate uses it."""
    base = row.get("measured_base_allocated_bytes")
    if e.reserved_source != "simulated" or pd.isna(base) or base < sequence.CUBLAS_WORKSPACE_BYTES:
        return e.peak_reserved_bytes
    if replayed is not None:
        return replayed
    return sequence.peak_reserved_bytes(e.model, e.setup, fresh_process=False)


def fake_rank(row: dict) -> int:
    """The rank a fake world's row ran as (`validate run --fake-rank`; rows without a `rank` ran rank 0)."""
    rank = pd.to_numeric(row.get("rank"), errors="coerce")
    return 0 if pd.isna(rank) else int(rank)


def measured_rank_peaks(e, row: dict) -> tuple[int, int]:
    """The simulated (allocated, reserved) peaks of the rank a fake world's row ran as (`fake_rank`;
    `estimate` answers the busiest rank's, `sequence.simulated_ranks`): a fresh process, or a later
    job's as `predicted_reserved` makes it."""
    base, rank = row.get("measured_base_allocated_bytes"), fake_rank(row)
    fresh = pd.isna(base) or base < sequence.CUBLAS_WORKSPACE_BYTES
    if fresh and sequence.simulated_ranks(e.model, e.setup) == (rank,):
        return e.simulated_peaks_bytes
    return tuple(sequence.peaks_bytes(e.model, e.setup, fresh_process=fresh, ranks=(rank,))[:2])


def repredict(df: pd.DataFrame, every: pd.DataFrame | None = None) -> pd.DataFrame:
    """Add now_* columns: the current zerocalc's prediction for each row. `every`: all rows of the
    files, failed ones included, to find the jobs that ran before each row in its process."""
    every = df if every is None else every
    replays = process_replays(every, earlier_jobs(every))
    out = df.copy()
    cols = {"now_state_bytes": [], "now_comm_bytes": [], "now_peak_allocated_bytes": [],
            "now_peak_reserved_bytes": [], "now_peak_phase": [], "now_step_s": [], "now_forward_s": [],
            "now_backward_s": [], "now_step_phase_s": [], "now_host_bytes": [], "now_reserved_source": [],
            "now_step_fitted_host_s": []}
    from zerocalc import calibration, timing
    cal = calibration.default()
    estimates = {}   # a configuration's repeated jobs (timed three times, say) share one estimate
    for i, r in df.iterrows():
        spec, setup = to_zerocalc(job_from_row(r.to_dict()))
        hw = h200_of(r.to_dict(), setup.dp)
        e = estimates.get((spec, setup, hw))
        if e is None:
            e = estimates[spec, setup, hw] = estimate(spec, setup, hardware=hw)
        # Step time on the row's own host speed where it was probed before each timed step
        # (rows.at_row_host), and as `zerocalc estimate --gpu h200` prints it, at the fitted hosts' speed.
        row_cal = at_row_host(cal, r.to_dict())
        t = e.time if row_cal is cal else timing.step_time(e.model, e.setup, e.collectives, hw, row_cal)
        cols["now_step_fitted_host_s"].append(e.time.step_s if e.time else float("nan"))
        for k, v in (("now_step_s", "step_s"), ("now_forward_s", "forward_s"), ("now_backward_s", "backward_s"),
                     ("now_step_phase_s", "optimizer_s")):
            cols[k].append(getattr(t, v) if t else float("nan"))
        if r.get("world") == "fake" and e.simulated_peaks_bytes is not None:   # only one rank is measured
            allocated, reserved = measured_rank_peaks(e, r.to_dict())
            reserved = replays[i] if replays.get(i) is not None else reserved
        else:
            allocated, reserved = e.peak_bytes, predicted_reserved(e, r.to_dict(), replays.get(i))
        for k, v in (("now_state_bytes", predicted_state_bytes(e, r["backend"])), ("now_comm_bytes", e.comm_bytes),
                     ("now_peak_allocated_bytes", allocated),
                     ("now_peak_reserved_bytes", reserved),
                     ("now_reserved_source", e.reserved_source),
                     ("now_peak_phase", e.peak.name), ("now_host_bytes", e.states.cpu_bytes)):
            cols[k].append(v)
    for k, v in cols.items():
        out[k] = v
    return out


def _rel(pred, meas):
    return (pred - meas) / meas


def _table(df, pred, meas, label, exact, target=None):
    """Per stage: rows, how many are exact (or within `target`), mean and max relative error; after a
    blank line, or nothing where no row has the measurement."""
    head = "exact" if exact else "in tgt"
    lines = ["", f"{label}", f"{'stage':>5} {'rows':>5} {head:>6} {'mean |err|':>11} {'max |err|':>10}"]
    for stage, g in df.groupby("stage"):
        g = g[g[meas].notna()]
        if g.empty:
            continue
        err = _rel(g[pred].astype(float), g[meas].astype(float)).abs()
        same = int((g[pred].astype("int64") == g[meas].astype("int64")).sum()) if exact else int((err <= target).sum())
        lines.append(f"{stage:>5} {len(g):>5} {same!s:>6} {err.mean():>10.2%} {err.max():>10.2%}")
    return lines if len(lines) > 3 else []


def _within_own_steps(timed: pd.DataFrame) -> list[str]:
    """How many predictions fall inside the row's own fastest..slowest timed step: a miss smaller than
    the measurement's own spread cannot be told from it."""
    r = step_range(timed)
    inside = (timed["now_step_s"] >= r["fastest"]) & (timed["now_step_s"] <= r["slowest"])
    spread = (r["slowest"] - r["fastest"]) / timed["measured_step_s"]
    return [f"Step time inside the row's own fastest..slowest timed step: {int(inside.sum())} of {len(timed)}; "
            f"the rows' own spread (slowest - fastest) / median: median {spread.median():.1%}, worst {spread.max():.1%}"]


def _host_speed(timed: pd.DataFrame) -> list[str]:
    """Rows that time the host beside each step (`measured_step_issue_us`): how a step's time (over its
    row's median) goes with the host's launch time just before it (over its row's median)."""
    if "measured_step_issue_us" not in timed:
        return []
    steps, issue = [], []
    for t, u in zip(timed["measured_step_times_s"], timed["measured_step_issue_us"]):
        if isinstance(u, str) and u.startswith("["):
            t, u = pd.Series(json.loads(t)), pd.Series(json.loads(u))
            steps += list(t / t.median())
            issue += list(u / u.median())
    if len(steps) < 10:
        return []
    steps, issue = pd.Series(steps), pd.Series(issue)
    slow = steps[issue > 1.1].median() / steps[issue <= 1.1].median() - 1
    return ["", f"Host speed beside each timed step ({len(steps)} steps): step time (over its row's median) against "
                f"the host's launch time just before it (over its row's median): r = {steps.corr(issue):.2f}; "
                f"steps after a launch time over 1.1x the row's median took {slow:+.0%} (median)"]


def _repeats(confs: pd.DataFrame) -> list[str]:
    """Configurations timed more than once (separate jobs): how far apart their medians are, and how
    many spread wider than any one prediction can cover within 15% of every job (slowest/fastest above
    1.15/0.85)."""
    repeated = confs[confs["jobs"] >= 2]
    if repeated.empty:
        return []
    wide = repeated[repeated["slowest"] / repeated["fastest"] > 1.15 / 0.85]
    return ["", f"Repeatability: {len(repeated)} configurations timed in {repeated['jobs'].min()}-{repeated['jobs'].max()} "
                f"separate jobs; their medians differ by (max - min) / mean: median {repeated['span'].median():.1%}, "
                f"worst {repeated['span'].max():.1%}; {len(wide)} spread beyond slowest/fastest = 1.35, where no "
                f"prediction is within 15% of all their jobs ({', '.join(f'{a * 1e3:.0f}-{b * 1e3:.0f} ms' for a, b in zip(wide['fastest'], wide['slowest']))})"]


def _floor(confs: pd.DataFrame, timed: pd.DataFrame, target: float = 0.15) -> list[str]:
    """The per-configuration count beside what a perfect model would reach on these jobs."""
    pool = jobs_log_deviation(timed)
    if len(pool) < 2:
        return []
    f = perfect_model_floor(confs, pool, target)
    model = int((abs(confs["now_step_s"] / confs["measured_step_s"] - 1) <= target).sum())
    return [f"A perfect model (each configuration's true mean step time, exactly) would put {f['expected']:.1f} of "
            f"these {len(confs)} configurations within {target:.0%} of the median of their jobs (5-95%: "
            f"{f['p05']}-{f['p95']}; all {len(confs)}: probability {f['all']:.2g}), the jobs scattering as they did "
            f"(log step time between jobs of a configuration: sigma {np.sqrt(np.mean(pool ** 2)):.1%}); this model "
            f"{model}"]


def with_configuration(timed: pd.DataFrame) -> pd.DataFrame:
    """timed with a `conf` column: what each row ran, without its key (`configuration`)."""
    return timed.assign(conf=[configuration(r.to_dict()) for _, r in timed.iterrows()])


def reachable_rows(timed: pd.DataFrame, target: float = 0.15) -> tuple[int, int, int]:
    """Over the configurations timed in more than one job: (their rows, the most of those rows one
    prediction per configuration can put within `target`, the rows the model puts there). A value v is
    within target of a job that took t when (1 - target)·t <= v <= (1 + target)·t; the best v starts one
    of those intervals."""
    conf = with_configuration(timed)
    rows = best = model = 0
    for _, g in conf.groupby("conf"):
        if len(g) < 2:
            continue
        t = g["measured_step_s"].to_numpy(float)
        rows += len(t)
        best += max(int((((1 - target) * t <= v) & (v <= (1 + target) * t)).sum()) for v in (1 - target) * t)
        model += int((abs(g["now_step_s"].to_numpy(float) / t - 1) <= target).sum())
    return rows, best, model


def perfect_model_floor(confs: pd.DataFrame, jobs_log_dev: np.ndarray, target: float = 0.15,
                        draws: int = 200_000, seed: int = 0) -> dict:
    """How many configurations a perfect model would put within `target` of the median of their jobs:
    one that predicts each configuration's true (mean log) step time exactly, judged against medians
    of as many jobs as each configuration has (`confs["jobs"]`), the jobs scattered as the measured
    ones are. `jobs_log_dev`: every job's log step time less its configuration's mean, scaled by
    sqrt(n / (n - 1)) for the mean it was taken from (pooled: two or three jobs say little about one
    configuration's own spread). A configuration of n jobs is within with probability p_n, the
    chance that the median of n draws from the pool is within target (Monte Carlo, `draws`, fixed
    seed); the count is then a sum of independent Bernoullis, its distribution exact by convolution.
    Returns the expected count, the 5th and 95th percentiles, and the chance that all are within."""
    rng = np.random.default_rng(seed)
    p = {}
    for n in sorted(set(int(j) for j in confs["jobs"])):
        median = np.median(rng.choice(jobs_log_dev, size=(draws, n)), axis=1)
        p[n] = float(np.mean(np.abs(np.exp(-median) - 1) <= target))   # prediction / measured - 1
    dist = np.array([1.0])                                          # P(count = k), k = 0..
    for n in confs["jobs"]:
        dist = np.convolve(dist, [1 - p[int(n)], p[int(n)]])
    cdf = np.cumsum(dist)
    return {"expected": float(np.dot(np.arange(len(dist)), dist)), "p05": int(np.searchsorted(cdf, 0.05)),
            "p95": int(np.searchsorted(cdf, 0.95)), "all": float(dist[-1]), "within_by_jobs": p}


def jobs_log_deviation(timed: pd.DataFrame) -> np.ndarray:
    """`perfect_model_floor`'s pool: each job's log median step less its configuration's mean, over
    configurations timed in two or more jobs, scaled by sqrt(n / (n - 1))."""
    conf = with_configuration(timed).assign(log_s=lambda d: np.log(d["measured_step_s"].astype(float)))
    n = conf.groupby("conf")["log_s"].transform("size")
    dev = (conf["log_s"] - conf.groupby("conf")["log_s"].transform("mean")) * np.sqrt(n / (n - 1).clip(lower=1))
    return dev[n >= 2].to_numpy(float)


RESERVED_ORDER = ("init", "first_forward", "first_backward", "first_step", "forward", "backward", "step")


def reserved_growth(df: pd.DataFrame) -> list[str]:
    """Where the allocator's cache grows, on rows that record each phase's reserved peak: the phase
    at which reserved last grew (by more than 2 MiB, one small segment), and how many rows grew at
    all in the measured (post-warm-up) phases. Reserved never shrinks in a job (no empty_cache), so
    a phase's reserved peak is the cache at its end."""
    cols = [f"measured_{p}_reserved_bytes" for p in RESERVED_ORDER]
    if not set(cols) <= set(df.columns):
        return []
    rows = df.dropna(subset=cols)
    if rows.empty:
        return []
    counts = dict.fromkeys(RESERVED_ORDER, 0)
    for _, r in rows.iterrows():
        values = [float(r[c]) for c in cols]
        last = max((i for i in range(1, len(values)) if values[i] - values[i - 1] > 2 * 2**20), default=0)
        counts[RESERVED_ORDER[last]] += 1
    later = sum(counts[p] for p in ("forward", "backward", "step"))
    return ["", f"Reserved peak set by (last phase that grew the cache), {len(rows)} rows: "
            + ", ".join(f"{p} {n}" for p, n in counts.items() if n) + f"; grown after the warm-up step: {later}"]


def by_configuration(timed: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration timed as training runs: the median over its jobs of their median
    steps (`jobs` of them, `span` = (max - min) / mean between them) beside the median of their
    predictions (each on its job's host speed where probed). Repeated
    jobs are how a noisy host is averaged out."""
    conf = with_configuration(timed)
    out = conf.groupby("conf").agg(stage=("stage", "first"), jobs=("measured_step_s", "size"),
                                   measured_step_s=("measured_step_s", "median"), now_step_s=("now_step_s", "median"),
                                   span=("measured_step_s", lambda t: (t.max() - t.min()) / t.mean()),
                                   fastest=("measured_step_s", "min"), slowest=("measured_step_s", "max"),
                                   **({"split": ("split", "first")} if "split" in conf else {}))
    return out.reset_index(drop=True)


def hf_rows(df: pd.DataFrame) -> pd.Series:
    """Rows of HF configs (validate/hf_models.py): judged in their own section (`hf_section`)."""
    return pd.Series([is_hf_row(r) for r in df.to_dict("records")], index=df.index, dtype=bool)


def hf_process_replays(every: pd.DataFrame, earlier: dict) -> dict:
    """`process_replays` for HF-config rows, each job as zerocalc traces its config
    (`hf_models.traced_spec`): a later job's reserved peak simulated after the jobs run before it in
    its process, by index; None where a job of the process is not traced or not generated."""
    from validate import hf_models
    peaks = {}
    for rows_ in process_chains(every, earlier):
        jobs = []
        for r in rows_:
            job = job_from_row(r)
            jobs.append((hf_models.traced_spec(job), to_zerocalc(job)[1]))
        n = next((k for k, (spec, _) in enumerate(jobs) if spec is None), len(jobs))
        for r, peak in zip(rows_[:n], sequence.process_peaks_reserved_bytes(jobs[:n]) if n else []):
            peaks[(r.get("source"), r["key"])] = peak
    return {i: peaks.get((every.loc[i].get("source"), every.loc[i]["key"]))
            for i, prior in earlier.items() if prior}


def repredict_hf(df: pd.DataFrame, every: pd.DataFrame | None = None) -> pd.DataFrame:
    """now_* columns for HF-config rows: states and communication from the parameter tensors the run
    recorded (`hf_models.model_spec`: exact by construction of what ran), and zerocalc's own prediction
    from the config alone (`hf_models.traced_spec`, what `zerocalc estimate --hf-config` prints): its
    states, communication and peaks (pred_*; NaN where it cannot trace the config). A later job of a
    validator process is simulated after the jobs before it (`hf_process_replays`), as `repredict`
    does for the other rows. `every`: all rows of the files, failed ones included."""
    from validate import hf_models
    every = df if every is None else every
    replays = hf_process_replays(every, earlier_jobs(every))
    out = df.copy()
    names = ("now_state_bytes", "now_comm_bytes", "pred_state_bytes", "pred_comm_bytes", "now_peak_allocated_bytes",
             "now_peak_reserved_bytes")
    cols = {k: [] for k in names}
    for i, r in df.iterrows():
        job = job_from_row(r.to_dict())
        spec, setup = to_zerocalc(job)
        e = estimate(spec, setup) if spec is not None else None
        cols["now_state_bytes"].append(predicted_state_bytes(e, r["backend"]) if e else float("nan"))
        cols["now_comm_bytes"].append(e.comm_bytes if e else float("nan"))
        traced = hf_models.traced_spec(job)
        t = estimate(traced, setup) if traced is not None else None
        cols["pred_state_bytes"].append(predicted_state_bytes(t, r["backend"]) if t else float("nan"))
        cols["pred_comm_bytes"].append(t.comm_bytes if t else float("nan"))
        cols["now_peak_allocated_bytes"].append(t.peak_bytes if t and t.activation_bytes is not None else float("nan"))
        reserved = float("nan")
        if t and t.activation_bytes is not None:
            reserved = t.peak_reserved_bytes
            if t.reserved_source == "simulated" and replays.get(i) is not None:
                reserved = max(replays[i], t.peak_bytes)
        cols["now_peak_reserved_bytes"].append(reserved)
    for k, v in cols.items():
        out[k] = v
    return out


def hf_section(ok: pd.DataFrame, every: pd.DataFrame | None = None) -> tuple[list[str], bool]:
    """HF configs, one line per row: state and communication against zerocalc from the recorded tensors
    (exact expected) and from zerocalc's own trace of the config; the measured peaks (allocated less what
    an earlier engine left, reserved) beside what `zerocalc estimate --hf-config` predicts (targets:
    allocated 3%, reserved 8%)."""
    ok = repredict_hf(ok, every)
    ok = ok.assign(_own=own_peak_allocated(ok).astype(float), _resv=ok["measured_peak_reserved_bytes"].astype(float),
                   _ckpt=ok["activation_checkpointing"].map(lambda v: bool(_cast(v, bool))))
    state_ok = ok["now_state_bytes"] == ok["measured_state_bytes"].astype(float)
    comm_ok = ok["now_comm_bytes"] == ok["measured_comm_bytes"].astype(float)
    traced_ok = (ok["pred_state_bytes"] == ok["measured_state_bytes"].astype(float)) & \
        (ok["pred_comm_bytes"] == ok["measured_comm_bytes"].astype(float))
    err_a = (ok["now_peak_allocated_bytes"] - ok["_own"]) / ok["_own"]
    err_r = (ok["now_peak_reserved_bytes"] - ok["_resv"]) / ok["_resv"]
    lines = ["", "HF configs (AutoModelForCausalLM.from_config; engine = deepspeed.initialize, trainer = HF Trainer with "
                 "an \"auto\" ds_config; loop = a user's own engine loop, zerocalc.probe) and probed models of one's "
                 "own; state/comm: = exact from the recorded tensors, traced = from zerocalc's trace of the config; "
                 "peaks in GiB, predicted as `zerocalc estimate --hf-config` does",
             f"{'model':>20} {'layers':>6} {'path':>7} {'st':>2} {'ckpt':>4} {'state':>5} {'traced':>6} "
             f"{'alloc':>7} {'pred':>7} {'err':>7} {'resv':>7} {'pred':>7} {'err':>7}"]
    fmt = lambda v, spec: "-" if pd.isna(v) else format(v, spec)  # noqa: E731
    for i, r in ok.sort_values(["hf_name", "path", "stage", "_ckpt"]).iterrows():
        layers = "-" if pd.isna(r["num_layers"]) else int(r["num_layers"])   # a probed model of one's own has none
        lines.append(f"{r['hf_name']:>20} {layers:>6} {r['path']:>7} {r['stage']:>2} "
                     f"{'y' if r['_ckpt'] else 'n':>4} {'=' if state_ok[i] and comm_ok[i] else 'DIFF':>5} "
                     f"{'=' if traced_ok[i] else ('-' if pd.isna(r['pred_state_bytes']) else 'DIFF'):>6} "
                     f"{r['_own'] / GiB:>7.2f} {fmt(r['now_peak_allocated_bytes'] / GiB, '7.2f'):>7} "
                     f"{fmt(err_a[i], '+7.1%'):>7} {r['_resv'] / GiB:>7.2f} "
                     f"{fmt(r['now_peak_reserved_bytes'] / GiB, '7.2f'):>7} {fmt(err_r[i], '+7.1%'):>7}")
    lines.append(f"State and communication exact from the recorded tensors: {int((state_ok & comm_ok).sum())} of "
                 f"{len(ok)} rows; from zerocalc's trace of the config: {int(traced_ok.sum())} of {len(ok)}")
    predicted = err_a.notna()
    if ok["_own"].isna().all():
        lines.append("Peaks: none measured (CPU backend)")
    elif not predicted.any():
        lines.append(f"Peaks: {len(ok)} rows measured, none predicted (zerocalc could not trace these configs here)")
    else:
        for err, name, target in ((err_a, "allocated", 0.03), (err_r, "reserved", 0.08)):
            e = err[predicted].abs()
            lines.append(f"Peak {name}: {int((e <= target).sum())} of {len(e)} predicted rows within {target:.0%} "
                         f"(mean |err| {e.mean():.1%}, worst {e.max():.1%})")
    lines += hf_step_section(ok)
    return lines, bool(state_ok.all() and comm_ok.all())


def hf_step_times(timed: pd.DataFrame) -> pd.DataFrame:
    """now_step_s for HF rows timed as training runs: zerocalc's step time from the config alone
    (`hf_models.traced_spec`, what `zerocalc estimate --hf-config --gpu h200` prints: FLOPs and the
    operators dispatched read from the model's code, `zerocalc.hf.optrace`), and fallback_step_s, the
    same profile without those counts (a Llama layer's operators, 2·P'·T FLOPs: the time model before
    it read them); each on the row's own host speed where probed before every timed step."""
    from dataclasses import replace
    from validate import hf_models
    from zerocalc import calibration, timing
    cal = calibration.default()
    now, fallback = [], []
    for _, r in timed.iterrows():
        job = job_from_row(r.to_dict())
        spec = hf_models.traced_spec(job)
        if spec is None or spec.profile is None:
            now.append(float("nan"))
            fallback.append(float("nan"))
            continue
        setup = to_zerocalc(job)[1]
        h200 = h200_of(r.to_dict(), setup.dp)
        e = estimate(spec, setup, hardware=h200)
        row_cal = at_row_host(cal, r.to_dict())
        bare = replace(e.model, profile=replace(spec.profile, steps=None))
        for out, model in ((now, e.model), (fallback, bare)):
            t = timing.step_time(model, e.setup, e.collectives, h200, row_cal)
            out.append(t.step_s if t else float("nan"))
    return timed.assign(now_step_s=now, fallback_step_s=fallback)


def hf_step_section(ok: pd.DataFrame, target: float = 0.15) -> list[str]:
    """HF configs' step time per configuration (the median over its jobs, as `by_configuration`):
    measured, predicted from the traced counts and with the fallback, beside what a perfect model
    would reach on the same jobs (`perfect_model_floor`)."""
    timed = ok[timed_whole_steps(ok)]
    if timed.empty:
        return []
    timed = with_configuration(hf_step_times(timed.assign(measured_step_s=timed["measured_step_s"].astype(float))))
    confs = timed.groupby("conf").agg(name=("hf_name", "first"), layers=("num_layers", "first"), path=("path", "first"),
                                      stage=("stage", "first"), ckpt=("activation_checkpointing", "first"),
                                      jobs=("measured_step_s", "size"), measured=("measured_step_s", "median"),
                                      now=("now_step_s", "median"), fallback=("fallback_step_s", "median"))
    lines = ["", f"HF configs' step time per configuration (median of its jobs' median steps, ms; on each job's host "
                 f"speed where probed): traced = from the operators and FLOPs read from the model's code, fallback "
                 f"= as a Llama layer with 2·P'·T FLOPs",
             f"{'model':>20} {'layers':>6} {'path':>7} {'st':>2} {'ckpt':>4} {'jobs':>4} {'measured':>8} "
             f"{'traced':>8} {'err':>7} {'fallback':>8} {'err':>7}"]
    for _, c in confs.sort_values(["name", "path", "stage"]).iterrows():
        lines.append(f"{c['name']:>20} {c['layers']:>6} {c['path']:>7} {c['stage']:>2} "
                     f"{'y' if _cast(c['ckpt'], bool) else 'n':>4} {c['jobs']:>4} {1e3 * c['measured']:>8.1f} "
                     f"{1e3 * c['now']:>8.1f} {c['now'] / c['measured'] - 1:>+7.1%} {1e3 * c['fallback']:>8.1f} "
                     f"{c['fallback'] / c['measured'] - 1:>+7.1%}")
    pool = jobs_log_deviation(timed)
    for col, name in (("now", "traced"), ("fallback", "fallback")):
        conf_err = (confs[col] / confs["measured"] - 1).abs()
        row_err = (timed[f"{col}_step_s"] / timed["measured_step_s"] - 1).abs()
        lines.append(f"Step time, {name}: {int((conf_err <= target).sum())} of {len(confs)} configurations within "
                     f"{target:.0%} (mean |err| {conf_err.mean():.1%}, worst {conf_err.max():.1%}); per job mean |err| "
                     f"{row_err.mean():.1%} over {len(timed)} jobs")
    if len(pool) >= 2:      # the scatter between jobs needs a configuration timed in two jobs or more
        floor = perfect_model_floor(confs, pool, target)
        lines.append(f"A perfect model on these jobs: {floor['expected']:.1f} of {len(confs)} expected within "
                     f"{target:.0%} (5th percentile {floor['p05']})")
    return lines


def report(paths, rows: pd.DataFrame | None = None) -> tuple[str, bool]:
    """The error tables. `rows`: the ok rows already re-predicted (`committed_rows`), to save doing it again.
    Rows of HF configs come last, in their own section (`hf_section`)."""
    df = load(paths)
    lines = [f"{len(df)} rows from {', '.join(paths)}: " +
             ", ".join(f"{k} {v}" for k, v in df["outcome"].value_counts().items())] + df.attrs.get("notes", [])
    hf = hf_rows(df)
    hf_ok = df[hf & (df["outcome"] == "ok")]
    hf_lines, hf_exact = hf_section(hf_ok, df[hf]) if not hf_ok.empty else ([], True)
    df = df[~hf]
    ok = df[df["outcome"] == "ok"]
    if ok.empty:
        return "\n".join(lines + hf_lines), hf_exact and not hf_ok.empty
    ok = repredict(ok, df) if rows is None else rows
    lines += _table(ok, "now_state_bytes", "measured_state_bytes",
                           "Resident state bytes per rank after a step (max over ranks); exact = to the byte", True)
    lines += _table(ok, "now_comm_bytes", "measured_comm_bytes",
                           "Logged communication bytes per optimizer step (all collectives)", True)
    exact = bool((ok["now_state_bytes"] == ok["measured_state_bytes"].astype("int64")).all()
                 and (ok["now_comm_bytes"] == ok["measured_comm_bytes"].astype("int64")).all())
    gpu = ok[ok["measured_peak_allocated_bytes"].notna()] if "measured_peak_allocated_bytes" in ok else ok.iloc[0:0]
    if not gpu.empty:
        from validate.fit import held_out_rows
        gpu = gpu.assign(own_peak=own_peak_allocated(gpu),
                         split=held_out_rows(gpu).map({True: "held-out", False: "train"}))
        for split, g in [("all", gpu)] + list(gpu.groupby("split")):
            lines += _table(g, "now_peak_allocated_bytes", "own_peak",
                                   f"Peak allocated (max_memory_allocated less what an earlier engine left), {split}"
                                   f" rows; target 5%", False, 0.05)
        offloaded = (gpu["offload_optimizer"] != "none") | (gpu["offload_param"] != "none")
        if offloaded.any():
            off = gpu[offloaded].assign(measured_host=gpu["measured_host_state_bytes"].astype(float))
            lines += _table(off, "now_host_bytes", "measured_host", "Host state bytes per rank (offloaded "
                                   "master, moments, gradients, parameters), GPU rows with offload", True)
            exact = exact and bool((off["now_host_bytes"] == off["measured_host"].astype("int64")).all())
        expandable = expandable_rows(gpu)
        simulated = gpu["now_reserved_source"] == "simulated"
        for rows_, name in ((~expandable, "rows that started clean"),
                            (~expandable & simulated, "rows that started clean, simulated (allocation sequence "
                                                      "through the allocator)"),
                            (~expandable & ~simulated, "rows that started clean, calibrated ratio (not generated)"),
                            (expandable, "rows run with expandable_segments:True that started clean")):
            clean = gpu[started_clean(gpu) & rows_]
            if not clean.empty:
                lines += _table(clean, "now_peak_reserved_bytes", "measured_peak_reserved_bytes",
                                       f"Peak reserved (max_memory_reserved), {name}; target 10%", False, 0.10)
        lines += reserved_growth(gpu)
        whole = timed_whole_steps(gpu)
        timed = gpu[whole]
        for split, g in [("all", timed)] + list(timed.groupby("split")):
            lines += _table(g, "now_step_s", "measured_step_s", f"Step time (median of whole steps timed as "
                                   f"training runs; on the row's own host speed where probed before each step), "
                                   f"{split} rows; target 15%", False, 0.15)
        probed = timed[[measured_host_launch_s(r.to_dict()) is not None for _, r in timed.iterrows()]]
        if not probed.empty:
            for col, name in (("now_step_s", "on each row's own host speed"),
                              ("now_step_fitted_host_s", "on the fitted hosts' median speed")):
                lines += _table(probed, col, "measured_step_s", f"Step time, rows whose host speed was probed "
                                       f"before each timed step, {name}; target 15%", False, 0.15)
        lines += _table(timed, "now_step_fitted_host_s", "measured_step_s", "Step time on the fitted hosts' "
                               "median speed, as `zerocalc estimate --gpu h200` prints it, all rows (within 15%)",
                               False, 0.15)
        timed_off = timed[offloaded[whole]]
        for split, g in [("all", timed_off)] + list(timed_off.groupby("split")):
            lines += _table(g, "now_step_s", "measured_step_s", f"Step time with CPU offload, {split} rows "
                                   "(included above); target 15%", False, 0.15)
        if not timed.empty:
            lines += [""] + _within_own_steps(timed) + _host_speed(timed)
        for pred, meas, name in (("now_forward_s", "measured_forward_s", "forward"),
                                 ("now_backward_s", "measured_backward_s", "backward"),
                                 ("now_step_phase_s", "measured_step_phase_s", "optimizer step")):
            lines += _table(timed, pred, meas, f"Step time, {name} phase alone (phase-synchronized steps), "
                                   "all rows (within 15%)", False, 0.15)
        old = gpu[~whole]
        if not old.empty:
            lines += _table(old, "now_step_s", "measured_step_s", "Step time of the earlier protocol (phase-"
                                   "synchronized, two jobs per host at times; not fitted, for reference)", False, 0.15)
        if not timed.empty:
            confs = by_configuration(timed)
            lines += _repeats(confs)
            n, best, model = reachable_rows(timed)
            if n:
                lines.append(f"Of those configurations' {n} rows, the best single prediction per configuration puts "
                             f"{best} within 15% (every row: {n}); this model {model}")
            lines += _table(confs, "now_step_s", "measured_step_s", f"Step time per configuration (median over "
                                   f"its jobs; {int((confs['jobs'] > 1).sum())} of {len(confs)} timed in more than one "
                                   "job); target 15%", False, 0.15)
            lines += _floor(confs, timed)
            if "split" in confs:   # the split is by configuration (fit.held_out): all its jobs on one side
                held = confs[confs["split"] == "held-out"]
                lines += _table(held, "now_step_s", "measured_step_s", f"Step time per configuration, held-out "
                                       f"configurations ({len(held)} of {len(confs)}); target 15%", False, 0.15)
            if not probed.empty:   # the host's speed known while each counted job was timed
                pc = by_configuration(probed)
                lines += _table(pc, "now_step_s", "measured_step_s", f"Step time per configuration, only its "
                                       f"jobs probed before each timed step (median over them, each on its own host "
                                       f"speed; {len(pc)} of the {len(confs)} configurations); target 15%", False, 0.15)
    scal = ok["measured_scalar_bytes"].max() if "measured_scalar_bytes" in ok else 0
    lines += ["", f"Residual not modelled: scalar tensors of <= 8 bytes (grad norm, overflow flag), at most {scal:.0f} B/rank."]
    return "\n".join(lines + hf_lines), exact and hf_exact


# --- Accuracy tables for README.md and docs/accuracy.md (`python -m validate report --markdown`,
# `python -m validate docs`): generated from the committed rows so that the documents cannot go stale.

def committed_rows(paths) -> pd.DataFrame:
    """Every ok row of `paths`, re-predicted by the current zerocalc (`repredict`)."""
    df = load(paths)
    return repredict(df[df["outcome"] == "ok"], df)


def device_rows(ok: pd.DataFrame) -> pd.DataFrame:
    """GPU rows judged on their device peaks: not those run beside other jobs on one GPU (`concurrent`,
    the host-memory rows: judged on bytes and host memory, docs/host-memory.md), as the committed-data
    guards judge them."""
    return ok[ok["measured_peak_allocated_bytes"].notna() & ~concurrent(ok)]


def accuracy_errors(ok: pd.DataFrame) -> dict:
    """For each quantity the documents quote, the |relative error| of every row it is judged on and
    its target (0: exact to the byte), from re-predicted rows (`committed_rows`). Memory is judged on
    every GPU row (peak allocated less what an earlier engine left) and, for reserved, on rows that
    started clean with the default allocator; step time on rows timed as training runs, each on its
    own host's speed where probed, and per configuration (the median of its jobs). Device peaks leave out
    the rows run beside other jobs on one GPU (`device_rows`)."""
    err = lambda pred, meas: (pred.astype(float) / meas.astype(float) - 1).abs()  # noqa: E731
    gpu = device_rows(ok)
    out = {"resident state bytes": (err(ok["now_state_bytes"], ok["measured_state_bytes"]), 0),
           "communication bytes per step": (err(ok["now_comm_bytes"], ok["measured_comm_bytes"]), 0)}
    every_gpu = ok[ok["measured_peak_allocated_bytes"].notna()]
    offloaded = every_gpu[(every_gpu["offload_optimizer"] != "none") | (every_gpu["offload_param"] != "none")]
    if not offloaded.empty:
        out["host (offloaded) state bytes"] = (err(offloaded["now_host_bytes"],
                                                   offloaded["measured_host_state_bytes"]), 0)
    if gpu.empty:
        return out
    out["peak allocated"] = (err(gpu["now_peak_allocated_bytes"], own_peak_allocated(gpu)), 0.05)
    clean = gpu[started_clean(gpu) & ~expandable_rows(gpu)]
    out["peak reserved"] = (err(clean["now_peak_reserved_bytes"], clean["measured_peak_reserved_bytes"]), 0.10)
    timed = gpu[timed_whole_steps(gpu)]
    if not timed.empty:
        out["step time (H200), per job"] = (err(timed["now_step_s"], timed["measured_step_s"]), 0.15)
        confs = by_configuration(timed)
        out["step time (H200), per configuration"] = (err(confs["now_step_s"], confs["measured_step_s"]), 0.15)
    return out


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{x:.1%}" if x >= 0.1 else f"{x:.2%}"


def markdown_summary(ok: pd.DataFrame) -> str:
    """The README's accuracy table: per quantity, rows, median, 95th percentile and worst |error|, and
    how many rows meet the target."""
    lines = ["| quantity (per rank) | rows | median error | 95th percentile | worst | within target |",
             "|---|---:|---:|---:|---:|---|"]
    for name, (e, target) in accuracy_errors(ok).items():
        within = f"{int((e == 0).sum())} exact to the byte" if target == 0 else \
            f"{int((e <= target).sum())} within {target:.0%}"
        lines.append(f"| {name} | {len(e)} | {_pct(e.median())} | {_pct(e.quantile(0.95))} | {_pct(e.max())} | "
                     f"{within} |")
    return "\n".join(lines)


def markdown_by_stage(ok: pd.DataFrame, pred: str, meas: str, target: float, subset=None) -> str:
    """One quantity per stage, as a markdown table: rows, within target, median, 95th percentile, worst."""
    df = ok if subset is None else ok[subset]
    lines = [f"| stage | rows | within {target:.0%} | median error | 95th percentile | worst |",
             "|---:|---:|---:|---:|---:|---:|"]
    for stage, g in df.groupby("stage"):
        e = (g[pred].astype(float) / g[meas].astype(float) - 1).abs().dropna()
        if not e.empty:
            lines.append(f"| {stage} | {len(e)} | {int((e <= target).sum())} | {_pct(e.median())} | "
                         f"{_pct(e.quantile(0.95))} | {_pct(e.max())} |")
    return "\n".join(lines)


def with_anchors(gpu: pd.DataFrame) -> pd.DataFrame:
    """GPU rows with the measured peak allocated (`measured`, bytes, less what an earlier engine left)
    beside zerocalc's (`zerocalc`), the ZeRO paper's model states (`paper`) and DeepSpeed's own
    estimator (`deepspeed_estimator`: stages 1-3, offload as the row ran; NaN at stage 0, where it has
    none), and each one's relative error (`*_err`)."""
    from zerocalc import reference
    paper, ds = [], []
    for _, r in gpu.iterrows():
        spec, _ = to_zerocalc(job_from_row(r.to_dict()))
        paper.append(reference.paper_model_states_bytes(r["num_params"], r["nproc"], r["stage"]))
        est = reference.deepspeed_estimator_gpu_bytes(r["num_params"], max(spec.param_numels), r["nproc"], r["stage"],
                                                      r["offload_optimizer"] != "none", r["offload_param"] != "none")
        ds.append(float("nan") if est is None else est)
    out = gpu.assign(measured=own_peak_allocated(gpu).astype(float), zerocalc=gpu["now_peak_allocated_bytes"].astype(float),
                     paper=paper, deepspeed_estimator=ds)
    for col in ("zerocalc", "paper", "deepspeed_estimator"):
        out[f"{col}_err"] = out[col] / out["measured"] - 1
    return out


def markdown_anchors(gpu: pd.DataFrame) -> str:
    """Per stage, the mean |error| against the measured peak allocated of zerocalc, the ZeRO paper's
    model states and DeepSpeed's estimator (`with_anchors`)."""
    a = with_anchors(gpu)
    lines = ["| stage | rows | zerocalc | ZeRO paper (model states) | DeepSpeed's estimator |", "|---:|---:|---:|---:|---:|"]
    for stage, g in a.groupby("stage"):
        ds = g["deepspeed_estimator_err"].abs().mean()
        lines.append(f"| {stage} | {len(g)} | {_pct(g['zerocalc_err'].abs().mean())} | "
                     f"{_pct(g['paper_err'].abs().mean())} | {'none' if pd.isna(ds) else _pct(ds)} |")
    return "\n".join(lines)


def card_verdicts(df: pd.DataFrame) -> pd.DataFrame:
    """For each row run on an emulated card (`allocator_capacity_bytes`: the caching allocator capped
    there, as a card of that size leaves it after the CUDA context), zerocalc's verdict on that capacity
    now (`Estimate.fits_device` at `gpu_memory_bytes` = the capacity + the calibrated context; for a
    fake world's row, on the one rank it ran) beside what the job did: ran (`ok`) or raised
    OutOfMemoryError (`oom`, and where: `oom_at`). Columns:
    key, card_gib, capacity_bytes, predicted_fits, headroom_bytes, fits_source, outcome, oom_at,
    timing_dependent (runs under some timings of stage 3's late frees or placements of the segments made
    after a retry, not all: `zerocalc.fits`),
    agrees; `need_bytes` is the capacity less the headroom (the least the job runs in, predicted). A
    published config's job is judged on its config's trace, what `estimate --hf-config` answers before
    the job runs (one that ran out recorded no spec of its own); that needs the trace extra."""
    from zerocalc import calibration
    from validate import hf_models
    context = calibration.default().get("device", {}).get("context_bytes", 0)
    out = []
    for _, r in df.iterrows():
        cap = pd.to_numeric(r.get("allocator_capacity_bytes"), errors="coerce")
        if pd.isna(cap) or r["outcome"] not in ("ok", "oom"):
            continue
        job = job_from_row(r.to_dict())
        spec, setup = to_zerocalc(job)
        if job.get("hf"):
            spec = hf_models.traced_spec(job)
            if spec is None:
                raise RuntimeError(f"{r['key']}: its config cannot be traced here: install the trace extra "
                                   "(pip install '.[trace]')")
        # a fake world ran one rank (`fake_rank`): the verdict on that rank's replays
        ranks = (fake_rank(r.to_dict()),) if r.get("world") == "fake" else None
        e = estimate(spec, setup, gpu_memory_bytes=int(cap) + context, ranks=ranks)
        out.append({"key": r["key"], "card_gib": round((int(cap) + context) / 2**30), "capacity_bytes": int(cap),
                    "predicted_fits": bool(e.fits_device), "headroom_bytes": e.headroom_bytes,
                    "need_bytes": int(cap) - e.headroom_bytes, "fits_source": e.fits_source,
                    "outcome": r["outcome"], "oom_at": r.get("oom_at", ""),
                    "retries": r.get("measured_alloc_retries"),
                    "timing_dependent": bool(e.at_capacity is not None and e.at_capacity.timing_dependent),
                    "agrees": bool(e.fits_device) == (r["outcome"] == "ok")})
    return pd.DataFrame(out)
