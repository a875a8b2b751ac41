"""What the probe (zerocalc.probe) costs a job on a GPU: the same job in one process without the probe
and with it attached at --probe-step (--repeats runs of each, alternating which goes first), for a
plain engine loop and for HF Trainer, each without and with PEFT LoRA. Every optimizer step is timed
between two synchronizes, the same harness for both arms. Printed per variant: the median step time
without and with the probe over the steps outside the probe's two (its measured step synchronizes at
each phase boundary with the comms logger on; its timed step is plain), their ratio, the probe's two
steps, and the runs' total time (with the probe's one-off work after its timed step: the gather, and
on rank 0 the prediction and the row). Written to --out as JSON. `--arm with|without` runs one arm
only, so that every run has a process of its own (validate/gpu/probe_overhead.sh); `--combine` pools
such files. Under DeepSpeed's launcher:

    python -m deepspeed.launcher.runner --num_gpus 1 validate/gpu/probe_demo.py --config qwen2.5-0.5b \\
        --layers 8 --stage 2 --micro-batch 4 --seq-len 1024 --steps 40 --probe-step 10 --out probe-demo.json

On the H200 machine, source validate/gpu/setup.sh first (DeepSpeed and PEFT from .whl)."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


def sync():
    """Wait for the device (nothing to wait for on a CPU smoke run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args, lora: bool):
    from validate import hf_models
    _, cfg = hf_models.load_config(args.config, {"num_hidden_layers": args.layers} if args.layers else None)
    model = hf_models.build(cfg, "bf16", args.checkpointing)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def ds_config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "zero_optimization": {"stage": args.stage}}


def batches(args, vocab: int, rank: int):
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, vocab, (args.steps, args.micro_batch, args.seq_len), generator=gen)


def loop(args, lora: bool, probe: bool, out_csv: str) -> list[float]:
    """A plain engine loop; each optimizer step's seconds."""
    import deepspeed

    import zerocalc.probe
    model = build(args, lora)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config(args))
    if probe:
        zerocalc.probe.attach(engine, step=args.probe_step, out=out_csv)
    times = []
    for ids in batches(args, model.config.vocab_size, int(os.environ.get("RANK", 0))):
        ids = ids.to(engine.device)
        sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    engine.destroy()
    return times


def trainer(args, lora: bool, probe: bool, out_csv: str) -> list[float]:
    """HF Trainer with the same ds_config; each optimizer step's seconds, on_step_begin to on_step_end."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import zerocalc.probe
    from validate.hf_trainer import RandomTokens

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *a, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync()
            self.times.append(time.perf_counter() - self.t0)

    targs = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="probe-demo-"), deepspeed=ds_config(args),
                              per_device_train_batch_size=args.micro_batch, max_steps=args.steps, bf16=True,
                              learning_rate=1e-5, save_strategy="no", report_to=[], disable_tqdm=True,
                              logging_steps=10**6, gradient_checkpointing=args.checkpointing,
                              gradient_checkpointing_kwargs={"use_reentrant": False},
                              use_cpu=not torch.cuda.is_available())
    model = build(args, lora)
    clock = Clock()
    data = RandomTokens(model.config.vocab_size, args.seq_len, args.steps * args.micro_batch,
                        1234 + int(os.environ.get("RANK", 0)))
    callbacks = [clock] + ([zerocalc.probe.ZeroCalcCallback(step=args.probe_step, out=out_csv)] if probe else [])
    t = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    t.train()
    t.model_wrapped.destroy()
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=False)
    return clock.times


def summary(without: list[list[float]], with_probe: list[list[float]], probe_step: int, warmup: int) -> dict:
    """Over every run of each arm: the median step outside the probe's two steps (and the warm-up), the
    ratio of the medians, the probe's own two steps (median over runs), the runs' total times. Also each
    run's steps after the probe's two over its steps before them (median over runs): with over without
    is what the probe leaves behind, free of how fast a run happens to be from its start."""
    window = {probe_step - 1, probe_step}          # 0-based indices of optimizer steps probe_step, probe_step + 1

    def outside(runs):
        return [t for run in runs for i, t in enumerate(run) if i >= warmup and i not in window]

    def after_over_before(runs):
        return statistics.median(statistics.median(r[probe_step + 1:]) / statistics.median(r[warmup:probe_step - 1])
                                 for r in runs)
    off, on = statistics.median(outside(without)), statistics.median(outside(with_probe))
    return {"runs": [len(without), len(with_probe)], "steps_compared": len(outside(with_probe)),
            "median_without_s": off, "median_with_s": on, "ratio": on / off,
            "after_over_before_ratio": after_over_before(with_probe) / after_over_before(without),
            "probe_measured_step_s": statistics.median(r[probe_step - 1] for r in with_probe),
            "probe_timed_step_s": statistics.median(r[probe_step] for r in with_probe),
            "total_without_s": sum(sum(r[warmup:]) for r in without),
            "total_with_s": sum(sum(r[warmup:]) for r in with_probe), "without_s": without, "with_s": with_probe}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen2.5-0.5b", help="a name under validate/hf_configs/ or a config.json")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--probe-step", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating which goes first")
    p.add_argument("--variants", default="loop,loop-lora,trainer,trainer-lora")
    p.add_argument("--arm", choices=("both", "without", "with"), default="both",
                   help="run one arm only (once per variant; a fresh process per run, combined with --combine)")
    p.add_argument("--combine", nargs="+", metavar="JSON", help="pool the runs of earlier --out files and summarise")
    p.add_argument("--out", default="probe-demo.json")
    args = p.parse_args([a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    if args.combine:
        return combine(args)
    import deepspeed
    deepspeed.init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = int(os.environ.get("RANK", 0))
    rows_csv = os.path.splitext(args.out)[0] + "-rows.csv"
    results = {}
    for variant in args.variants.split(","):
        run = trainer if variant.startswith("trainer") else loop
        lora = variant.endswith("lora")
        times = {False: [], True: []}
        if args.arm != "both":
            times[args.arm == "with"].append(run(args, lora, args.arm == "with", rows_csv))
            results[variant] = {"without_s": times[False], "with_s": times[True]}
        else:
            for r in range(args.repeats):
                for probe in ((False, True) if r % 2 == 0 else (True, False)):
                    times[probe].append(run(args, lora, probe, rows_csv))
            results[variant] = summary(times[False], times[True], args.probe_step, args.warmup)
        if rank == 0:
            _write(args, results)        # after each variant: a call cut short keeps what ran
    if rank == 0 and args.arm == "both":
        _print(results)
        print(f"written: {args.out}, the probe's rows: {rows_csv}")


def combine(args):
    """Pool the runs of --arm files (and whole ones) per variant, summarise, print, write --out."""
    runs, first = {}, None
    for path in args.combine:
        with open(path) as f:
            done = json.load(f)
        first = first or done
        for variant, r in done["results"].items():
            pooled = runs.setdefault(variant, {"without_s": [], "with_s": []})
            pooled["without_s"] += r["without_s"]
            pooled["with_s"] += r["with_s"]
    kept = first["args"]
    results = {v: summary(r["without_s"], r["with_s"], kept["probe_step"], kept["warmup"])
               for v, r in runs.items() if r["without_s"] and r["with_s"]}
    with open(args.out, "w") as f:
        json.dump({"args": kept, "combined": args.combine, "gpu": first["gpu"], "results": results}, f, indent=1)
    _print(results)


def _print(results: dict):
    print(f"{'variant':<14} {'runs':>5} {'steps':>5} {'no probe ms':>11} {'probe ms':>9} {'ratio':>7} {'after/before':>12} "
          f"{'measured step ms':>16} {'timed step ms':>13} {'total ratio':>11}")
    for variant, r in results.items():
        print(f"{variant:<14} {'/'.join(map(str, r['runs'])):>5} {r['steps_compared']:>5} "
              f"{r['median_without_s'] * 1e3:>11.2f} {r['median_with_s'] * 1e3:>9.2f} {r['ratio']:>7.4f} "
              f"{r['after_over_before_ratio']:>12.4f} {r['probe_measured_step_s'] * 1e3:>16.2f} "
              f"{r['probe_timed_step_s'] * 1e3:>13.2f} {r['total_with_s'] / r['total_without_s']:>11.4f}")


def _write(args, results: dict):
    with open(args.out, "w") as f:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        json.dump({"args": vars(args), "gpu": gpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
