"""Byte-for-byte equivalence check for speed work: dumps what zerocalc answers for a few dozen varied
configurations (`estimate --format json`: stages 0-3, offload, llama-2-7b, gpt2, seed-gpt, P-only,
N = 1..64, sequence lengths, h100/h200, checkpointing, fp16, expandable segments; `plan` tables and
JSON; `sweep` arrays and CSV) into one text file. Dump before a change and after, then compare:

    python benchmarks/equivalence.py before.txt
    ... change the code ...
    python benchmarks/equivalence.py after.txt && cmp before.txt after.txt

A speed change must leave the two files identical.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from zerocalc.cli import main as cli  # noqa: E402

E = ["estimate", "--format", "json"]
ESTIMATES = [
    ["--params", "7e9", "--dp", "8"],
    ["--params", "7e9", "--dp", "1", "--dtype", "fp16", "--gpu-memory", "32GB"],
    ["--params", "70e9", "--dp", "64", "--gpu", "h100"],
    ["--params", "1.3e9", "--dp", "3", "--gas", "4", "--stage", "3"],
    ["--params", "13e9", "--dp", "16", "--offload-optimizer", "cpu", "--stage", "1,2,3"],
    ["--params", "13e9", "--dp", "1", "--offload-optimizer", "cpu", "--offload-param", "cpu", "--stage", "3"],
    ["--model", "llama-2-7b", "--dp", "8", "--seq-len", "4096", "--micro-batch", "1", "--gpu", "h100"],
    ["--model", "llama-2-7b", "--dp", "1", "--seq-len", "2048", "--micro-batch", "2", "--gpu", "h200"],
    ["--model", "llama-2-7b", "--dp", "2", "--seq-len", "1024", "--micro-batch", "4", "--activation-checkpointing"],
    ["--model", "llama-2-7b", "--dp", "64", "--seq-len", "4096", "--gas", "3", "--gpu", "h100"],
    ["--model", "llama-2-7b", "--dp", "8", "--seq-len", "4096", "--expandable-segments", "--gpu", "h200"],
    ["--model", "llama-2-7b", "--dp", "4", "--seq-len", "2048", "--dtype", "fp16", "--stage", "0,3"],
    ["--model", "llama-2-7b", "--dp", "2", "--seq-len", "2048", "--overlap-comm", "--stage", "1,2"],
    ["--model", "llama-2-7b", "--dp", "1", "--seq-len", "2048", "--stage", "3", "--offload-optimizer", "cpu",
     "--offload-param", "cpu", "--gpu", "h100"],
    ["--model", "llama-2-7b", "--dp", "8", "--seq-len", "2048", "--stage", "1,2", "--offload-optimizer", "cpu"],
    ["--model", "llama-2-7b", "--dp", "2", "--seq-len", "4096", "--stage", "3", "--prefetch-bucket-size", "1e7",
     "--max-live-parameters", "3e8", "--param-persistence-threshold", "1e6"],
    ["--model", "gpt2", "--dp", "1", "--seq-len", "1024", "--micro-batch", "8", "--gpu", "h100"],
    ["--model", "gpt2", "--dp", "16", "--seq-len", "1024", "--micro-batch", "4", "--stage", "3"],
    ["--model", "gpt2-xl", "--dp", "4", "--seq-len", "1024", "--activation-checkpointing", "--gpu", "h200"],
    ["--model", "seed-gpt", "--dp", "2", "--stage", "3", "--seq-len", "1024", "--micro-batch", "2", "--dtype", "fp16"],
    ["--model", "seed-gpt", "--dp", "1", "--seq-len", "1024", "--micro-batch", "4", "--gpu", "h200"],
    ["--model", "seed-gpt", "--dp", "2", "--seq-len", "2048", "--micro-batch", "1", "--activation-checkpointing",
     "--gpu", "h100"],
    ["--model", "seed-gpt", "--dp", "2", "--seq-len", "1024", "--gas", "2", "--stage", "0,1,2"],
    ["--model", "seed-gpt", "--dp", "32", "--seq-len", "1024", "--stage", "3", "--activation-checkpointing"],
    ["--model", "seed-gpt", "--dp", "2", "--seq-len", "1024", "--stage", "3", "--expandable-segments"],
    ["--model", "seed-gpt", "--dp", "1", "--seq-len", "1024", "--stage", "3", "--offload-optimizer", "cpu",
     "--offload-param", "cpu"],
    ["--model", "llama-3-8b", "--dp", "8", "--seq-len", "8192", "--gpu", "h200", "--stage", "2,3"],
    ["--model", "mistral-7b", "--dp", "2", "--seq-len", "4096", "--stage", "3", "--activation-checkpointing",
     "--gpu", "h200"],
    ["--model", "llama-2-13b", "--dp", "16", "--seq-len", "4096", "--stage", "3", "--gpu", "h100"],
    ["--vocab-size", "32000", "--hidden-size", "1024", "--num-layers", "4", "--num-heads", "8", "--dp", "2",
     "--seq-len", "512", "--gpu", "h100"],
]
P = ["plan", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "1024"]
PLANS = [
    ["--params", "70e9", "--gpu-memory", "80GiB", "--max-gpus", "64"],
    ["--params", "70e9", "--gpu-memory", "80GiB", "--max-gpus", "64", "--min-gpus", "--format", "json"],
    ["--params", "7e9", "--max-gpus", "8", "--explain", "--format", "json"],
    ["--model", "llama-2-7b", "--max-gpus", "16", "--min-gpus"],
    ["--model", "llama-2-7b", "--max-gpus", "16", "--price-per-gpu-hour", "2.5", "--format", "json"],
    ["--model", "seed-gpt", "--max-gpus", "4", "--min-gpus", "--format", "json"],
    ["--model", "seed-gpt", "--max-gpus", "8", "--expandable-segments", "--top", "30"],
]
SWEEPS = [
    ["sweep", "--params", "1e9,7e9,70e9", "--dp", "1,8,64", "--stage", "0,1,2,3", "--dtype", "bf16,fp32"],
    ["sweep", "--params", "125e6,1.3e9,13e9,175e9", "--dp", "1,2,3,16,1024", "--gas", "1,2,7"],
]


def _digest(a) -> str:
    a = np.asarray(a)
    if a.dtype.kind in "OUS":
        a = a.astype(str)
    return f"{a.dtype.kind}{a.shape} {hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]}"


def dump(path: str) -> None:
    from zerocalc import sweep
    runner = CliRunner()
    with open(path, "w") as out:
        for args in [E + a for a in ESTIMATES] + [P + a for a in PLANS] + SWEEPS:
            r = runner.invoke(cli, args)
            out.write(f"$ zerocalc {' '.join(args)}\nexit {r.exit_code}\n{r.output}\n")
        grid = dict(num_params=np.round(np.linspace(1e8, 2e11, 25)), dp=[1, 2, 3, 4, 8, 16, 64, 512],
                    stage=[0, 1, 2, 3], param_bytes=[2, 4], gas=[1, 2, 5])
        for options in ({}, {"optimizer_state_bytes": 0, "reduce_bucket_size": 2e8, "sub_group_size": 1e8}):
            g = sweep.grid(**grid)
            ev = sweep.evaluate(g, **options)
            for k in sorted(g):
                out.write(f"grid {k} {_digest(g[k])}\n")
            for k in sorted(ev):     # peak_phase: codes into sweep.PHASES, digested by name
                v = sweep.PHASES[ev[k]] if k == "peak_phase" and ev[k].dtype.kind == "i" else ev[k]
                out.write(f"evaluate {options} {k} {_digest(v)}\n")
            frame = sweep.sweep(**grid, **options)
            cols = frame.columns if hasattr(frame, "columns") else frame
            for k in cols:
                out.write(f"sweep {options} {k} {_digest(frame[k])}\n")


if __name__ == "__main__":
    dump(sys.argv[1] if len(sys.argv) > 1 else "equivalence.txt")
