"""Runs under DeepSpeed's launcher (`deepspeed --num_gpus N -m validate.worker JOBS OUT_DIR`): trains
each job of JOBS (a JSON list) with a fresh engine and appends one JSON line per job to
OUT_DIR/results.jsonl from rank 0 holding every rank's measurements. Rank 0 writes
OUT_DIR/started.jsonl before each job, so the driver can tell a crash or hang from a finished job.
Across nodes (`validate run --hostfile`) every node's first rank keeps these files for its own runner."""
import contextlib
import gc
import json
import os
import pickle
import statistics
import sys
import time
import traceback

import torch

from validate import hf_models, lifeline, measure
from validate.jobs import steps_override
from zerocalc.hf.families import HFCausalLM, build_model
from zerocalc.probe.measure import tolerate_unknown_comm_ops



WARMUP_STEPS = 2      # optimizer steps before measuring: Adam state and the stage-3 trace (frozen after
                      # its second iteration, with a few one-time broadcasts) are made here
PHASE_STEPS = 3       # optimizer steps after the comm-logged one with a synchronize() at each phase boundary:
                      # per-phase peaks and times
TIMED_STEPS = 10      # then whole optimizer steps timed without phase boundaries, as training runs them
                      # (all kept: their spread is the measurement's own noise)
if os.environ.get("VALIDATE_FEW_STEPS"):
    # Bytes only (the CPU tests): state and communication are read after the comm-logged step, so one
    # phase step and one timed step keep every column filled at a third of the steps.
    PHASE_STEPS, TIMED_STEPS = 1, 1
# VALIDATE_STEPS="W,P,T" sets them (`jobs.steps_override`): host-memory rows need only the first steps
# (the host peak is set at initialize and the first step), memory-only rows a few.
if os.environ.get("VALIDATE_STEPS"):
    WARMUP_STEPS, PHASE_STEPS, TIMED_STEPS = steps_override(os.environ["VALIDATE_STEPS"])
# VALIDATE_ONE_JOB=1: a fresh process per job, so each job's host memory starts from the runtime's own
# baseline (freed pinned blocks stay cached in torch's host allocator, and freed heap is not always
# given back to the system, which would sit under the next job's host peak).
ONE_JOB = os.environ.get("VALIDATE_ONE_JOB") == "1"


def ds_config(job):
    """The DeepSpeed config for one job, written out in full so a reader sees what ran."""
    zero = {"stage": job["stage"], "reduce_bucket_size": job["reduce_bucket_size"],
            "contiguous_gradients": job["contiguous_gradients"]}
    if job.get("overlap_comm") is not None:
        zero["overlap_comm"] = job["overlap_comm"]
    if job["stage"] == 3:
        zero.update(stage3_prefetch_bucket_size=job["prefetch_bucket_size"],
                    stage3_param_persistence_threshold=job["param_persistence_threshold"],
                    stage3_max_live_parameters=job["max_live_parameters"],
                    stage3_max_reuse_distance=job["max_reuse_distance"],
                    stage3_model_persistence_threshold=job["model_persistence_threshold"],
                    sub_group_size=job["sub_group_size"])
    if job["offload_optimizer"] != "none":
        zero["offload_optimizer"] = {"device": job["offload_optimizer"]}
    if job["offload_param"] != "none":
        zero["offload_param"] = {"device": job["offload_param"]}
    cfg = {
        "train_micro_batch_size_per_gpu": job["micro_batch"],
        "gradient_accumulation_steps": job["gas"],
        "optimizer": {"type": job["ds_optimizer"], "params": {"lr": 1e-4, **job.get("optimizer_params", {})}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": True},
        "wall_clock_breakdown": False,
    }
    if job["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True}
    elif job["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    data_types = {}
    if job.get("grad_accum_dtype"):
        data_types["grad_accum_dtype"] = job["grad_accum_dtype"]
    if data_types:
        cfg["data_types"] = data_types
    if job.get("communication_data_type"):
        cfg["communication_data_type"] = job["communication_data_type"]
    return merged(cfg, job.get("ds_extra", {}))   # `jobs.RUN_KEYS`


def merged(cfg: dict, extra: dict) -> dict:
    """`cfg` with `extra`'s keys added at every depth: a block's keys join the block's (an offload
    block given only pin_memory keeps its device), anything else replaces."""
    out = dict(cfg)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


SNAPSHOT_DIR = os.environ.get("VALIDATE_SNAPSHOT_DIR")   # diagnostics: rank 0's allocator history
# Which steps it records: "step" (default), the comm-logged steady-state step; "warmup", everything from
# before the model is built to the end of the warm-up steps, where the reserved peak is usually set;
# "job", from before the build to the job's end or the error that ended it (an emulated card's OOM).
SNAPSHOT_SCOPE = os.environ.get("VALIDATE_SNAPSHOT_SCOPE", "step")
# VALIDATE_SNAPSHOT_STACKS=none records sizes and addresses without python stacks: recording stacks
# has crashed stage-3 + offload + checkpointing jobs (a torch SystemError in an autograd Function).
SNAPSHOT_STACKS = os.environ.get("VALIDATE_SNAPSHOT_STACKS", "python")


def _cached_segments() -> list:
    """The allocator's segments before a history, as `zerocalc.allocator.replay` takes them: (address,
    size, stream, small pool, [(block address, size, allocated)]); a block's address is its segment's
    plus the sizes of the blocks before it."""
    out = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr, blocks = seg["address"], []
        for b in seg["blocks"]:
            blocks.append((addr, b["size"], b["state"] != "inactive"))
            addr += b["size"]
        out.append((seg["address"], seg["total_size"], seg["stream"], seg["segment_type"] == "small", blocks))
    return out


PROFILE_DIR = os.environ.get("VALIDATE_PROFILE_DIR")   # diagnostics: rank 0's profile of one extra step


@contextlib.contextmanager
def _profiled(key, cuda):
    """With VALIDATE_PROFILE_DIR set, profile the block on rank 0 (host activity, and the device's on a
    GPU) and write DIR/KEY.txt: the operators by host time, by device time and by host time with children."""
    if not (PROFILE_DIR and int(os.environ.get("RANK", 0)) == 0):
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    table = prof.key_averages()
    os.makedirs(PROFILE_DIR, exist_ok=True)
    with open(os.path.join(PROFILE_DIR, key + ".txt"), "w") as f:
        for sort in ("self_cpu_time_total", "self_cuda_time_total", "cpu_time_total"):
            f.write(f"== by {sort}\n{table.table(sort_by=sort, row_limit=40, max_name_column_width=70)}\n")


@contextlib.contextmanager
def _memory_history(key, cuda, *scopes):
    """With VALIDATE_SNAPSHOT_DIR set and VALIDATE_SNAPSHOT_SCOPE one of scopes, record every allocation and
    free of rank 0 during the block and dump torch's memory snapshot to DIR/KEY.pickle (read by
    `python -m validate snapshot`)."""
    if not (SNAPSHOT_DIR and SNAPSHOT_SCOPE in scopes and cuda and int(os.environ.get("RANK", 0)) == 0):
        yield
        return
    torch.cuda.synchronize()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    try:
        start = _cached_segments()
    except (KeyError, TypeError) as err:   # a torch whose snapshot reads differently: keep the history
        start = f"not recorded: {type(err).__name__}: {err}"
    if SNAPSHOT_STACKS == "none":
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=SNAPSHOT_STACKS)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        snap["zerocalc_base_allocated"], snap["zerocalc_base_reserved"] = base, base_reserved
        snap["zerocalc_start_segments"] = start
        snap["zerocalc_peak_allocated"] = torch.cuda.max_memory_allocated()
        snap["zerocalc_peak_reserved"] = torch.cuda.max_memory_reserved()
        torch.cuda.memory._record_memory_history(enabled=None)
        os.makedirs(SNAPSHOT_DIR, exist_ok=True)
        with open(os.path.join(SNAPSHOT_DIR, key + ".pickle"), "wb") as f:
            pickle.dump(snap, f)


def _build_hf(job, cfg, seen, device):
    """An HF model from its config.json for the direct path, wrapped to return logits. At stage 3 with
    zero_init it is built the way HF's integration builds it for Trainer users: under an
    HfDeepSpeedConfig, which makes `from_config` enter zero.Init and initialize each module gathered (a
    bare zero.Init fails on configs with a pad_token_id); the MoE blocks become stage-3 leaves.
    A memory-only job (`zero_weights`) otherwise builds it on the GPU, where HF's random initialisers
    take seconds instead of the host's minutes for a 7B model: DeepSpeed moves a module not built under
    zero.Init there before it flattens or partitions anything (`engine._configure_distributed_model`),
    so the device holds the same tensors (data/README.md). The weights stay random, not zero: a zero
    router would send every token to the same experts."""
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config
    zero3 = job["stage"] == 3 and job.get("zero_init")
    keep = HfDeepSpeedConfig(cfg) if zero3 else None   # transformers holds it by weak reference
    on_gpu = job.get("zero_weights") and device.type == "cuda" and not zero3
    try:
        with torch.device(device) if on_gpu else contextlib.nullcontext():
            model = hf_models.build(job["hf"]["config"], job["dtype"], job["activation_checkpointing"],
                                    job["attention"])
    finally:
        del keep
        unset_hf_deepspeed_config()
    model = hf_models.apply_adapters(model, job)    # LoRA (PEFT) and frozen modules, where the job has them
    seen["leaves"] = hf_models.set_moe_leaves(model) if job["stage"] == 3 else []
    seen["recorder"] = hf_models.SpecRecorder(model)
    return HFCausalLM(model)


def run_job(job, device):
    """One job's result row (`_run_job`); rank 0's allocator history, where one is asked for, is
    written even when the job raises (VALIDATE_SNAPSHOT_SCOPE=job: up to the OOM)."""
    with contextlib.ExitStack() as history:
        return _run_job(job, device, history)


def _run_job(job, device, warmup_history):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.comm.comm import comms_logger

    cuda = device.type == "cuda"
    WHERE["at"] = "build"
    if cuda:
        # PYTORCH_CUDA_ALLOC_CONF's expandable_segments, per job: the caching allocator maps pages into
        # one growing segment instead of cudaMalloc'ing a segment per miss (set before any allocation
        # of the job; the previous job's cache was emptied).
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{bool(job.get('expandable_segments'))}")
        # A smaller card emulated: the caching allocator treats a segment that would take reserved past
        # the fraction as a failed cudaMalloc (frees its cached blocks, retries, then raises OOM), as
        # on a card with that much room for it. Reset after the job (main).
        cap = job.get("allocator_capacity_bytes")
        torch.cuda.set_per_process_memory_fraction(
            cap / torch.cuda.get_device_properties(device).total_memory if cap else 1.0, device)
    rec = measure.MemoryRecorder(cuda)
    host_rec = measure.HostRecorder(cuda)
    host_rec.start()
    rec.start()
    torch.manual_seed(job.get("seed", 0))
    cfg = ds_config(job)
    # zero_init: parameters born partitioned (deepspeed.zero.Init), as HF Trainer builds stage-3 models.
    init = deepspeed.zero.Init(config_dict_or_path=cfg) if job.get("zero_init") and job["stage"] == 3 \
        and not job.get("hf") else contextlib.nullcontext()
    warmup_history.enter_context(_memory_history(job["key"], cuda, "warmup", "job"))
    hf_seen = {}
    if job.get("hf"):
        model = _build_hf(job, cfg, hf_seen, device)
    else:
        with init:
            model = build_model(job["arch"], job["activation_checkpointing"], job["attention"],
                                zero_weights_dtype=job["dtype"] if job.get("zero_weights") else None)
    host_rec.mark("build")
    WHERE["at"] = "initialize"
    # the optimizer gets the parameters that train (all of them but for LoRA and frozen modules)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=hf_models.trained_parameters(model),
                                           config=cfg)
    del model
    gc.collect()
    host_rec.mark("init")
    rec.phase("init")
    vocab = job["arch"]["vocab_size"]
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    batch = torch.randint(0, vocab, (job["micro_batch"], job["seq_len"] + 1), generator=gen).to(device)
    inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    losses, step_s = [], []

    def optimizer_step(record, phases=True):
        """One optimizer step (GAS micro-steps). With `phases`, synchronize at each phase boundary and
        record its peaks and time (record=False files them as the warm-up's). The losses are read
        after the step, so an unsynchronized step runs without a host-device sync."""
        pending = []
        WHERE["steps"] += 1
        for micro in range(job["gas"]):
            if phases:
                rec.mark()
            WHERE["at"] = f"step {WHERE['steps']} micro-step {micro + 1} forward"
            logits = engine(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
            del logits
            if phases:
                rec.phase("forward", record)
            WHERE["at"] = f"step {WHERE['steps']} micro-step {micro + 1} backward"
            engine.backward(loss)
            if phases:
                rec.phase("backward", record)
            WHERE["at"] = f"step {WHERE['steps']} micro-step {micro + 1} optimizer step"
            engine.step()
            if phases:
                rec.phase("step", record)
            pending.append(loss.detach())
            del loss
        return pending

    def keep_losses(pending):
        losses.extend(x.item() for x in pending)

    comms_logger.enabled = False
    WHERE["steps"] = 0
    for i in range(WARMUP_STEPS):
        keep_losses(optimizer_step(record=False))
        if i == 0:
            host_rec.mark("first_step")
    if SNAPSHOT_SCOPE != "job":
        warmup_history.close()
    # One steady-state step with the comms logger on (it synchronizes after every op).
    comms_logger.reset_data()
    comms_logger.enabled = True
    with _memory_history(job["key"], cuda, "step"):
        keep_losses(optimizer_step(record=True))
    comms_logger.enabled = False
    comm = measure.comm_summary(dist.log_summary(return_dict=True))
    state = measure.resident_state(engine)
    for _ in range(PHASE_STEPS):
        keep_losses(optimizer_step(record=True))
    if PROFILE_DIR:   # one more whole step, profiled (not timed, not recorded); none otherwise
        with _profiled(job["key"], cuda):
            keep_losses(optimizer_step(record=False, phases=False))
    probe = measure.probe_machine(device)
    # Beside each timed step: the host's launch speed just before it, how long the host took to issue
    # the step (until optimizer_step returns, unsynchronized), and where its host time went
    # (measure.HostCounters).
    host_issue_s, host_python_s, step_host_s, counters = [], [], [], []
    host = measure.HostCounters(device)
    alone = measure.main_thread_alone() if PIN_CPUS == "main" else contextlib.nullcontext()
    try:
        with alone as main_cpu:
            for _ in range(job.get("timed_steps", TIMED_STEPS)):
                host_issue_s.append(measure.host_issue_s(device))
                host_python_s.append(measure.host_python_s())
                measure.synchronize(cuda)
                host.start()
                t0 = time.perf_counter()
                pending = optimizer_step(record=True, phases=False)
                step_host_s.append(time.perf_counter() - t0)
                measure.synchronize(cuda)
                step_s.append(time.perf_counter() - t0)
                counters.append(host.stop())
                keep_losses(pending)
    finally:
        host.close()
    params = list(engine.module.parameters())
    host_rec.mark("end")
    result = {"outcome": "ok", "losses": losses, "comm": comm, "state": state,
              "step_s": statistics.median(step_s), "step_times_s": step_s, "probe": probe,
              "host_issue_s": host_issue_s, "host_python_s": host_python_s, "main_cpu": main_cpu,
              "step_host_s": step_host_s, "step_counters": counters,
              "memory": rec.summary(), "host_memory": host_rec.summary(),
              # The case study's sharding check: ZeRO-3 gives every parameter ds_id and ds_tensor.
              "param_tensors": len(params), "sharded_param_tensors": sum(hasattr(p, "ds_tensor") for p in params)}
    if hf_seen:
        result.update(hf_spec=hf_seen["recorder"].spec(), z3_leaf_modules=hf_seen["leaves"])
    engine.destroy()   # the engine and model go with this frame; the caller collects garbage
    return result


# Where the running job is (build, initialize, "step 2 micro-step 1 backward"): an out-of-memory
# error's row says where it was raised.
WHERE = {"at": "", "steps": 0}

LEAK_BYTES = 256 * 2**20


def _leaked(device):
    """True when more than LEAK_BYTES are still allocated on any rank between jobs."""
    import deepspeed.comm as dist
    if device.type != "cuda":
        return False
    gc.collect()
    torch.cuda.empty_cache()
    flag = torch.tensor([float(torch.cuda.memory_allocated() > LEAK_BYTES)], device=device)
    dist.all_reduce(flag)
    return bool(flag.item())


def freeze_imports():
    """Take every object alive now (the imported modules) out of the cyclic garbage collector
    (`gc.freeze`), after importing what DeepSpeed would import in the first engine anyway: its ZeRO
    optimizer check imports its Muon optimizer, whose `torch.compile` decorators pull in dynamo and
    inductor (about 200,000 objects, 5 s on a 2-core host, once per process). A full collection between
    jobs, ours and DeepSpeed's own (several per job), then walks only the objects made since: on two
    cores 0.4 s a call became milliseconds, which was most of a small CPU job's time. Every job's engine
    is made after the freeze and collected as before."""
    with contextlib.suppress(ImportError):
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    gc.collect()
    gc.freeze()


def main(jobs_path, out_dir):
    lifeline.watch_runner(out_dir=out_dir)      # nothing outlives the runner
    lifeline.record_build_locks(out_dir)        # so a failed launch removes only its own build locks
    import deepspeed
    import deepspeed.comm as dist
    if FAKE_WORLD:
        _init_fake_world(FAKE_WORLD, FAKE_RANK)
    deepspeed.init_distributed()
    tolerate_unknown_comm_ops()
    freeze_imports()
    rank, world = dist.get_rank(), dist.get_world_size()
    processes = 1 if FAKE_WORLD else world
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    with open(jobs_path) as f:
        jobs = json.load(f)
    jobs = _node_zeros_jobs(jobs, out_dir, device)
    # each node's first rank keeps its runner's files (on one node, rank 0)
    first = local_rank == 0
    for i, job in enumerate(jobs):
        if i and ONE_JOB:
            if first:
                measure.append_line(os.path.join(out_dir, "restart.jsonl"), {"before": job["key"]})
            break
        before = jobs[i - 1] if i else {}
        if i and (_leaked(device) or before.get("path") == "trainer" or (before["stage"] == 3 and before.get("zero_init"))):
            # DeepSpeed 0.19.8 does not free a stage-3 engine (its hooks keep the partitions alive),
            # which would sit under every later job's peak: start a fresh process for the rest. After a
            # Trainer job too: accelerate keeps its state (the DeepSpeed plugin) per process; and after
            # a model built under zero.Init: the next zero.Init build in the process fails (HF Llama:
            # "'LlamaAttention' object has no attribute '_kernel_funcs'", seen on CPU ranks).
            if first:
                measure.append_line(os.path.join(out_dir, "restart.jsonl"), {"before": job["key"]})
            break
        if first:
            measure.append_line(os.path.join(out_dir, "started.jsonl"), {"key": job["key"], "time": time.time()})
        failure = ""
        try:
            if job.get("path") == "trainer":
                from validate import hf_trainer
                result = hf_trainer.run_job(job, device)
            else:
                result = run_job(job, device)
        except torch.cuda.OutOfMemoryError as err:
            result = {"outcome": "oom", "error": f"at {WHERE['at']}: " + str(err).splitlines()[0][:1000],
                      "oom_at": WHERE["at"]}
            failure = traceback.format_exc()
        except Exception as err:  # noqa: BLE001  -- recorded as the job's outcome; the sweep goes on
            result = {"outcome": "error", "error": f"{type(err).__name__}: {err}"[:500]}
            failure = traceback.format_exc()
        result["rank"] = rank
        # A failed rank waits here until every rank is out of the job's collectives (lifeline.arrive)
        lifeline.arrive(out_dir, job["key"], 0 if FAKE_WORLD else rank, processes, result["outcome"], failure)
        if SNAPSHOT_DIR and device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)   # a job that failed while recording
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        results = [None] * processes
        if FAKE_WORLD:
            results[0] = result   # the other ranks do not exist
        else:
            dist.all_gather_object(results, result)
        if first:
            measure.append_line(os.path.join(out_dir, "results.jsonl"),
                                {"key": job["key"], "world_size": world, "ranks": results,
                                 "fake_world": bool(FAKE_WORLD), "env": measure.environment(device)})
    dist.barrier()


def _node_zeros_jobs(jobs: list, out_dir: str, device) -> list:
    """Across nodes (VALIDATE_NODES, the runner's --hostfile): node 0's job list, which every rank then
    runs (another node's runner may resume from a different file), kept in this node's `out_dir` as
    `leader_jobs.json` for its runner; on one node, `jobs` as given."""
    if int(os.environ.get("VALIDATE_NODES") or 1) < 2:
        return jobs
    import torch.distributed as tdist
    box = [jobs]
    tdist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        with open(os.path.join(out_dir, "leader_jobs.json.tmp"), "w") as f:
            json.dump(box[0], f)
        os.replace(os.path.join(out_dir, "leader_jobs.json.tmp"), os.path.join(out_dir, "leader_jobs.json"))
    return box[0]


# VALIDATE_FAKE_WORLD=N: this one process is rank VALIDATE_FAKE_RANK (0 unless set) of a world of N (the
# runner's --fake-world, --fake-rank).
FAKE_WORLD = int(os.environ.get("VALIDATE_FAKE_WORLD") or 0)
FAKE_RANK = int(os.environ.get("VALIDATE_FAKE_RANK") or 0)


def _init_fake_world(world_size: int, rank: int = 0) -> None:
    """torch's fake process group as the default group before DeepSpeed starts (DeepSpeed then takes
    the group as it is): rank `rank` of `world_size`, every collective returns at once without moving
    data. DeepSpeed partitions, buckets and gathers as that rank would, so what it allocates and the
    bytes it logs are the job's; its losses and times are not (docs/validating.md)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    torch.distributed.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)


# protocol: "rank" pins each rank to its share of CPUs; "main" runs each rank's main thread alone on one
# core for its timed steps (measure.main_thread_alone)
PIN_CPUS = os.environ.get("VALIDATE_PIN_CPUS")


def _pin_cpus():
    """With VALIDATE_PIN_CPUS=rank, run this rank on its own 1/LOCAL_SIZE of the CPUs it may use
    and size its OpenMP pool to them, as DeepSpeed's `--bind_cores_to_rank` does (launcher/launch.py:219,
    utils/numa.py), which needs numactl, missing on the GPU image. Called before CUDA, NCCL and OpenMP
    start their threads, which inherit the mask."""
    if PIN_CPUS != "rank":
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // int(os.environ.get("LOCAL_SIZE", 1))   # DeepSpeed's launcher sets LOCAL_SIZE
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    mine = cpus[local_rank * share:(local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


if __name__ == "__main__":
    _pin_cpus()
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    try:
        main(args[0], args[1])
    except Exception:   # the rank's own traceback for the row, then die as before
        lifeline.record_crash(args[1], int(os.environ.get("RANK", 0)), traceback.format_exc())
        raise
