"""What was alive at a step's peak: reads the allocator history that the worker dumps with
VALIDATE_SNAPSHOT_DIR set (`torch.cuda.memory._snapshot()` over one optimizer step on rank 0) and
names the tensors allocated during the step that were still alive at its allocated peak, and the
segments (cudaMalloc'd blocks) alive at its reserved peak. A diagnostic for the peak model: pure
Python over the pickle, no GPU needed to read one.

    python -m validate snapshot data/snapshots/KEY.pickle

Allocated falls when a block is freed (`free_requested`: the allocator's stats drop there, the block
is reused once its stream events complete, `free_completed`)."""
import gzip
import json
import pickle
from collections import defaultdict

_OWN = ("deepspeed", "transformers", "validate", "torch/nn/", "torch/autograd", "torch/utils/checkpoint",
        "torch/_tensor", "torch/distributed")
_SKIP = ("_contextlib", "_compile", "eval_frame", "external_utils", "hooks.py", "_dynamo")


def where(frames, depth=3) -> str:
    """The innermost few frames of the project or its libraries, innermost first (a compacted
    trace's events carry the string itself)."""
    if isinstance(frames, str):
        return frames
    picked = [f for f in frames if any(o in f["filename"] for o in _OWN) and not any(s in f["filename"] for s in _SKIP)]
    return " < ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in picked[:depth])


def _replay(trace, grow: str, shrink: str):
    """(peak increase in bytes, event index, entries alive then that were made during the trace) of
    the running sum of `grow` events less `shrink` events (a shrink of something from before the
    recording counts too: it was in the starting sum)."""
    live, delta, best = {}, 0, (0, -1, {})
    for i, e in enumerate(trace):
        if e["action"] == grow:
            live[e["addr"]] = e
            delta += e["size"]
        elif e["action"] == shrink:
            live.pop(e["addr"], None)
            delta -= e["size"]
        else:
            continue
        if delta > best[0]:
            best = (delta, i, dict(live))
    return best


def replay(trace):
    """Allocated: (peak increase, event index, transient blocks alive at the peak)."""
    return _replay(trace, "alloc", "free_requested")


def reserved_replay(trace):
    """Reserved: (peak increase, event index, segments made during the trace alive then)."""
    return _replay(trace, "segment_alloc", "segment_free")


EVENT_FIELDS = ("action", "addr", "size", "stream")
WHERE_DEPTH = 5


def compact(snap: dict) -> dict:
    """A snapshot small enough to bring back from the GPU machine and commit: rank 0's trace as rows
    of (action, addr, size, stream, index into a table of `where` strings), plus the worker's totals."""
    trace = next((t for t in snap["device_traces"] if t), [])
    table, events = {}, []
    for e in trace:
        w = where(e.get("frames", []), WHERE_DEPTH)
        events.append([e.get(k, 0) for k in EVENT_FIELDS] + [table.setdefault(w, len(table))])
    totals = {k: v for k, v in snap.items() if k.startswith("zerocalc_")}
    return {"fields": list(EVENT_FIELDS) + ["where"], "where": list(table), "events": events, **totals}


def _read_compacted(path: str) -> tuple[dict, dict]:
    """(the file as `compact` wrote it, the worker's totals: its `zerocalc_` keys)."""
    with gzip.open(path, "rt") as f:
        c = json.load(f)
    return c, {k: v for k, v in c.items() if k.startswith("zerocalc_")}


def load(path: str) -> dict:
    """A snapshot as the worker pickled it, or as `compact` wrote it (.json.gz): same keys read here."""
    if path.endswith(".json.gz"):
        c, totals = _read_compacted(path)
        n = len(EVENT_FIELDS)
        trace = [dict(zip(EVENT_FIELDS, e[:n]), frames=c["where"][e[n]]) for e in c["events"]]
        return {"device_traces": [trace], **totals}
    with open(path, "rb") as f:
        return pickle.load(f)


def totals_and_actions(path: str) -> tuple[dict, set[str]]:
    """A compacted history's totals (as `load` gives them) and the set of its events' actions, without
    building the trace: what a question about many histories needs."""
    c, totals = _read_compacted(path)
    return totals, {e[0] for e in c["events"]}


def start_segments(snap: dict):
    """The cache's segments when the history began, as `zerocalc.allocator.replay` takes them: what
    the worker recorded, or none (a history that started clean, or an older one that did not list
    them; the worker stores a message instead when torch's snapshot could not be read)."""
    start = snap.get("zerocalc_start_segments", ())
    return start if isinstance(start, list) else ()


def _allocator_events_at(trace, on_request: bool = False):
    """(trace index, event) for `allocator_events`."""
    last = None
    freed = "free_requested" if on_request else "free_completed"
    for j, e in enumerate(trace):
        if e["action"] == "alloc":
            last = ("alloc", e["addr"], e["size"], e.get("stream", 0))
        elif e["action"] == freed:
            last = ("free", e["addr"])
        elif e["action"] == "segment_free" and last != ("empty_cache",):
            last = ("empty_cache",)
        else:
            continue
        yield j, last


def allocator_events(trace, on_request: bool = False) -> list[tuple]:
    """The history's allocations, frees and cache emptying as `zerocalc.allocator.replay` takes them.
    A block is reusable once its free completes (`free_completed`: after the streams that used it are
    done); a run of `segment_free` events is one `empty_cache()`. on_request: each free taken where it
    was requested instead, as if every stream were done by then (how `zerocalc.sequence` generates a
    job: frees on time)."""
    return [e for _, e in _allocator_events_at(trace, on_request)]


def segment_addresses(trace) -> list[int]:
    """The addresses cudaMalloc returned during a history, in order: a replay given them breaks
    ties between equal-sized free blocks as the real allocator did."""
    return [e["addr"] for e in trace if e["action"] == "segment_alloc"]


def reserved_timelines(snap: dict, simulated=None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Reserved bytes (growth since the history began) after each change, by trace index: as the
    allocator recorded it, and as `zerocalc.allocator` simulates it from the allocations alone
    (`simulated`: that replay where the caller has it, `replay(allocator_events(trace), ...)`)."""
    from zerocalc.allocator import replay as simulate
    trace = snap["device_traces"][0]
    at = list(_allocator_events_at(trace))
    sim = simulated if simulated is not None else \
        simulate([e for _, e in at], start_segments(snap), segment_addresses=segment_addresses(trace))
    changes = [(at[i][0], delta) for i, delta in sim.reserved_changes()]
    recorded = [(j, e["size"] if e["action"] == "segment_alloc" else -e["size"])
                for j, e in enumerate(trace) if e["action"] in ("segment_alloc", "segment_free")]

    def cumulative(steps):
        total, out = 0, []
        for j, delta in steps:
            total += delta
            out.append((j, total))
        return out
    return cumulative(recorded), cumulative(changes)


def summarize(path: str, top: int = 15) -> str:
    snap = load(path)
    base = snap.get("zerocalc_base_allocated", 0)
    base_reserved = snap.get("zerocalc_base_reserved", 0)
    trace = next(t for t in snap["device_traces"] if t)
    peak, at, blocks = replay(trace)
    lines = [f"{path}: {len(trace)} events; allocated at start {base / 2**30:.3f} GiB, "
             f"peak {(base + peak) / 2**30:.3f} GiB (+{peak / 2**30:.3f}) at event {at}",
             f"  at the peak: {where(trace[at].get('frames', []), 5)}",
             "  transient tensors alive at the peak (allocated during the step), by where they were made:"]
    groups = defaultdict(lambda: [0, 0])
    for e in blocks.values():
        g = groups[where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    for name, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {size / 2**20:10.1f} MiB  {count:4d}  {name}")
    r_peak, r_at, segments = reserved_replay(trace)
    lines.append(f"  reserved at start {base_reserved / 2**30:.3f} GiB, peak +{r_peak / 2**30:.3f} GiB at event {r_at}; "
                 f"segments made during the step alive then: {len(segments)}, "
                 f"sizes (MiB): {sorted(round(s['size'] / 2**20, 1) for s in segments.values())[-12:]}")
    from zerocalc.allocator import replay as simulate
    events = allocator_events(trace)
    sim = simulate(events, start_segments(snap), segment_addresses=segment_addresses(trace))
    recorded = [e["size"] for e in trace if e["action"] == "segment_alloc"]
    same = [s.size_bytes for s in sim.segments] == recorded
    lines.append(f"  zerocalc's allocator simulation over these allocations: {len(sim.segments)} segments made, "
                 f"peak +{sim.peak_reserved_bytes / 2**30:.3f} GiB reserved (recorded: {len(recorded)}, "
                 f"+{r_peak / 2**30:.3f} GiB; {'the same segments' if same else 'they differ'}"
                 f"{'' if same or not base_reserved or 'zerocalc_start_segments' in snap else ': the history starts with cached segments it does not list'})")
    as_expandable = simulate(events, start_segments(snap), expandable_segments=True)
    lines.append(f"  the same allocations with expandable_segments:True: peak +{as_expandable.peak_reserved_bytes / 2**30:.3f} "
                 f"GiB reserved")
    return "\n".join(lines)
