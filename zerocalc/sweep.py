"""Millions of configurations at once: the P-only closed forms of `states`, `peak` and `comm`,
vectorized with numpy over a grid.

The model is the one `estimate` uses for `--params` (100 equal tensors, Adam-family or SGD state,
default buckets; param_bytes 2 is bf16, 4 is fp32). The sweep treats padding in closed form, so the
tensors a rank's shard touches may differ from `estimate`'s by one: `tests/test_sweep.py` holds every
column to `estimate` within 1%. Activations and step time need an architecture: use `estimate` or
`plan`. A named model, with LoRA or frozen modules, is swept point by point (`of_model`).

A grid is kept as its axes, not as their product: each quantity is computed on the axes it depends
on (numpy broadcasting: the fp32 master on the model sizes alone, a rank's shard on sizes × data-
parallel sizes) and only the columns returned span the whole product. `tests/test_sweep.py` holds
the result to the same formulas evaluated point by point.
"""
from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from zerocalc import stage3_trace
from zerocalc.comm import MEMORY_OPT_ALLREDUCE_SIZE
from zerocalc.model import from_params
from zerocalc.training import Setup

TENSORS = 100                 # `zerocalc.arch.uniform_params`
AXES = ("num_params", "dp", "stage", "param_bytes", "gas")
PHASES = np.array(["init", "forward", "backward", "step"])   # `peak_phase` codes index these


class Grid(Mapping):
    """The Cartesian product of the axes, held as the axes: `grid[k]` is axis k's value at every
    point, flattened in C order (num_params slowest, gas fastest), made only when asked for."""

    def __init__(self, axes: dict):
        self.axes = axes
        self.shape = tuple(len(axes[k]) for k in AXES)

    def axis(self, k: str) -> np.ndarray:
        """Axis k's values shaped to broadcast against the others."""
        shape = [1] * len(AXES)
        shape[AXES.index(k)] = -1
        return self.axes[k].reshape(shape)

    def __getitem__(self, k: str) -> np.ndarray:
        return np.broadcast_to(self.axis(k), self.shape).ravel()

    def __iter__(self):
        return iter(AXES)

    def __len__(self) -> int:
        return len(AXES)


def grid(**axes) -> Grid:
    """The Cartesian product of the given axes (each a list): a `Grid`, whose `grid[k]` are
    equal-length flat arrays."""
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown sweep axes {sorted(unknown)}; use {', '.join(AXES)}")
    defaults = {"dp": [1], "stage": [0, 1, 2, 3], "param_bytes": [2], "gas": [1]}
    return Grid({k: np.asarray(axes.get(k, defaults.get(k)), dtype=np.float64).ravel() for k in AXES})


@lru_cache(maxsize=4096)
def _kept_and_gathered(num_params: int) -> tuple[float, float]:
    """Stage-3 replay for a P-only model: (kept gathered after forward, all-gathered in a micro-step) as
    fractions of P; for 100 equal tensors these do not depend on N (replayed at N = 2). A parameter
    released in forward may be prefetched again before backward starts, so only the sum of forward
    and backward gathers is meaningful. The coordinator's walk is shared by every size of its class
    (`_walk_class`)."""
    numels = from_params(num_params).param_numels
    it = stage3_trace.scaled(numels, _class_gathers(_walk_class(numels), num_params), 2)
    gathered = (it.forward_gather_elements + it.backward_gather_elements) * 2 / num_params
    return it.kept_after_forward_elements / num_params, gathered


_WALK = stage3_trace._walk_setup(Setup(dp=2))
_LIMITS = np.array([_WALK.param_persistence_threshold, _WALK.model_persistence_threshold,
                    _WALK.prefetch_bucket_size, _WALK.max_live_parameters, _WALK.max_reuse_distance], dtype=np.int64)


def _walk_class(numels: tuple[int, ...]):
    """A key shared by P-only models whose stage-3 walks (`stage3_trace._walk`) are the same, or the
    tensor sizes themselves where that is not shown. The walk reads the tensors' sizes only through
    comparisons of sums of them with the setup's limits: each tensor against the persistence
    threshold, the persistent total against the model's, the prefetch batch against the bucket and
    (with what is gathered) the live-parameter limit, the elements of the modules ahead against the
    reuse distance. A P-only model's tensors are t elements each but the last, L; every such sum is
    a·t + b·L with a at most twice the tensor count (each is in forward's and backward's trace once)
    and b at most 2. Two models with the same count that agree on a·t + b·L < limit and <= limit for
    every a, b and limit take the same branches everywhere: the same walk."""
    t, last = numels[0], numels[-1]
    if any(x != t for x in numels[:-1]) or 2 * len(numels) * max(t, last) >= 2**62:
        return numels
    sums = np.arange(2 * len(numels) + 1, dtype=np.int64)[:, None] * t + np.arange(3, dtype=np.int64) * last
    below = sums.ravel()[:, None] < _LIMITS
    at_most = sums.ravel()[:, None] <= _LIMITS
    return len(numels), np.packbits(np.concatenate([below.ravel(), at_most.ravel()])).tobytes()


_CLASS_GATHERS: dict = {}


def _class_gathers(key, num_params: int) -> tuple:
    """`stage3_trace._gathers` of the walk of key's class, walked once on the first size that asks."""
    if key not in _CLASS_GATHERS:
        _CLASS_GATHERS[key] = stage3_trace._gathers(from_params(num_params), _WALK)
    return _CLASS_GATHERS[key]


def _by_stage(stage, shape, zero, one_two, three):
    """`np.select([stage == 0, stage < 3], [zero, one_two], three)`. On a grid, where the stage is an
    axis of its own, each stage's slab is one choice, copied once into the result."""
    if np.ndim(stage) != len(AXES):
        return np.select([stage == 0, stage < 3], [zero, one_two], three)
    out = np.empty(shape, dtype=np.result_type(zero, one_two, three))
    axis = AXES.index("stage")
    for i, v in enumerate(stage.ravel()):
        choice = np.asarray(zero if v == 0 else one_two if v < 3 else three)
        choice = choice.reshape((1,) * (len(AXES) - choice.ndim) + choice.shape)
        out[(slice(None),) * axis + (i,)] = choice[(slice(None),) * axis + (i if choice.shape[axis] > 1 else 0,)]
    return out


def _peak(phases) -> tuple[np.ndarray, np.ndarray]:
    """(largest, index of the first largest) over the phases, as `np.stack(phases).max(0)` and
    `.argmax(0)` give, without first broadcasting each phase to the shape of the largest."""
    best, code = phases[0], np.zeros(np.shape(phases[0]), dtype=np.int8)
    for i, ph in enumerate(phases[1:], 1):
        code = np.where(ph > best, np.int8(i), code)
        best = np.maximum(best, ph)
    return best, code


def evaluate(g, optimizer_state_bytes: int = 8, reduce_bucket_size: int = 500_000_000,
             sub_group_size: int = 1_000_000_000) -> dict:
    """Per-rank bytes and communication for every point of `g` (a `Grid`, or a dict of equal-length
    flat arrays, one per axis): a dict of flat arrays in the grid's order. `peak_phase` holds codes
    (int8) into `PHASES`: `PHASES[out["peak_phase"]]` are the names (`table` gives them)."""
    if isinstance(g, Grid):
        p, n, stage, b, gas = (g.axis(k) for k in AXES)
        shape = g.shape
    else:
        p, n, stage, b, gas = (np.asarray(g[k], dtype=np.float64) for k in AXES)
        shape = np.broadcast_shapes(*(x.shape for x in (p, n, stage, b, gas)))
    k, c, mixed = optimizer_state_bytes, b, (b < 4)
    tensor = np.floor(p / TENSORS)
    # stages 1/2: the flat group padded to 2N, shard S, and G_in: whole tensors a shard touches
    padded = np.ceil(p / (2 * n)) * 2 * n
    s = padded / n
    g_in = np.minimum(p, (np.ceil(s / tensor) + 1) * tensor)
    # stage 3: per-tensor padding (ceil(n_i / N) for 100 tensors), N = 1 has no whole copies
    s3 = (TENSORS - 1) * np.ceil(tensor / n) + np.ceil((p - (TENSORS - 1) * tensor) / n)

    master0 = np.where(mixed, 4 * p, 0)
    res0 = b * p + master0 + k * p
    res12 = b * padded + (4 + k) * s
    res3 = (b + 4 + k + b) * s3 + c * reduce_bucket_size
    resident = _by_stage(stage, shape, res0, res12, res3)

    # phases (see zerocalc.peak): init, backward end, step; forward/backward starts add activations only
    peak0, code0 = _peak([res0 + np.where(mixed, 4 * p, -k * p), res0,
                          res0 + b * p + b * np.minimum(p, MEMORY_OPT_ALLREDUCE_SIZE),
                          res0 + b * p + np.where(mixed, 8 * p, 0)])
    ph12_init = res12 - k * s + b * p + np.where(n == 1, b * s, 0)
    largest = p - (TENSORS - 1) * tensor
    r = reduce_bucket_size   # the ipg buffer is reduce_bucket_size elements whatever P is
    bwd1 = res12 + b * np.maximum(p, np.maximum(p - r, 0) + g_in) + c * r
    bwd2 = res12 + b * g_in * np.where(gas > 1, 2, 1) + b * largest + c * r
    peak12, code12 = _peak([ph12_init, res12, np.where(stage == 1, bwd1, bwd2),
                            res12 + b * g_in + b * s + np.where(mixed, 4 * s, 0)])
    # stage 3 at N > 1: the replay's fractions, per model size
    kept_frac, gathered_frac = np.zeros_like(p), np.zeros_like(p)
    is3 = (stage == 3) & (n > 1)
    if is3.any():
        if isinstance(g, Grid):       # every size has stage-3 points at N > 1
            keys, inverse = np.unique(p, return_inverse=True)
            table = np.array([_kept_and_gathered(int(a)) for a in keys])
            kept_frac, gathered_frac = (table[inverse.ravel(), i].reshape(p.shape) for i in (0, 1))
        else:
            keys, inverse = np.unique(p[is3], return_inverse=True)
            table = np.array([_kept_and_gathered(int(a)) for a in keys])
            kept_frac[is3], gathered_frac[is3] = table[inverse.ravel(), 0], table[inverse.ravel(), 1]
    kept_frac, gathered_frac = np.where(n > 1, kept_frac, 0), np.where(n > 1, gathered_frac, 0)
    fetch = np.where(n > 1, 2 * b * np.minimum(50_000_000, largest), 0)
    sub = np.minimum(sub_group_size, s3)
    kept = b * kept_frac * p
    peak3, code3 = _peak([res3 - k * s3 + b * largest * np.minimum(n, 2), res3 + kept + fetch,
                          res3 + b * largest + kept + c * np.minimum(reduce_bucket_size, n * s3),
                          res3 + (b + 4) * sub])
    peak = _by_stage(stage, shape, peak0, peak12, peak3)
    peak_phase = _by_stage(stage, shape, code0, code12, code3)

    # logged communication per optimizer step (zerocalc.comm)
    comm0 = c * p + np.where(mixed, 0, 4)
    small12 = 4 + np.where(mixed, 1, 0)
    comm12 = np.where(stage == 2, gas, 1) * c * p + np.where(n > 1, b * s, 0) + small12
    groups = np.maximum(1, np.ceil(s3 / sub_group_size))
    gathered = b * gathered_frac * p / n      # per-rank shards all-gathered per micro-step
    comm3 = np.where(n > 1, gas * gathered, 0) + gas * c * n * s3 + 8 * groups
    comm = _by_stage(stage, shape, comm0, comm12, comm3)
    ring = (n - 1) / n
    wire0 = 2 * ring * c * p
    wire12 = np.where(stage == 2, gas, 1) * 2 * ring * c * p + (n - 1) * b * s
    wire3 = gas * ((n - 1) * gathered + ring * c * n * s3)
    wire = _by_stage(stage, shape, wire0, wire12, wire3)
    out = {"resident_bytes": resident, "peak_bytes": peak, "peak_phase": peak_phase,
           "comm_bytes": comm, "wire_bytes": wire, "volume_over_params": wire / (p * c)}
    return {name: np.broadcast_to(v, shape).ravel() for name, v in out.items()}


def _whole_bytes(out: dict) -> dict:
    """`evaluate`'s columns with the byte counts as integers (a ring's (N-1)/N share rounded to the byte)."""
    return {k: np.rint(v).astype(np.int64) if k.endswith("_bytes") else v for k, v in out.items()}


def table(g, out: dict) -> dict:
    """The sweep's columns in order, as flat arrays: the axes and byte counts (integers), then the
    others of `evaluate`, with the peak phase by name."""
    cols = {k: g[k].astype(np.int64) for k in AXES}
    cols.update(_whole_bytes(out))
    cols["peak_phase"] = PHASES[out["peak_phase"]]
    return cols


def sweep(**axes):
    """One row per grid point: the axes, then `evaluate`'s columns. A pandas DataFrame, with
    `peak_phase` categorical (the phase names), where pandas is installed (it is not one of
    zerocalc's own dependencies); else `table`'s dict of numpy arrays."""
    options = {k: axes.pop(k) for k in ("optimizer_state_bytes", "reduce_bucket_size", "sub_group_size") if k in axes}
    g = grid(**axes)
    out = evaluate(g, **options)
    try:
        import pandas as pd
    except ImportError:
        return table(g, out)
    frame = {k: g[k].astype(np.int64) for k in AXES}
    frame.update(_whole_bytes(out))
    frame["peak_phase"] = pd.Categorical.from_codes(out["peak_phase"], PHASES)
    return pd.DataFrame(frame)


def of_model(model, optimizer_state_bytes: int = 8, **axes) -> tuple[dict, dict]:
    """A model described by its tensors (a named model, its LoRA adapters or frozen modules:
    `ModelSpec.trainable`), over the grid's other axes: each point `estimate`'s own numbers without
    activations, as the P-only sweep has them, point by point (a model's tensors are not 100 equal
    ones, and a frozen one's gradients, masters and moments are of the trained tensors only). (g, out)
    as `grid` and `evaluate` give them, for `table` and `calibrated_columns`; out also holds
    `trainable_params`."""
    from zerocalc.estimate import estimate
    from zerocalc.training import OPTIMIZERS, Stage
    optimizer = next(o for o in OPTIMIZERS.values() if o.state_bytes_per_param == optimizer_state_bytes)
    dtypes = {2: "bf16", 4: "fp32"}     # param_bytes: fp16's rows are bf16's (the sweep's --dtype)
    g = grid(num_params=[model.num_params], **axes)
    points = [g[k] for k in AXES]
    names = ("resident_bytes", "peak_bytes", "comm_bytes", "wire_bytes", "volume_over_params")
    out = {"trainable_params": np.full(len(points[0]), model.num_trainable, dtype=np.int64)}
    out.update({k: np.empty(len(points[0])) for k in names})
    out["peak_phase"] = np.empty(len(points[0]), dtype=np.int8)
    for i, (_, n, stage, b, gas) in enumerate(zip(*points)):
        setup = Setup(stage=Stage(int(stage)), dp=int(n), dtype=dtypes[int(b)], optimizer=optimizer, gas=int(gas))
        e = estimate(model, setup, simulate=False)
        for k, v in zip(names, (e.states.resident_bytes, e.peak_bytes, e.comm_bytes, e.comm_wire_bytes,
                                e.comm_volume_over_params)):
            out[k][i] = v
        out["peak_phase"][i] = list(PHASES).index(e.peak.name)
    return g, out


def calibrated_columns(g, out: dict, cal: dict, hw=None) -> dict:
    """Columns that need a calibration (and a GPU): `reserved_bytes`, the peak times the calibration's
    reserved/allocated ratio, as `Estimate.peak_reserved_bytes` has it where no allocation sequence is
    simulated (never for a P-only model); with `hw`, `comm_s`: the wire bytes at the link's speed
    (`timing.link_bytes_per_s`: NVLink while N fits one node, the network across nodes) times its
    calibrated efficiency (`timing.link_efficiency`), hidden or not, as `StepTime.comm_s`."""
    a = cal.get("allocator", {"reserved_over_allocated": 1.0})
    cols = {"reserved_bytes": np.floor(out["peak_bytes"] * a["reserved_over_allocated"]
                                       + a.get("reserved_extra_bytes", 0)).astype(np.int64)}
    if hw is not None:
        from zerocalc.timing import link_efficiency
        across = g["dp"] > hw.gpus_per_node
        k = cal["time"]
        rate = np.where(across, hw.inter_node_bytes_per_s * link_efficiency({"inter_node": 1}, k),
                        hw.intra_node_bytes_per_s * link_efficiency({"inter_node": 0}, k))
        cols["comm_s"] = out["wire_bytes"] / rate
    return cols
