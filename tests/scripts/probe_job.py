"""Runs under DeepSpeed's launcher on CPU ranks for tests/test_probe.py: each job of
validate/matrices/cpu-probe.json trained as a user writes it (a tiny Qwen2: a plain engine loop, or
HF Trainer with the docs' "auto" ds_config; PEFT LoRA where the job has it) with the probe attached at
step 3 and its row in OUT_DIR/<name>.csv; a model of one's own (no HF config, a frozen layer, a
buffer; stage 1, gradient accumulation 2); then a plain loop with the probe off, and one whose probe
raises inside on one rank. Each rank appends one JSON line per run to OUT_DIR/ranks.jsonl: the steps
taken, the losses, the probe's lines on stderr, the calls into zerocalc.probe (the run with it off),
and whether the engine and the comms logger were left as they were.

python -m deepspeed.launcher.runner --num_gpus 2 tests/scripts/probe_job.py OUT_DIR"""
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STEPS = 5          # optimizer steps per run: the probe measures 3 and times 4


class Lines:
    """stderr, with the probe's lines kept."""

    def __init__(self, inner):
        self.inner, self.probe_lines = inner, []

    def write(self, text):
        self.probe_lines += [ln for ln in text.splitlines() if ln.startswith("zerocalc.probe")]
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build(job):
    from validate import hf_models
    model = hf_models.build(job["hf"]["config"], job["dtype"], False, job["attention"])
    if job.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**job["lora"]))
    return model


def batches(job, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, job["arch"]["vocab_size"], (STEPS * job["gas"], job["micro_batch"], job["seq_len"]),
                         generator=gen)


def loop(job, rank, out, probe="on", counted=None):
    """A plain engine loop: deepspeed.initialize with the ds_config the validator's worker gives this job
    (its comms logger left out: a user's config has none), then the probe, then STEPS steps."""
    import deepspeed
    from deepspeed.comm.comm import comms_logger

    import zerocalc.probe
    from validate.jobs import to_worker
    from validate.worker import ds_config
    cfg = {k: v for k, v in ds_config(to_worker(job)).items() if k != "comms_logger"}
    model = build(job)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    p = zerocalc.probe.attach(engine, step=None if probe == "off" else 3, out=out)
    losses = []
    if counted is not None:
        sys.setprofile(counted)
    for ids in batches(job, rank):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    sys.setprofile(None)
    if p is not None:
        p.close()
    left = {"wrapped": sorted(n for n in ("forward", "backward", "step") if n in vars(engine)),
            "logger_on": bool(comms_logger.enabled), "steps": engine.global_steps, "losses": losses}
    engine.destroy()
    return left


class Own(torch.nn.Module):
    """A model of one's own: no HF config; an embedding, two linears (the first frozen), a buffer."""

    def __init__(self, vocab=500, hidden=48):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("scale", torch.full((hidden,), 0.5))
        self.mix.requires_grad_(False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        logits = self.head(torch.relu(self.mix(h * self.scale.to(h.dtype))))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def own(rank, out):
    """The model of one's own in a plain loop: stage 1, bf16, micro-batch 2 x 12, gradient accumulation 2."""
    import deepspeed

    import zerocalc.probe
    torch.manual_seed(0)
    model = Own()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    p = zerocalc.probe.attach(engine, step=3, out=out)
    gen, losses = torch.Generator().manual_seed(7 + rank), []
    for _ in range(STEPS * 2):
        ids = torch.randint(0, 500, (2, 12), generator=gen)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    p.close()
    left = {"wrapped": sorted(n for n in ("forward", "backward", "step") if n in vars(engine)),
            "steps": engine.global_steps, "losses": losses}
    engine.destroy()
    return left


def trainer(job, rank, out):
    """HF Trainer with the docs' "auto" ds_config and ZeroCalcCallback(step=3)."""
    from transformers import Trainer, TrainingArguments

    import zerocalc.probe
    from validate import hf_models
    from validate.hf_trainer import RandomTokens
    ds = hf_models.load_ds_config(job["ds_config"])
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="probe-trainer-"), deepspeed=ds,
                             per_device_train_batch_size=job["micro_batch"], max_steps=STEPS, learning_rate=1e-4,
                             bf16=job["dtype"] == "bf16", save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_steps=1, use_cpu=True)     # before the model: zero.Init at stage 3
    model = build(job)
    data = RandomTokens(job["arch"]["vocab_size"], job["seq_len"], STEPS * job["micro_batch"], 1234 + rank)
    cb = zerocalc.probe.ZeroCalcCallback(step=3, out=out)
    t = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    t.train()
    engine = t.model_wrapped
    left = {"wrapped": sorted(n for n in ("forward", "backward", "step") if n in vars(engine)),
            "steps": engine.global_steps, "losses": [h["loss"] for h in t.state.log_history if "loss" in h]}
    engine.destroy()
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=False)   # the next Trainer gets its own plugin
    return left


def counter():
    """A profile function counting calls into zerocalc.probe's code."""
    probe_dir = os.path.join(ROOT, "zerocalc", "probe")
    calls = [0]

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(probe_dir):
            calls[0] += 1
    count.calls = calls
    return count


def main(out_dir):
    import deepspeed
    import deepspeed.comm as dist

    from validate.jobs import load_matrix
    deepspeed.init_distributed()
    rank = dist.get_rank()
    jobs = load_matrix(os.path.join(ROOT, "validate", "matrices", "cpu-probe.json"))
    names = {(j.get("path"), j["stage"], bool(j.get("lora"))) for j in jobs}
    assert len(names) == 4, names
    lines = sys.stderr = Lines(sys.stderr)
    runs = []
    for job in sorted(jobs, key=lambda j: j.get("path") == "trainer"):
        name = f"{job['path']}-s{job['stage']}{'-lora' if job.get('lora') else ''}"
        runs.append((name, job, "on"))
    plain = next(j for j in jobs if j["path"] == "engine" and j["stage"] == 2)
    runs.insert(1, ("off", plain, "off"))
    runs.insert(2, ("raises", plain, "raises"))
    runs.insert(3, ("own-s1", {"key": "own"}, "own"))
    for name, job, probe in runs:
        before = len(lines.probe_lines)
        out = os.path.join(out_dir, f"{name}.csv")
        count = counter() if probe == "off" else None
        if probe == "raises":
            left = _raising(job, rank, out)
        elif probe == "own":
            left = own(rank, out)
        elif job["path"] == "trainer":
            left = trainer(job, rank, out)
        else:
            left = loop(job, rank, out, probe, count)
        record = {"name": name, "rank": rank, "key": job["key"], "probe_lines": lines.probe_lines[before:], **left}
        if count is not None:
            record["probe_calls"] = count.calls[0]
        with open(os.path.join(out_dir, "ranks.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()


def _raising(job, rank, out):
    """The plain loop with the probe's state walk raising on rank 1 only: rank 0 goes on measuring."""
    from zerocalc.probe import measure
    real = measure.resident_state

    def broken(engine):
        if rank == 1:
            raise RuntimeError("an injected failure")
        return real(engine)
    measure.resident_state = broken
    try:
        return loop(job, rank, out)
    finally:
        measure.resident_state = real


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
