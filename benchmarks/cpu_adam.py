"""How fast DeepSpeedCPUAdam updates fp32 elements on this machine's cores, beside the host rate
zerocalc's offload time uses (`time.host_adam_elements_per_s` in the calibration, fitted on offloaded
H200 jobs: the whole host, shared by its GPUs). Prints rates and their ratio; no thresholds (a
benchmark, not a test). Run it on a training host to see how far yours is from the calibration's.

    python benchmarks/cpu_adam.py [--elements 64e6] [--repeat 5]
"""
import argparse
import os
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--elements", type=float, default=64e6)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        print("DeepSpeed is not installed: pip install -e '.[validate]' to measure")
        return
    from zerocalc import calibration
    n = int(args.elements)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-4)
    opt.step()                                  # Adam state made here, not timed
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    rate = n / statistics.median(times)
    assumed = calibration.default()["time"]["host_adam_elements_per_s"]
    print(f"DeepSpeedCPUAdam, {n:,} fp32 elements, {torch.get_num_threads()} threads: {rate / 1e9:.2f}e9 elements/s "
          f"(median of {args.repeat}; {28 * rate / 1e9:.0f} GB/s of p, g, m, v traffic)")
    print(f"zerocalc's calibrated host rate (H200 hosts): {assumed / 1e9:.2f}e9 elements/s")
    print(f"ratio (measured here / calibrated)           {rate / assumed:.2f}×")


if __name__ == "__main__":
    main()
