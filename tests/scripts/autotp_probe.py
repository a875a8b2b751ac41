"""Does AutoTP train on gloo CPU ranks? Not run by the tests: the evidence behind dskeys' entry for
tensor_parallel.autotp_size (still warned about). The validator's worker cannot run it: it feeds each
rank its own batch, and AutoTP's input check (engine.py `_configure_tensor_parallel_states`) stops the
first forward with "Data inconsistency within the TP group". Here every rank gets the same batch:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 tests/scripts/autotp_probe.py STAGE    (1 or 2)

On DeepSpeed 0.19.8 both stages train (loss 6.908 after two steps); rank 0 holds 69,312 of the tiny
Qwen2's 138,304 parameters and logs TP all-reduces in forward (6 × 120 B, 10 × 4,096 B over two steps)
and backward (22 × 4,096 B) beside the data-parallel ones (2 × 138,624 B gradients, 2 × 69,312 B
all-gathers)."""
import sys

import deepspeed
import deepspeed.comm as dist
import torch
import transformers
from deepspeed.comm.comm import comms_logger

cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64,
                               tie_word_embeddings=True)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg)
full = sum(p.numel() for p in model.parameters())
ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "bf16": {"enabled": True}, "zero_optimization": {"stage": int(sys.argv[-1])}, "tensor_parallel": {"autotp_size": 2},
      "comms_logger": {"enabled": True, "prof_all": True, "verbose": False, "debug": True}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
batch = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(1))   # the same on every rank
for _ in range(2):
    out = engine(input_ids=batch[:, :-1], labels=batch[:, 1:])
    engine.backward(out.loss)
    engine.step()
if dist.get_rank() == 0:
    print(f"loss {out.loss.item():.3f}; parameters on rank 0: {sum(p.numel() for p in engine.module.parameters()):,} "
          f"of {full:,}")
    for op, sizes in comms_logger.comms_dict.items():
        print(op, sorted((int(size), v[0]) for size, v in sizes.items()))
