"""The Trainer path: one job trains an HF model through `transformers.Trainer` with the HF docs' "auto"
ds_config (validate/hf_configs/ds/), the way most users run DeepSpeed, and measures what the direct
path measures, at the points a TrainerCallback sees: the engine is built inside `train()` before
`on_train_begin`; each optimizer step runs between `on_step_begin` and `on_step_end`.

What differs from the direct path (validate/worker.py), all as a Trainer user gets it: TrainingArguments
exist before the model, so at stage 3 `from_config` builds under zero.Init (HfDeepSpeedConfig); the loss
is the model's own (labels given, shifted inside); gradient clipping at max_grad_norm 1.0 ("auto");
the docs' WarmupLR with warmup_steps 1 (DeepSpeed 0.19.8 refuses 0, which transformers < 5.24 passes);
Trainer's logging every step. The ds_config gets the comms logger added (measurement only: it is off
but for one step). Step times are whole optimizer steps, synchronized at both ends.
With VALIDATE_SNAPSHOT_DIR set, rank 0's allocator history is recorded as the direct path records it
(`worker._memory_history`): VALIDATE_SNAPSHOT_SCOPE=warmup from before the model is built to the end
of the warm-up steps, =step over the comm-logged step. With VALIDATE_PROFILE_DIR set, one more step after
the timed ones is profiled on rank 0 (`worker._profiled`: DIR/KEY.txt), as the direct path profiles one,
and is not timed.

Where a Trainer step's time goes (`TrainerClock`): after the comm-logged step, PHASE_STEPS steps
synchronize before and after each call the Trainer makes into the model and the engine (its loss
path, `compute_loss`: the forward and the model's own loss; the engine's backward and step; the
gradient norm it reads back; the scheduler; zero_grad), so each part's device time is its own; the
timed steps then record the same calls' host time, unsynchronized, beside the whole step. What is
left of a step outside those calls is the Trainer's own loop (inputs to the device, `model.train()`,
the loss's NaN check, FLOPs and token counting, callbacks); what runs between a step's end and the
next one's start (logging, the next batch) is kept apart, as `between`."""
import contextlib
import shutil
import statistics
import tempfile
import time

import torch

from validate import hf_models, measure
from validate.worker import PHASE_STEPS, PROFILE_DIR, TIMED_STEPS, WARMUP_STEPS, _memory_history, _profiled

COMMS_LOGGER = {"enabled": True, "prof_all": True, "verbose": False, "debug": True}


class RandomTokens(torch.utils.data.Dataset):
    """`n` samples of random token ids, labels = input_ids (the model shifts them), one generator per rank."""

    def __init__(self, vocab: int, seq_len: int, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TrainerClock:
    """Seconds spent in each call the Trainer makes per step (`wrap`), per step: with `sync` on, a
    synchronize before and after each call (its device time too); off, host time only."""

    def __init__(self, cuda):
        self.cuda, self.sync, self.now, self.depth = cuda, False, None, 0
        self.phased, self.timed = [], []

    def start(self, sync: bool):
        self.sync, self.now = sync, {}
        (self.phased if sync else self.timed).append(self.now)

    def stop(self):
        self.now = None

    def add(self, label: str, seconds: float):
        if self.now is not None:
            self.now[label] = self.now.get(label, 0.0) + seconds

    def wrap(self, obj, name: str, label: str):
        """Time obj.name under `label` from now on (an instance attribute shadowing the method)."""
        inner = getattr(obj, name)

        def timed(*a, **kw):
            if self.now is None or self.depth:   # a call inside a timed one (engine.step's zero_grad) is its
                return inner(*a, **kw)           # caller's
            if self.sync:
                measure.synchronize(self.cuda)
            t0 = time.perf_counter()
            self.depth += 1
            try:
                out = inner(*a, **kw)
            finally:
                self.depth -= 1
            if self.sync:
                measure.synchronize(self.cuda)
            self.add(label, time.perf_counter() - t0)
            return out
        setattr(obj, name, timed)

    @staticmethod
    def by_label(steps: list[dict]) -> dict:
        """{label: [seconds per step]} over steps (None where a step has no such time: the last has no
        `between`; a step without the call, 0)."""
        labels = sorted({k for s in steps for k in s})
        return {k: [round(s[k], 6) if k in s else (None if k == "between" else 0.0) for s in steps] for k in labels}


def _callback_class():
    from transformers import TrainerCallback

    class Measure(TrainerCallback):
        """Peaks per phase (init; the warm-up steps as first_step; the rest as step), one comm-logged
        steady-state step with the resident state read after it, PHASE_STEPS steps with every call
        Trainer makes synchronized (`TrainerClock`), then whole steps timed, each after a launch probe,
        with the same calls' host time; with VALIDATE_PROFILE_DIR, one more step profiled (`profile_step`)."""

        def __init__(self, rec, cuda, device, key="", history=None, profile_step=None):
            self.rec, self.cuda, self.device, self.trainer, self.key = rec, cuda, device, None, key
            self.history = history or contextlib.ExitStack()     # the warm-up's, open; closed here
            self.profile_step, self.profile = profile_step, contextlib.ExitStack()
            self.comm = self.state = None
            self.step_s, self.losses, self._t0 = [], [], None
            self.clock, self.host_issue_s, self._t_end = TrainerClock(cuda), [], None

        def on_train_begin(self, args, state, control, **kw):
            from deepspeed.comm.comm import comms_logger
            comms_logger.enabled = False
            self.rec.phase("init")
            t, engine, clock = self.trainer, self.trainer.model_wrapped, self.clock
            for obj, name, label in ((t, "compute_loss", "loss"), (engine, "backward", "backward"),
                                     (engine, "step", "step"), (t, "_clip_grad_norm", "grad_norm"),
                                     (t, "_get_grad_norm", "grad_norm"), (engine, "zero_grad", "zero_grad"),
                                     (t, "_maybe_log_save_evaluate", "log")):
                clock.wrap(obj, name, label)
            if t.lr_scheduler is not None:
                clock.wrap(t.lr_scheduler, "step", "scheduler")

        def on_step_begin(self, args, state, control, **kw):
            from deepspeed.comm.comm import comms_logger
            step = state.global_step               # the step beginning, from 0
            if self._t_end is not None:            # logging and the next batch, after the last step
                self.clock.add("between", time.perf_counter() - self._t_end)
            self.clock.stop()
            if step == self.profile_step:          # profiled, not timed
                self._t_end = None
                self.profile.enter_context(_profiled(self.key, self.cuda))
                self.rec.mark()
                return
            if step == WARMUP_STEPS:
                comms_logger.reset_data()
                comms_logger.enabled = True
                self.history.enter_context(_memory_history(self.key, self.cuda, "step"))
            elif step > WARMUP_STEPS + PHASE_STEPS:
                self.host_issue_s.append(measure.host_issue_s(self.device))
            if step > WARMUP_STEPS:
                self.clock.start(sync=step <= WARMUP_STEPS + PHASE_STEPS)
            self.rec.mark()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            import deepspeed.comm as dist
            from deepspeed.comm.comm import comms_logger
            measure.synchronize(self.cuda)
            seconds = time.perf_counter() - self._t0
            done = state.global_step - 1           # the step that just ended, from 0
            self.rec.phase("step", record=done >= WARMUP_STEPS)
            if done == self.profile_step:
                self.profile.close()
                return
            if done in (WARMUP_STEPS - 1, WARMUP_STEPS):
                self.history.close()                 # the warm-up's history, then the comm-logged step's
            if done == WARMUP_STEPS:
                comms_logger.enabled = False
                self.comm = measure.comm_summary(dist.log_summary(return_dict=True))
                self.state = measure.resident_state(self.trainer.model_wrapped)
            elif done > WARMUP_STEPS + PHASE_STEPS:
                self.step_s.append(seconds)
            if self.clock.now is not None:
                self.clock.add("whole", seconds)
            self._t_end = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return Measure


def steps(job: dict) -> int:
    """Optimizer steps of a Trainer job: the warm-up, the comm-logged one, the phased, the timed, and with
    VALIDATE_PROFILE_DIR the profiled one."""
    return WARMUP_STEPS + 1 + PHASE_STEPS + job.get("timed_steps", TIMED_STEPS) + (1 if PROFILE_DIR else 0)


def training_arguments(job: dict, ds: dict, output_dir: str, cuda: bool):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=output_dir, deepspeed=ds, per_device_train_batch_size=job["micro_batch"],
        gradient_accumulation_steps=job["gas"], max_steps=steps(job),
        warmup_steps=1, learning_rate=1e-4, bf16=job["dtype"] == "bf16", fp16=job["dtype"] == "fp16",
        gradient_checkpointing=job["activation_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=job.get("seed", 0),
        use_cpu=not cuda)


def run_job(job: dict, device) -> dict:
    import deepspeed.comm as dist
    from transformers import Trainer
    from transformers.integrations import unset_hf_deepspeed_config

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{bool(job.get('expandable_segments'))}")
    rec = measure.MemoryRecorder(cuda)
    rec.start()
    torch.manual_seed(job.get("seed", 0))
    ds = {**hf_models.load_ds_config(job["ds_config"]), "comms_logger": COMMS_LOGGER}
    out_dir = tempfile.mkdtemp(prefix="zerocalc-trainer-")
    history = contextlib.ExitStack()
    history.enter_context(_memory_history(job["key"], cuda, "warmup"))
    try:
        args = training_arguments(job, ds, out_dir, cuda)     # before the model: zero.Init at stage 3
        model = hf_models.build(job["hf"]["config"], job["dtype"], False, job["attention"])
        model = hf_models.apply_adapters(model, job)   # LoRA (PEFT) and frozen modules, where the job has them
        leaves = hf_models.set_moe_leaves(model) if job["stage"] == 3 else []
        recorder = hf_models.SpecRecorder(model)
        n = steps(job) * job["micro_batch"] * job["gas"]
        data = RandomTokens(job["arch"]["vocab_size"], job["seq_len"], n, 1234 + dist.get_rank())
        cb = _callback_class()(rec, cuda, device, job["key"], history, steps(job) - 1 if PROFILE_DIR else None)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        cb.trainer = trainer
        trainer.train()
        engine = trainer.model_wrapped
        params = list(engine.module.parameters())
        resolved = dict(engine.config) if isinstance(getattr(engine, "config", None), dict) else \
            trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
        result = {"outcome": "ok", "losses": cb.losses, "comm": cb.comm, "state": cb.state,
                  "step_s": statistics.median(cb.step_s), "step_times_s": cb.step_s,
                  "trainer_phased_s": TrainerClock.by_label(cb.clock.phased),
                  "trainer_host_s": TrainerClock.by_label(cb.clock.timed),
                  "host_issue_s": cb.host_issue_s if cuda else [],
                  "probe": measure.probe_machine(device), "memory": rec.summary(),
                  "param_tensors": len(params), "sharded_param_tensors": sum(hasattr(p, "ds_tensor") for p in params),
                  "hf_spec": recorder.spec(), "z3_leaf_modules": leaves,
                  "resolved_ds_config": {k: v for k, v in resolved.items() if k != "comms_logger"}}
        engine.destroy()
        return result
    finally:
        history.close()
        unset_hf_deepspeed_config()
        shutil.rmtree(out_dir, ignore_errors=True)
