"""Where an HF config's forward and backward spend their time on the GPU, without DeepSpeed: each phase's
wall time (synchronized) and the host's time to issue it (unsynchronized). The step-time model splits each
phase into what the device must compute and what the host must issue (zerocalc/timing.py); this measures
both halves for a model type directly (`validate.fit.device_constants` reads the lines).

    python3 validate/gpu/kernel_time.py MICRO_BATCH SEQ_LEN MATRIX.json ...   (one JSON line per model)

KERNEL_TIME_PROFILE=1 adds one profiled step: per phase the kernels launched, their summed time and the
device's busy time (forward's operators too; backward's run on autograd's thread and are not counted).
It made a 1B model take minutes.

Each distinct `hf` entry of the matrices, bf16, random weights, SDPA, plain and checkpointed as HF
enables it; the loss is the validator's (cross entropy of the logits in fp32)."""
import json
import os
import statistics
import sys
import time

import torch

from validate import hf_models

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU only to try the script
PROFILE = os.environ.get("KERNEL_TIME_PROFILE") == "1"    # one more step under torch.profiler (slow)


PHASES = ("forward", "backward")


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _phase_step(model, inputs, labels, vocab, sync: bool) -> dict:
    """One forward and backward; each phase's seconds (to the device's end where `sync`, else until the
    host returns)."""
    out = {}
    _sync()
    t = time.perf_counter()
    with torch.profiler.record_function("zc:forward"):
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        del logits
    if sync:
        _sync()
    out["forward"] = time.perf_counter() - t
    if not sync:
        _sync()
    t = time.perf_counter()
    with torch.profiler.record_function("zc:backward"):
        loss.backward()
    if sync:
        _sync()
    out["backward"] = time.perf_counter() - t
    _sync()
    for p in model.parameters():
        p.grad = None
    return out


def _union_s(intervals) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy * 1e-6


def _under_aten(e) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _profiled(model, inputs, labels, vocab) -> dict:
    """From one profiled step (the phases unsynchronized, the device drained between them): per phase the
    top-level operators the host dispatched, the kernels they launched and those kernels' summed time,
    and the union of the device's busy intervals (a kernel belongs to the phase it ran in)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _phase_step(model, inputs, labels, vocab, sync=False)
    events = prof.events()
    ranges = {e.name[3:]: e.time_range for e in events if e.name.startswith("zc:")}
    backward_start = ranges["backward"].start
    out = {p: {"ops": 0, "kernels": 0, "kernel_s": 0.0} for p in PHASES}
    busy = {p: [] for p in PHASES}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            busy["forward" if e.time_range.end <= backward_start else "backward"].append(
                (e.time_range.start, e.time_range.end))
            continue
        where = next((p for p, r in ranges.items() if r.start <= e.time_range.start <= r.end), None)
        if where is None or e.name.startswith("zc:"):
            continue
        if e.name.startswith("aten::") and not _under_aten(e):
            out[where]["ops"] += 1
        for k in e.kernels:
            out[where]["kernels"] += 1
            out[where]["kernel_s"] += k.duration * 1e-6
    for p in PHASES:
        out[p]["busy_s"] = _union_s(busy[p]) if busy[p] else None
    return out


def measure(hf: dict, micro_batch: int, seq_len: int, checkpointing: bool, repeats: int = 5) -> dict:
    _, cfg = hf_models.load_config(hf["config"], hf.get("overrides"))
    with torch.device(DEVICE):   # initialized where it runs: a 1B model's CPU init took minutes
        model = hf_models.build(cfg, "bf16", checkpointing).train()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    batch = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen).to(DEVICE)
    inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    for _ in range(3):
        _phase_step(model, inputs, labels, vocab, sync=True)
    wall = [_phase_step(model, inputs, labels, vocab, sync=True) for _ in range(repeats)]
    issue = [_phase_step(model, inputs, labels, vocab, sync=False) for _ in range(repeats)]
    prof = _profiled(model, inputs, labels, vocab) if PROFILE else {p: {} for p in PHASES}
    out = {"hf": hf, "micro_batch": micro_batch, "seq_len": seq_len, "checkpointing": checkpointing,
           "num_params": sum(p.numel() for p in model.parameters()),
           "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    for p in PHASES:
        out[p] = {"wall_s": statistics.median(w[p] for w in wall), "issue_s": statistics.median(w[p] for w in issue),
                  **prof[p]}
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    micro_batch, seq_len = int(sys.argv[1]), int(sys.argv[2])
    seen = []
    for path in sys.argv[3:]:
        m = json.load(open(path))
        for hf in m.get("hf_models", []) + [j["hf"] for j in m.get("jobs", []) if "hf" in j]:
            if hf in seen:
                continue
            seen.append(hf)
            for ck in (False, True):
                try:
                    print(json.dumps(measure(hf, micro_batch, seq_len, ck)), flush=True)
                except Exception as e:   # one model's failure is that model's line
                    print(json.dumps({"hf": hf, "checkpointing": ck, "error": repr(e)[:300]}), flush=True)
