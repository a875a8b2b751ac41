"""One job of a validator matrix trained as a user writes it, on a GPU, with zerocalc.probe attached at
step 3: a plain engine loop (the ds_config the validator's worker would give the job, without its
comms logger) or HF Trainer with the job's ds_config file and ZeroCalcCallback; PEFT LoRA where the
job has it. The probe's row goes to OUT_DIR/<job key>.csv, for `validate/gpu/probe_vs_worker.py` to
set beside `validate run`'s row of the same job. One job per launch, so no earlier engine's memory is
counted (data/probe-demo/: later runs in one process were 21-30% off for that reason).

    python -m deepspeed.launcher.runner --num_gpus 1 validate/gpu/probe_rows.py MATRIX INDEX OUT_DIR

On the H200 machine, source validate/gpu/setup.sh first (DeepSpeed and PEFT from .whl)."""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS = 5          # optimizer steps: the probe measures step 3 and times step 4


def build(job):
    from validate import hf_models
    model = hf_models.build(job["hf"]["config"], job["dtype"], job["activation_checkpointing"], job["attention"])
    if job.get("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**job["lora"]))
    return model


def batches(job, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, job["arch"]["vocab_size"], (STEPS * job["gas"], job["micro_batch"], job["seq_len"]),
                         generator=gen)


def loop(job, out):
    import deepspeed

    import zerocalc.probe
    from validate.jobs import to_worker
    from validate.worker import ds_config
    from transformers.integrations import HfDeepSpeedConfig
    cfg = {k: v for k, v in ds_config(to_worker(job)).items() if k != "comms_logger"}
    keep = HfDeepSpeedConfig(cfg) if job["stage"] == 3 and job["zero_init"] else None   # zero.Init, as HF does
    model = build(job)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    del keep
    zerocalc.probe.attach(engine, step=3, out=out)
    for ids in batches(job, engine.global_rank):
        ids = ids.to(engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def trainer(job, out):
    from transformers import Trainer, TrainingArguments

    import zerocalc.probe
    from validate import hf_models
    from validate.hf_trainer import RandomTokens
    ds = hf_models.load_ds_config(job["ds_config"])
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="probe-rows-"), deepspeed=ds,
                             per_device_train_batch_size=job["micro_batch"], max_steps=STEPS, learning_rate=1e-5,
                             warmup_steps=1,      # as the worker: DeepSpeed 0.19.8 refuses the 0 of transformers < 5.24
                             bf16=job["dtype"] == "bf16", save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_steps=1, gradient_checkpointing=job["activation_checkpointing"],
                             gradient_checkpointing_kwargs={"use_reentrant": False},
                             use_cpu=not torch.cuda.is_available())     # before the model: zero.Init
    model = build(job)
    data = RandomTokens(job["arch"]["vocab_size"], job["seq_len"], STEPS * job["micro_batch"],
                        1234 + int(os.environ.get("RANK", 0)))
    Trainer(model=model, args=args, train_dataset=data,
            callbacks=[zerocalc.probe.ZeroCalcCallback(step=3, out=out)]).train()


def main(matrix, index, out_dir):
    import deepspeed

    from validate.jobs import load_matrix
    deepspeed.init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    job = load_matrix(matrix)[int(index)]
    out = os.path.join(out_dir, f"{job['key']}.csv")
    (trainer if job.get("path") == "trainer" else loop)(job, out)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
