"""Cold start of `zerocalc estimate` beside the time to import DeepSpeed's own estimator and answer the
same question with it. Prints medians and their ratio; no thresholds (this is a benchmark, not a test).

    python benchmarks/cold_start.py [--repeat 7]
"""
import argparse
import statistics
import subprocess
import sys
import time


def timed(cmd, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    ours = timed([sys.executable, "-m", "zerocalc.cli", "estimate", "--params", "7e9", "--dp", "8"], args.repeat)
    print(f"zerocalc estimate --params 7e9 --dp 8     {ours * 1e3:8.1f} ms (median of {args.repeat}, cold process)")
    ds_code = ("from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as f; "
               "[f(7e9, num_gpus_per_node=8, cpu_offload=False) for _ in range(1)]")
    try:
        theirs = timed([sys.executable, "-c", ds_code], args.repeat)
    except subprocess.CalledProcessError:
        print("DeepSpeed is not installed: pip install -e '.[validate]' to compare")
        return
    print(f"import DeepSpeed's estimator + one call   {theirs * 1e3:8.1f} ms")
    print(f"ratio (DeepSpeed / zerocalc)              {theirs / ours:8.1f}×")


if __name__ == "__main__":
    main()
