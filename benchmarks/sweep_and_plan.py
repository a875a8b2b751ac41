"""Sweep throughput, `zerocalc plan` latency, and DeepSpeed's own estimator answering the same memory
questions, side by side. Prints numbers and ratios; asserts nothing.

    python benchmarks/sweep_and_plan.py
"""
import subprocess
import sys
import time

import numpy as np

from zerocalc.sweep import evaluate, grid


def main():
    # 250 model sizes × 10 data-parallel sizes × 4 stages × 2 dtypes × 50 accumulation steps = 1e6
    g = grid(num_params=np.round(np.linspace(1e8, 2e11, 250)), dp=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
             stage=[0, 1, 2, 3], param_bytes=[2, 4], gas=list(range(1, 51)))
    n = len(g["num_params"])
    t0 = time.perf_counter()
    evaluate(g)                              # the first call replays stage 3 once per distinct P
    print(f"first call, stage-3 replays included: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    evaluate(g)
    dt = time.perf_counter() - t0
    print(f"sweep: {n:,} configurations in {dt:.2f} s = {n / dt:,.0f} configurations/s")

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zerocalc.cli", "plan", "--params", "70e9", "--gpu", "h100", "--gpu-memory",
                    "80GiB", "--max-gpus", "64", "--seq-len", "4096", "--global-batch", "1024"],
                   check=True, capture_output=True)
    print(f"zerocalc plan --params 70e9 ... --max-gpus 64 (cold process): {time.perf_counter() - t0:.2f} s")

    try:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as ds2
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as ds3
    except ImportError:
        print("DeepSpeed not installed: pip install -e '.[validate]' for the side-by-side")
        return
    sample = 20_000
    ps, ns = g["num_params"][:sample], g["dp"][:sample]
    t0 = time.perf_counter()
    for p, d in zip(ps, ns):
        ds2(int(p), num_gpus_per_node=int(d), cpu_offload=False)
        ds3(int(p), int(p) // 100, num_gpus_per_node=int(d), cpu_offload=False)
    ds_rate = 2 * sample / (time.perf_counter() - t0)
    print(f"DeepSpeed's estimator functions: {ds_rate:,.0f} answers/s (model states only, no peak or comm)")
    print(f"ratio (zerocalc sweep / DeepSpeed estimator): {n / dt / ds_rate:.1f}×")


if __name__ == "__main__":
    main()
