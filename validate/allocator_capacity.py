"""The allocator simulation's capacity rules (`zerocalc.allocator.replay(capacity_bytes=...)`: the
cache freed and the cudaMalloc retried, then OutOfMemoryError) against PyTorch's own caching
allocator on a GPU. Each case's events are replayed with `torch.empty` and `del` on the streams they
name, under `set_per_process_memory_fraction` (the capacity, plus 1 MiB: reserved moves in 2 MiB
steps), and torch's `num_alloc_retries`, the event that raised OutOfMemoryError and
`max_memory_reserved` are printed beside the simulation's.

    python -m validate.allocator_capacity [--json PATH]

The cases: tests/test_allocator.py's hand-worked sequences at the capacities the tests use, and a
4-layer Llama's generated stage-3 job (N = 2, 512 tokens, rank 0) at capacities around the least it
runs at. Expandable segments cannot be checked under a memory fraction (torch compares the request's
allocation size with it, not the pages it would map: allocator.py's docstring), so their case fills
the card instead: a tensor made outside them (expandable segments off) leaves the capacity free
(`mem_get_info`), and a mapping fails where the driver has no pages left.
"""
import argparse
import json
from dataclasses import replace

from zerocalc import allocator, sequence
from zerocalc.arch import Architecture
from zerocalc.model import from_architecture
from zerocalc.training import Setup, Stage

MiB = 2**20


def _a(handle, n_bytes, stream=0):
    return ("alloc", handle, n_bytes, stream)


def _f(handle):
    return ("free", handle)


HAND = {   # tests/test_allocator.py's sequences, with the capacities (MiB) it replays them at
    "retry": ([_a("s", 100), _f("s"), _a("a", 300 * MiB), _f("a"), _a("b", 200 * MiB, 7), _a("c", 150 * MiB)],
              [400, 350, 348, 502]),
    "oom": ([_a("a", 300 * MiB), _a("b", 50 * MiB), _f("a"), _a("c", 100 * MiB), _a("d", 250 * MiB), _a("e", MiB)],
            [400, 600]),
    "not monotone": ([_a("a", 50 * MiB, 1), _f("a"), _a("b", 20 * MiB), _a("c", 10 * MiB, 1), _a("d", 10 * MiB)],
                     list(range(48, 82, 2))),
}


EXPANDABLE = ([_a("a", 40 * MiB), _a("b", 20 * MiB), _f("a"), _a("c", 50 * MiB, 7), _a("d", 30 * MiB)], [100, 118, 120])


LLAMA = "llama 4 layers, stage 3"


def events_of(name: str) -> list:
    """A case's events by its name."""
    if name == LLAMA:
        # as generated when torch's allocator ran it (data/h200-allocator-capacity.json): before the
        # sequence made the module buffers at init (the rotary inv_freq, two 256-byte blocks)
        model = replace(from_architecture(Architecture("hf-llama", 32000, 1024, 4, 8, 8, 4096, False)), buffer_numels=())
        return sequence.events(model, Setup(stage=Stage.PARAMETERS, dp=2, seq_len=512))
    return EXPANDABLE[0] if name == "expandable" else HAND[name][0]


def cases():
    """(name, events, capacity bytes, expandable segments) of every case."""
    for name, (events, capacities) in HAND.items():
        for c in capacities:
            yield name, events, c * MiB, False
    for c in EXPANDABLE[1]:
        yield "expandable", EXPANDABLE[0], c * MiB, True
    events = events_of(LLAMA)
    least = allocator.smallest_capacity_bytes(events)
    reserved = allocator.replay(events).peak_reserved_bytes
    for c in sorted({least - 2 * MiB, least, least + 64 * MiB, (least + reserved) // 2 // (2 * MiB) * 2 * MiB,
                     reserved - 2 * MiB, reserved}):
        yield LLAMA, events, c, False


def simulated(events, capacity: int, expandable: bool = False) -> dict:
    r = allocator.replay(events, expandable_segments=expandable, capacity_bytes=capacity)
    return {"retries": r.alloc_retries, "oom_event": None if r.oom is None else r.oom.event,
            "peak_reserved_bytes": r.peak_reserved_bytes}


def measured(events, capacity: int, expandable: bool = False) -> dict:
    """The events through torch's caching allocator, capacity its memory fraction (expandable
    segments: what a tensor made first leaves free on the card)."""
    import torch
    total = torch.cuda.mem_get_info()[1]
    streams = {0: torch.cuda.default_stream()}
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    torch.cuda.empty_cache()
    filler = None
    if expandable:
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty((free - capacity - MiB) // (2 * MiB) * 2 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        capacity = torch.cuda.mem_get_info()[0] // (2 * MiB) * (2 * MiB)     # what is left, as the simulation's
    else:
        torch.cuda.set_per_process_memory_fraction((capacity + MiB) / total)
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    live, oom = {}, None
    try:
        for i, e in enumerate(events):
            if e[0] == "alloc":
                if e[3] not in streams:
                    streams[e[3]] = torch.cuda.Stream()
                try:
                    with torch.cuda.stream(streams[e[3]]):
                        live[e[1]] = torch.empty(e[2], dtype=torch.uint8, device="cuda")
                except torch.cuda.OutOfMemoryError:
                    oom = i
                    break
            elif e[0] == "free":
                live.pop(e[1], None)
            else:
                torch.cuda.empty_cache()
        return {"retries": torch.cuda.memory_stats().get("num_alloc_retries", 0), "oom_event": oom,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved() - base, "capacity_bytes": capacity}
    finally:
        live.clear()
        del filler
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the rows there")
    args = ap.parse_args()
    import torch
    rows = []
    for name, events, capacity, expandable in cases():
        got = measured(events, capacity, expandable)
        capacity = got.pop("capacity_bytes")        # expandable: the card's, as left
        row = {"case": name, "expandable_segments": expandable, "capacity_bytes": capacity,
               "simulated": simulated(events, capacity, expandable), "measured": got}
        rows.append(row)
        print(f"{name:24s} {capacity / MiB:7.0f} MiB  torch {row['measured']}  sim {row['simulated']}  "
              f"{'same' if row['measured'] == row['simulated'] else 'DIFFERENT'}", flush=True)
    same = sum(r["measured"] == r["simulated"] for r in rows)
    print(f"{same} of {len(rows)} the same; torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
