"""Writes the H200 LoRA matrices (validate/matrices/h200-lora-*.json) and prints zerocalc's predicted
peak reserved per job and per matrix (the room to give each in validate/gpu/pack.py).

    python validate/matrices/make_lora.py [--peaks]

PEFT 0.21 LoRA on HF configs, alpha 2r: ranks 8-256, all-linear and attention-only targets, stages 0-3,
checkpointing on and off, a 2-layer Mixtral (attention targets: PEFT wraps fused experts under
all-linear, which zerocalc refuses), a frozen-embeddings full fine-tune, DoRA at stage 2, HF Trainer
with the docs' "auto" ds_configs, rank 0 of 8 in a fake world. 1-2B shapes outside zero.Init (a 7B
build outside it takes over 100 s of CPU), Qwen2.5-7B at stage 3 under zero.Init (the issue's rows)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
LLAMA_1B = "zerocalc/hf/configs/llama-3.2-1b.json"


def lora(r, targets="all-linear", **kw):
    return {"r": r, "lora_alpha": 2 * r, "target_modules": targets, **kw}


MATRICES = {
    "h200-lora-a": {
        "nproc": 1,
        "about": "Qwen2.5-1.5B, LoRA alpha 2r, stages 0-3 x r 8/64 x all-linear/attention, checkpointed, 2 x 2048",
        "hf_models": [{"config": "qwen2.5-1.5b"}],
        "hf_axes": {"stage": [0, 1, 2, 3], "activation_checkpointing": [True], "seq_len": [2048], "micro_batch": [2],
                    "timed_steps": [3], "lora": [lora(8), lora(64, ATTN)]}},
    "h200-lora-b": {
        "nproc": 1,
        "about": "Llama-3.2-1B (the issue's rows), LoRA all-linear, stages 2/3, checkpointing on and off, r 16/256, "
                 "dropout 0.05 (x@A's dropout copy kept)",
        "hf_models": [{"config": LLAMA_1B}],
        "hf_axes": [{"stage": [2, 3], "activation_checkpointing": [False], "seq_len": [2048], "micro_batch": [2],
                     "timed_steps": [3], "lora": [lora(16, lora_dropout=0.05), lora(256)]},
                    {"stage": [2, 3], "activation_checkpointing": [True], "seq_len": [2048], "micro_batch": [4],
                     "timed_steps": [3], "lora": [lora(16), lora(128, ATTN)]}]},
    "h200-lora-c": {
        "nproc": 1,
        "about": "Qwen2.5-7B at stage 3 under zero.Init, checkpointed, 2 x 2048 (the issue's 23.7 GiB row) and r 64; "
                 "through HF Trainer (zero3-auto) too",
        "hf_models": [{"config": "qwen2.5-7b"}],
        "hf_axes": [{"stage": [3], "activation_checkpointing": [True], "seq_len": [2048], "micro_batch": [2],
                     "timed_steps": [2], "lora": [lora(16), lora(64)]},
                    {"path": ["trainer"], "ds_config": ["zero3-auto"], "activation_checkpointing": [True],
                     "seq_len": [2048], "micro_batch": [2], "timed_steps": [2], "lora": [lora(16)]}]},
    "h200-lora-d": {
        "nproc": 1,
        "about": "HF Trainer with the docs' zero2/zero3 auto configs, Qwen3-1.7B, LoRA r 32 all-linear and r 128 "
                 "attention, checkpointing on and off",
        "hf_models": [{"config": "qwen3-1.7b"}],
        "hf_axes": {"path": ["trainer"], "ds_config": ["zero2-auto", "zero3-auto"], "activation_checkpointing": [True, False],
                    "seq_len": [1024], "micro_batch": [2], "timed_steps": [3], "lora": [lora(32)]}},
    "h200-lora-e": {
        "nproc": 1,
        "about": "A 2-layer Mixtral-8x7B with 4 experts (MoE leaves at stage 3), LoRA on attention (r 16, 128); "
                 "a frozen-embeddings full fine-tune of Qwen2.5-0.5B at stages 0-3; DoRA r 8 on Qwen2.5-0.5B, stage 2",
        "hf_models": [],
        "jobs": [
            *({"hf": {"config": "mixtral-8x7b", "overrides": {"num_hidden_layers": 2, "num_local_experts": 4}},
               "stage": s, "activation_checkpointing": ck, "seq_len": 2048, "micro_batch": 2, "timed_steps": 3,
               "lora": lora(r, ATTN)} for s, ck, r in ((2, True, 16), (3, True, 16), (3, False, 128), (0, False, 128))),
            *({"hf": {"config": "qwen2.5-0.5b"}, "stage": s, "activation_checkpointing": False, "seq_len": 2048,
               "micro_batch": 4, "timed_steps": 3, "freeze": ["embed_tokens"]} for s in (0, 1, 2, 3)),
            {"hf": {"config": "qwen2.5-0.5b"}, "stage": 2, "activation_checkpointing": True, "seq_len": 2048,
             "micro_batch": 4, "timed_steps": 3, "lora": lora(8, ["q_proj", "v_proj"], use_dora=True)}]},
    "h200-lora-fake-n8": {
        "nproc": 8,
        "about": "Rank 0 of 8 (fake world, --fake-world): Qwen2.5-1.5B LoRA r 16 all-linear and r 64 attention at "
                 "stages 2 and 3, checkpointed, 2 x 2048",
        "hf_models": [{"config": "qwen2.5-1.5b"}],
        "hf_axes": {"stage": [2, 3], "activation_checkpointing": [True], "seq_len": [2048], "micro_batch": [2],
                    "timed_steps": [2], "lora": [lora(16), lora(64, ATTN)]}},
}


def write():
    for name, spec in MATRICES.items():
        with open(os.path.join(HERE, name + ".json"), "w") as f:
            json.dump(spec, f, indent=1)
            f.write("\n")


def peaks():
    """zerocalc's predicted peak reserved (GiB) per job, from the config as `--hf-config` reads it."""
    from validate import hf_models
    from validate.jobs import load_matrix, to_zerocalc
    from zerocalc.estimate import estimate
    total = 0
    for name in MATRICES:
        jobs = load_matrix(os.path.join(HERE, name + ".json"))
        worst = 0.0
        for job in jobs:
            spec, setup = hf_models.traced_spec(job), to_zerocalc(job)[1]
            e = estimate(spec, setup)
            gib = e.peak_reserved_bytes / 2**30
            worst = max(worst, gib)
            print(f"  {job['key']:70s} peak {e.peak_bytes / 2**30:6.1f}  reserved {gib:6.1f} GiB", flush=True)
        total += len(jobs)
        print(f"{name}: {len(jobs)} jobs, largest predicted reserved {worst:.1f} GiB", flush=True)
    print(f"{total} jobs")


if __name__ == "__main__":
    write()
    if "--peaks" in sys.argv:
        peaks()
