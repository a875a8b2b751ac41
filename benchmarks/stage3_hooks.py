"""What DeepSpeed's stage-3 fetch/release hooks cost the host per module step, by model type: each HF
config shrunk to tiny widths (its layers, modules and parameters as published), one rank on this
machine's CPU, checkpointed, the forward and backward of stage 3 (built under zero.Init) less those of
stage 0, over zerocalc's module steps (`ModelSpec.trace`, `backward(True)`): the count the step time
charges `time.module_hook_s` for. Prints ms per module step and its spread over the types; no thresholds.

    python benchmarks/stage3_hooks.py [CONFIG:LAYERS ...]   (validate/hf_configs names)
"""
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TYPES = ("phi-2:10", "smollm3-3b:12", "starcoder2-3b:10", "olmoe-1b-7b:4", "granite-3.0-2b:12", "falcon-rw-1b:24",
         "qwen2.5-0.5b:24", "gemma-3-1b:26")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 512}
TOKENS, STEPS, WARMUP = 32, 12, 4


def tiny(name: str, layers: int) -> dict:
    from validate import hf_models
    _, cfg = hf_models.load_config(name)
    over = {**TINY, "num_hidden_layers": layers}
    if "num_key_value_heads" in cfg:
        over["num_key_value_heads"] = 2 if cfg["num_key_value_heads"] < cfg["num_attention_heads"] else 4
    if "head_dim" in cfg:
        over["head_dim"] = 16
    if "moe_intermediate_size" in cfg:
        over["moe_intermediate_size"] = 32
    over.update({k: 0 for k in ("pad_token_id", "bos_token_id", "eos_token_id") if isinstance(cfg.get(k), int)})
    return hf_models.load_config(name, over)[1]


def phases_s(cfg: dict, stage: int) -> tuple[float, float]:
    """Median forward (with the loss) and backward seconds of a checkpointed step, after WARMUP steps."""
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig
    from validate import hf_models
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    keep = HfDeepSpeedConfig(ds) if stage == 3 else None   # noqa: F841 (alive while the model is built)
    model = hf_models.build(cfg, "fp32", checkpointing=True)
    if stage == 3:
        hf_models.set_moe_leaves(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    ids = torch.randint(0, TINY["vocab_size"], (1, TOKENS + 1))
    forward, backward = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        logits = engine(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, TINY["vocab_size"]), ids[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        if i >= WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return statistics.median(forward), statistics.median(backward)


def module_steps(cfg: dict) -> tuple[int, int]:
    from validate import hf_models
    from validate.jobs import make_hf_job
    job = make_hf_job({"config": cfg}, 1, stage=3, micro_batch=1, seq_len=TOKENS, activation_checkpointing=True)
    spec = hf_models.traced_spec(job)
    return len(spec.trace), len(spec.backward(True))


def main():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    try:
        import deepspeed
        import torch
    except ImportError:
        print("DeepSpeed is not installed: pip install -e '.[validate]' to measure")
        return
    import logging
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    per = []
    print(f"{'model':16} {'modules fwd/bwd':>16} {'forward ms':>12} {'backward ms':>12} {'ms per module step':>20}")
    for item in sys.argv[1:] or TYPES:
        name, layers = item.split(":")
        cfg = tiny(name, int(layers))
        (f0, b0), (f3, b3) = phases_s(cfg, 0), phases_s(cfg, 3)
        mf, mb = module_steps(cfg)
        per += [(f3 - f0) / mf, (b3 - b0) / mb]
        print(f"{name:16} {mf:>7}/{mb:<8} {1e3 * (f3 - f0):>12.1f} {1e3 * (b3 - b0):>12.1f} "
              f"{1e3 * (f3 - f0) / mf:>9.3f} / {1e3 * (b3 - b0) / mb:.3f}", flush=True)
    print(f"per module step over the types: median {1e3 * statistics.median(per):.3f} ms, "
          f"{1e3 * min(per):.3f}-{1e3 * max(per):.3f} (max/min {max(per) / min(per):.2f})")


if __name__ == "__main__":
    main()
