"""`python -m validate run|report|fit|snapshot`."""
import sys

import click

from zerocalc import arch as _arch


def _ints(text):
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a comma-separated list of integers")


def _strs(text):
    return [x.strip() for x in str(text).split(",") if x.strip()]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Validate zerocalc against real DeepSpeed jobs.

    \b
      python -m validate run --backend cpu --nproc 2 --stages 0,1,2,3 --dtype bf16 \\
          --hidden-size 64 --num-layers 2 --num-heads 4 --vocab-size 1000 --seq-len 16 --micro-batch 2 \\
          --out data/cpu.csv
      python -m validate report data/cpu.csv
    """


def _fail(message: str, code: int):
    """One line on stderr and the exit code: 2 for input to fix, 1 for a sweep stopped part-way."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


def _needs_pandas(command: str) -> None:
    """The tables and fits are pandas': one line saying how to get it, not an ImportError."""
    try:
        import pandas  # noqa: F401
    except ImportError:
        _fail(f"`python -m validate {command}` needs pandas: pip install 'zerocalc[validate]' (or pip install "
              "pandas)", 2)


@main.command()
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), required=True)
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks (GPUs or CPU processes).")
@click.option("--matrix", type=click.Path(exists=True, dir_okay=False), help="A JSON matrix file instead of the flags.")
@click.option("--family", type=click.Choice(list(_arch.FAMILIES)), default="seed-gpt", show_default=True)
@click.option("--stages", default="0,1,2,3", show_default=True)
@click.option("--dtype", "dtypes", default="bf16", show_default=True, help="Comma list of fp32, fp16, bf16.")
@click.option("--hidden-size", type=int, default=64, show_default=True)
@click.option("--num-layers", type=int, default=2, show_default=True)
@click.option("--num-heads", type=int, default=4, show_default=True)
@click.option("--num-kv-heads", type=int)
@click.option("--ffn-hidden-size", type=int)
@click.option("--vocab-size", type=int, default=1000, show_default=True)
@click.option("--seq-len", "seq_lens", default="16", show_default=True, help="Comma list.")
@click.option("--micro-batch", "micro_batches", default="2", show_default=True, help="Comma list.")
@click.option("--gas", "gases", default="1", show_default=True, help="Comma list.")
@click.option("--reduce-bucket-size", "rbs", default="500000000", show_default=True, help="Comma list, elements.")
@click.option("--activation-checkpointing", "ckpt", default="0", show_default=True, help="Comma list of 0/1.")
@click.option("--hf-config", type=click.Path(exists=True),
              help="Train this Hugging Face model instead of the shape flags: a config.json or a model directory "
                   "(AutoModelForCausalLM.from_config, random weights); see docs/hf-validation.md.")
@click.option("--hf-layers", type=click.IntRange(min=1), help="With --hf-config: num_hidden_layers (scale it down).")
@click.option("--trainer-ds-config",
              help="With --hf-config: train through HF Trainer with this ds_config (a file, or zero2-auto, "
                   "zero3-auto, zero2-auto-offload, zero3-auto-offload: the HF docs' \"auto\" configs); the stage is its.")
@click.option("--attention", type=click.Choice(["sdpa", "eager", "flash"]), default="sdpa", show_default=True,
              help="With --hf-config: the attention implementation (Gemma-2 needs eager).")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True, help="Seconds a job may run.")
@click.option("--include", help="DeepSpeed --include (e.g. localhost:1) instead of --num_gpus.")
@click.option("--retry-failed", is_flag=True, help="Run again the jobs whose last row is not ok (a new row is added).")
@click.option("--fake-world", is_flag=True,
              help="Run each job as rank 0 of --nproc ranks in one process (torch's fake process group): what "
                   "rank 0 of N holds, allocates and logs, on one GPU or CPU; collectives move nothing, so "
                   "losses and times are not the job's (rows marked world=fake, never timed or fitted).")
@click.option("--fake-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --fake-world: run each job as this rank of --nproc instead of rank 0 (at stages 1-2 the "
                   "ranks' gradient partitions differ: `zerocalc.sequence.simulated_ranks` names the busiest).")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
              help="Spread each job's --nproc ranks over nodes: DeepSpeed's hostfile (`hostname slots=N` a line). "
                   "Run the same command on every node with its --node-rank; node 0's writes --out.")
@click.option("--node-rank", type=click.IntRange(min=0), help="With --hostfile: this node's line in it, from 0.")
@click.option("--master-addr", help="With --hostfile: node 0's address, which every node can reach.")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True,
              help="With --hostfile: the port on node 0 every node's launch meets at.")
@click.option("--out", "out_csv", required=True, type=click.Path(dir_okay=False), help="CSV to append rows to.")
def run(backend, nproc, matrix, family, stages, dtypes, hidden_size, num_layers, num_heads, num_kv_heads,
        ffn_hidden_size, vocab_size, seq_lens, micro_batches, gases, rbs, ckpt, hf_config, hf_layers, trainer_ds_config,
        attention, timeout_s, include, retry_failed, fake_world, fake_rank, hostfile, node_rank, master_addr, master_port,
        out_csv):
    """Launch DeepSpeed jobs (one fresh engine each) and append measured-vs-predicted rows.

    \b
    Across two nodes (2 ranks each; the same command on both, --node-rank 0 on the first):
      python -m validate run --backend cuda --nproc 4 --hostfile hosts --node-rank 0 \\
          --master-addr 10.0.0.1 --matrix m.json --out rows.csv
    """
    from validate import jobs as J
    from validate.results_file import ResultsFileError, check_output
    from validate.runner import LaunchError, RowWriteError, SetupError, check_env, check_launcher, run as run_jobs
    nodes = _nodes(hostfile, node_rank, master_addr, master_port, nproc, include, fake_world)
    if fake_rank and not fake_world:
        _fail("--fake-rank needs --fake-world (a real job runs every rank)", 2)
    if fake_rank >= nproc:
        _fail(f"--fake-rank {fake_rank} is not a rank of --nproc {nproc} ranks: give 0 to {nproc - 1}", 2)
    if matrix:
        try:
            job_list = J.load_matrix(matrix)
        except J.MatrixError as err:
            _fail(str(err), 2)
        for j in job_list:
            if j["nproc"] != nproc:
                _fail(f"{matrix} asks for nproc {j['nproc']} but --nproc is {nproc}", 2)
    elif hf_config:
        import itertools
        axes = dict(dtype=_strs(dtypes), seq_len=_ints(seq_lens), micro_batch=_ints(micro_batches), gas=_ints(gases),
                    activation_checkpointing=[bool(x) for x in _ints(ckpt)], attention=[attention])
        if trainer_ds_config:
            axes.update(path=["trainer"], ds_config=[trainer_ds_config])
        else:
            axes.update(stage=_ints(stages), reduce_bucket_size=_ints(rbs))
        entry = {"config": hf_config, "overrides": {"num_hidden_layers": hf_layers} if hf_layers else {}}
        try:
            job_list = [J.make_hf_job(entry, nproc, **dict(zip(axes, v))) for v in itertools.product(*axes.values())]
        except (ValueError, TypeError, KeyError, OSError) as err:
            _fail(f"--hf-config {hf_config}: {err}", 2)
    else:
        try:
            a = _arch.Architecture(family, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads or num_heads,
                                   ffn_hidden_size or 4 * hidden_size, False, max(_ints(seq_lens)) + 1)
            _arch.validate_architecture(a)
        except ValueError as err:
            _fail(str(err), 2)
        job_list = J.grid([a], nproc, stage=_ints(stages), dtype=_strs(dtypes), seq_len=_ints(seq_lens),
                          micro_batch=_ints(micro_batches), gas=_ints(gases), reduce_bucket_size=_ints(rbs),
                          activation_checkpointing=[bool(x) for x in _ints(ckpt)])
    if fake_world:
        if any(j.get("path") == "trainer" for j in job_list):
            _fail("--fake-world runs DeepSpeed's engine directly; HF Trainer jobs (--trainer-ds-config, a matrix's "
                  "path \"trainer\") are not run in a fake world: leave one of them out", 2)
        job_list = [J.with_fake_world(j, fake_rank) for j in job_list]
    if nodes is not None:
        job_list = [J.with_nodes(j, nodes.count) for j in job_list]
    try:
        if nodes is None or nodes.leader:
            check_output(out_csv)
        check_launcher()
        check_env()
    except (ResultsFileError, SetupError) as err:
        _fail(str(err), 2)
    ranks = f"rank {fake_rank} of {nproc} (fake world)" if fake_world else f"{nproc} ranks" + (
        f" over {nodes.count} nodes (this is node {nodes.node_rank}" + (")" if nodes.leader else ": node 0 writes the rows)")
        if nodes else "")
    click.echo(f"{len(job_list)} jobs, backend {backend}, {ranks} -> {out_csv}", err=True)
    try:
        written = run_jobs(job_list, backend, nproc, out_csv, timeout_s, include,
                           log=lambda m: click.echo(m, err=True), retry_failed=retry_failed, nodes=nodes)
    except (RowWriteError, LaunchError) as err:   # mid-sweep (a full disk, a broken environment): resumable
        _fail(str(err), 1)
    except (ResultsFileError, SetupError) as err:  # --out unusable or no DeepSpeed, found before any launch
        _fail(str(err), 2)
    bad = [r for r in written if r["outcome"] != "ok"]
    click.echo(f"done: {len(written)} rows written, {len(bad)} not ok", err=True)
    if written and len(bad) == len(written):   # the rows stay in --out; something common to every job is wrong
        _fail(f"every one of the {len(written)} jobs failed; the first ({bad[0]['key']}): "
              f"{bad[0]['outcome']}: {str(bad[0].get('error', ''))[:300]}", 2)


def _nodes(hostfile, node_rank, master_addr, master_port, nproc, include, fake_world):
    """`runner.Nodes` from run's --hostfile flags, None without one; one line, exit 2, for flags that do not
    go together or a hostfile whose slots are not --nproc."""
    from validate.runner import Nodes, SetupError, read_hostfile
    if hostfile is None:
        if node_rank is not None or master_addr is not None:
            _fail("--node-rank and --master-addr go with --hostfile", 2)
        return None
    if node_rank is None or master_addr is None:
        _fail("--hostfile needs --node-rank (this node's line in it, from 0) and --master-addr (node 0's address)", 2)
    if include or fake_world:
        _fail(f"--hostfile spreads the ranks over nodes: leave out {'--include' if include else '--fake-world'}", 2)
    try:
        slots = read_hostfile(hostfile)
    except SetupError as err:
        _fail(str(err), 2)
    if node_rank >= len(slots):
        _fail(f"--node-rank {node_rank}: {hostfile} has {len(slots)} nodes (0-{len(slots) - 1})", 2)
    if sum(slots) != nproc:
        _fail(f"--nproc {nproc}: the job's ranks, over every node; {hostfile}'s slots add up to {sum(slots)}", 2)
    return Nodes(hostfile, node_rank, master_addr, master_port, slots)


@main.command()
@click.argument("csv_paths", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--strict", is_flag=True, help="Exit 1 unless state and comm bytes match exactly on every ok row.")
@click.option("--markdown", is_flag=True, help="Print only the summary table the README shows (markdown).")
def report(csv_paths, strict, markdown):
    """Errors of zerocalc's current predictions against the measured rows, per stage. Without
    CSV_PATHS: the committed H200 rows of real worlds (data/h200-*.csv less the HF-config, fake-world
    and emulated-card files), the README's table."""
    _needs_pandas("report")
    from validate.docs import committed_paths
    from validate.report import report as make_report
    from validate.results_file import ResultsFileError
    csv_paths = csv_paths or tuple(committed_paths())
    try:
        if markdown:
            from validate.report import committed_rows, markdown_summary
            click.echo(markdown_summary(committed_rows(list(csv_paths))))
            return
        text, exact = make_report(csv_paths)
    except ResultsFileError as err:
        _fail(str(err), 2)
    click.echo(text)
    if strict and not exact:
        sys.exit(1)


@main.command("fit")
@click.argument("csv_paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_path", default="zerocalc/calibration/h200.json", show_default=True,
              help="Calibration file to write.")
def fit_cmd(csv_paths, out_path):
    """Fit the calibrated constants on a training split of GPU rows; report the held-out split."""
    _needs_pandas("fit")
    from validate.fit import CannotWrite, NothingToFit, fit
    from validate.report import report as make_report
    from validate.results_file import ResultsFileError
    try:
        _, text = fit(list(csv_paths), out_path)
    except (ResultsFileError, NothingToFit) as err:
        _fail(str(err), 2)
    except CannotWrite as err:
        _fail(str(err), 1)
    click.echo(text)
    from zerocalc import calibration
    calibration._cache.clear()
    click.echo("")
    click.echo(make_report(list(csv_paths))[0])


@main.command("docs")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a generated block is stale.")
def docs_cmd(check):
    """Rewrite the generated blocks of README.md and docs/accuracy.md (supported models, the examples'
    output, the accuracy tables) from the code and the committed rows in data/ (about a minute)."""
    _needs_pandas("docs")
    from validate.docs import stale, write_all
    if check:
        bad = stale()
        if bad:
            click.echo(f"stale: {', '.join(bad)}; run python -m validate docs", err=True)
            sys.exit(1)
        return
    try:
        changed = write_all()
    except OSError as err:   # a full disk: each document is written whole or left as it was
        _fail(f"could not write {err.filename or 'a document'}: {err.strerror or err}; run it again once there is "
              "room", 1)
    click.echo(f"rewrote {', '.join(changed)}" if changed else "up to date")


@main.command("crossval")
@click.argument("csv_paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def crossval_cmd(csv_paths):
    """Cross-validate the step-time model: each fold of configurations (a quarter, by a hash of what
    ran) predicted by the time constants fitted on the other three, so that every configuration is
    judged as one the fit never saw, and how far each constant moves between the folds. Writes
    nothing; a few seconds."""
    _needs_pandas("crossval")
    from validate.fit import cross_validate_time, cross_validation_report
    try:
        timed, sections = cross_validate_time(list(csv_paths), progress=lambda m: click.echo(m, err=True))
    except ValueError as err:   # ResultsFileError among them
        _fail(str(err), 2)
    click.echo(cross_validation_report(timed, sections))


@main.command("host")
@click.argument("csv_paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def host_cmd(csv_paths):
    """Host memory per rank: each row's measured peak resident set (VmHWM) beside zerocalc.host's
    prediction now and the one written in the row at its run, and pinned bytes, as a markdown table
    (docs/host-memory.md)."""
    _needs_pandas("host")
    from validate.host_report import host_rows, markdown_table
    from validate.results_file import ResultsFileError
    try:
        rows = host_rows(list(csv_paths))
    except ResultsFileError as err:
        _fail(str(err), 2)
    if not rows:
        _fail(f"no ok row with host measurements (measured_host_peak_bytes) in {', '.join(csv_paths)}; give "
              "data/h200-host-*.csv", 2)
    click.echo(markdown_table(rows))


@main.command("snapshot")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--top", type=int, default=15, show_default=True, help="Groups of tensors to list per file.")
@click.option("--compact-to", type=click.Path(file_okay=False), default=None,
              help="Instead of summarizing, write each pickle as DIR/NAME.json.gz: the trace's actions, "
                   "addresses, sizes, streams and call sites, small enough to commit.")
def snapshot_cmd(paths, top, compact_to):
    """What was alive at the allocated and reserved peaks, from the allocator history the worker dumps
    when VALIDATE_SNAPSHOT_DIR is set (rank 0; VALIDATE_SNAPSHOT_SCOPE=step, the default, records one
    steady-state step; =warmup records from before the model is built to the end of the warm-up steps).
    PATHS: .pickle files, or .json.gz files written by --compact-to."""
    import gzip
    import json
    import os

    from validate.results_file import replace_whole
    from validate.snapshot import compact, load, summarize
    for path in paths:
        try:
            if not compact_to:
                click.echo(summarize(path, top))
                continue
            data = gzip.compress(json.dumps(compact(load(path)), separators=(",", ":")).encode())
        except Exception as err:   # noqa: BLE001 -- unpickling bytes that are not a snapshot raises anything
            _fail(f"{path} is not a torch memory snapshot written by the worker ({type(err).__name__}); give the "
                  ".pickle files from VALIDATE_SNAPSHOT_DIR", 2)
        name = os.path.basename(path).removesuffix(".pickle") + ".json.gz"
        try:   # read first, then written whole: a bad input or a full disk leaves no file behind
            os.makedirs(compact_to, exist_ok=True)
            replace_whole(os.path.join(compact_to, name), data)
        except OSError as err:
            _fail(f"could not write {os.path.join(compact_to, name)}: {err.strerror or err}", 1)
