"""Operators dispatched and FLOPs of one forward and backward of HF configs on the GPU, counted as
`zerocalc.hf.optrace` counts them on fake tensors (same counter, same batch and length), to check the
trace's counts against what CUDA dispatches: `python3 validate/gpu/opcount.py MATRIX.json ...` (each distinct `hf` entry of the matrices)."""
import contextlib
import json
import sys

import torch
import transformers

from validate import hf_models
from zerocalc.hf import optrace


def _flops_or_zero(func, args, kwargs, out):
    """torch's SDPA FLOP formula refuses grouped-query shapes on CUDA: the operator still counts."""
    try:
        return _flops_of(func, args, kwargs, out)
    except AssertionError:
        return "attention", 0


_flops_of, optrace.flops_of = optrace.flops_of, _flops_or_zero


def counts(hf: dict) -> dict:
    _, cfg = hf_models.load_config(hf["config"], hf.get("overrides"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_device(device)
    model = hf_models.build(cfg, "bf16").to(device)
    model.train()
    config = model.config
    out = {"hf": hf, "device": device, "transformers": transformers.__version__,
           "experts_implementation": getattr(config, "_experts_implementation", None),
           "attn_implementation": getattr(config, "_attn_implementation", None)}
    for ck in (False, True):
        totals = optrace.phase_totals(model, contextlib.nullcontext(), optrace.SEQ, ck)
        for phase, t in totals.items():
            out[phase] = {"ops": t.ops, "flops": t.flops, "bytes": t.bytes}
    torch.set_default_device("cpu")
    return out


if __name__ == "__main__":
    seen = []
    for path in sys.argv[1:]:
        for job in json.load(open(path))["jobs"]:
            if "hf" in job and job["hf"] not in seen:
                seen.append(job["hf"])
                try:
                    print(json.dumps(counts(job["hf"])), flush=True)
                except Exception as e:
                    print(json.dumps({"hf": job["hf"], "error": repr(e)[:300]}), flush=True)
