"""Run under DeepSpeed's launcher (2 CPU ranks): train tiny models at stage 3 and write the module
trace DeepSpeed's PartitionedParameterCoordinator recorded, as indices into `module.parameters()`,
to OUT (JSON). Read by tests/test_against_deepspeed.py::test_stage3_trace_matches_deepspeed."""
import json
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from zerocalc.hf.families import build_model  # noqa: E402
from validate.worker import freeze_imports  # noqa: E402


def recorded_trace(arch, checkpointing):
    model = build_model(arch, checkpointing, "sdpa")
    index = {id(p): i for i, p in enumerate(model.parameters())}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, arch["vocab_size"], (1, 8))
    for _ in range(2):   # the trace is recorded in the first step and frozen after the second
        engine.backward(engine(x).float().mean())
        engine.step()
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    order = coordinator._PartitionedParameterCoordinator__submodule_order
    # what fetch_sub_module gathers for each step: the module's own and its registered external parameters
    return [sorted(index[id(p)] for p in iter_params(m)) for m in order]


def main(out):
    deepspeed.init_distributed()
    freeze_imports()   # DeepSpeed's gc.collect() at each engine then walks only the engines' objects
    results = []
    for family in ("seed-gpt", "hf-gpt2", "hf-llama"):
        arch = {"family": family, "vocab_size": 97, "hidden_size": 16, "num_layers": 2, "num_heads": 4,
                "num_kv_heads": 2 if family == "hf-llama" else 4, "ffn_hidden_size": 24, "max_positions": 16,
                "tie_embeddings": family == "hf-gpt2"}
        for checkpointing in (False, True):
            results.append({"arch": arch, "checkpointing": checkpointing, "trace": recorded_trace(arch, checkpointing)})
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
