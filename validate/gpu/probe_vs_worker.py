"""The probe's rows (validate/gpu/probe_rows.py, one CSV per job) set beside `validate run`'s rows of the
same jobs: state, communication and the logged collectives op by op must be equal to the byte; the
peaks, phase by phase, are printed as the probe's over the worker's. The worker trains the model's
logits with its own cross-entropy, a user's loop or Trainer calls the model with labels (HF's loss):
the same tensors, so the peaks should agree within the allocator's noise.

    python validate/gpu/probe_vs_worker.py PROBE_DIR WORKER.csv"""
import csv
import glob
import json
import os
import sys

EXACT = ("measured_state_bytes", "measured_state_min_bytes", "measured_comm_bytes", "measured_comm_by_op",
         "num_params", "param_tensors", "sharded_param_tensors", "stage", "micro_batch", "seq_len", "gas",
         "zero_init")
PEAKS = tuple(f"measured_{phase}_{kind}_bytes" for phase in ("forward", "backward", "step")
              for kind in ("peak", "reserved")) + ("measured_peak_allocated_bytes", "measured_peak_reserved_bytes")


def _rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def compare(probe_dir: str, worker_csv: str) -> list[dict]:
    """One record per probe row: its key, the EXACT columns that differ, the detail's equality, and
    the probe/worker ratio of each peak."""
    worker = {r["key"]: r for r in _rows(worker_csv) if r.get("outcome") == "ok"}
    out = []
    for path in sorted(glob.glob(os.path.join(probe_dir, "*.csv"))):
        key = os.path.splitext(os.path.basename(path))[0]
        probe = _rows(path)
        if key not in worker or len(probe) != 1:
            out.append({"key": key, "missing": key not in worker, "probe_rows": len(probe)})
            continue
        p, w = probe[0], worker[key]
        out.append({"key": key, "path": w["path"], "stage": w["stage"], "lora": bool(w.get("lora")),
                    "differ": [c for c in EXACT if p[c] != w[c]],
                    "detail_equal": json.loads(p["measured_comm_detail"]) == json.loads(w["measured_comm_detail"]),
                    "peak_ratio": {c: int(p[c]) / int(w[c]) for c in PEAKS if p.get(c) and w.get(c)},
                    "state_bytes": int(w["measured_state_bytes"]), "comm_bytes": int(w["measured_comm_bytes"])})
    return out


def main(probe_dir: str, worker_csv: str) -> int:
    records = compare(probe_dir, worker_csv)
    for r in records:
        if "differ" not in r:
            print(f"{r['key']}: no worker row" if r["missing"] else f"{r['key']}: {r['probe_rows']} probe rows")
            continue
        ratios = " ".join(f"{c[9:-6]} {v - 1:+.2%}" for c, v in r["peak_ratio"].items())
        print(f"{r['key']} ({r['path']}, stage {r['stage']}{', LoRA' if r['lora'] else ''}): "
              f"state {r['state_bytes']:,} B, comm {r['comm_bytes']:,} B, "
              f"{'equal' if not r['differ'] and r['detail_equal'] else 'DIFFER: ' + ' '.join(r['differ'])}; {ratios}")
    return 0 if records and all(not r.get("differ") and r.get("detail_equal") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
