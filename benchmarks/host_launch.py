"""How fast this host issues CUDA kernels from Python, beside the launch cost zerocalc's step time
assumes (`time.host_launch_s_fitted` in the calibration: the H200 VMs' median). Small models and
stage 3 are host-bound, and their step time scales with this number (`zerocalc estimate
--host-launch-us`). The probe is the validator's (`validate.measure.host_issue_s`): 500 in-place adds
on one element, not waited for, per round. Prints the median and the spread over rounds; no thresholds
(a benchmark, not a test). On the H200 VMs the cost drifted between 7 and 25 us within minutes: run it
a few times, and on the host you will train on.

    python benchmarks/host_launch.py [--rounds 50]
"""
import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed: pip install -e '.[validate]' to measure")
        return
    if not torch.cuda.is_available():
        print("no CUDA device: the launch cost is measured on a GPU host")
        return
    from validate.measure import host_issue_s
    from zerocalc import calibration
    device = torch.device("cuda", 0)
    host_issue_s(device)                          # CUDA context and the kernel's first launch, not timed
    costs = []
    for _ in range(args.rounds):
        costs.append(host_issue_s(device))
        time.sleep(0.05)
    median = statistics.median(costs)
    fitted = calibration.default()["time"].get("host_launch_s_fitted")
    print(f"host launch cost: {median * 1e6:.2f} us (median of {args.rounds} rounds of 500; "
          f"{min(costs) * 1e6:.2f}-{max(costs) * 1e6:.2f} us)")
    if fitted:
        print(f"calibration's hosts: {fitted * 1e6:.2f} us; this host issues at {fitted / median:.2f}x their speed: "
              f"zerocalc estimate ... --host-launch-us {median * 1e6:.1f}")


if __name__ == "__main__":
    main()
