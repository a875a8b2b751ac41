"""Millions of configurations at once: the P-only closed forms of `states`, `peak` and `comm`,
vectorized with numpy over a grid, returned as a pandas DataFrame.

The model is the one `estimate` uses for `--params` (100 equal tensors, Adam-family or SGD state,
default buckets; param_bytes 2 is bf16, 4 is fp32). The sweep treats padding in closed form, so the
tensors a rank's shard touches may differ from `estimate`'s by one: `tests/test_sweep.py` holds every
column to `estimate` within 1%. Activations and step time need an architecture: use `estimate` or
`plan`.
"""
from functools import lru_cache

import numpy as np

from zerocalc import stage3_trace
from zerocalc.comm import MEMORY_OPT_ALLREDUCE_SIZE
from zerocalc.model import from_params
from zerocalc.training import Setup

TENSORS = 100                 # `zerocalc.arch.uniform_params`
AXES = ("num_params", "dp", "stage", "param_bytes", "gas")
PHASES = np.array(["init", "forward", "backward", "step"])


def grid(**axes) -> dict:
    """The Cartesian product of the given axes (each a list), flattened into equal-length arrays."""
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown sweep axes {sorted(unknown)}; use {', '.join(AXES)}")
    defaults = {"dp": [1], "stage": [0, 1, 2, 3], "param_bytes": [2], "gas": [1]}
    values = [np.asarray(axes.get(k, defaults.get(k)), dtype=np.float64) for k in AXES]
    mesh = np.meshgrid(*values, indexing="ij")
    return {k: m.ravel() for k, m in zip(AXES, mesh)}


@lru_cache(maxsize=4096)
def _kept_and_gathered(num_params: int) -> tuple[float, float]:
    """Stage-3 replay for a P-only model: (kept gathered after forward, all-gathered in a micro-step) as
    fractions of P; for 100 equal tensors these do not depend on N (replayed at N = 2). A parameter
    released in forward may be prefetched again before backward starts, so only the sum of forward
    and backward gathers is meaningful."""
    it = stage3_trace.simulate(from_params(num_params), Setup(dp=2))
    gathered = (it.forward_gather_elements + it.backward_gather_elements) * 2 / num_params
    return it.kept_after_forward_elements / num_params, gathered


def evaluate(g: dict, optimizer_state_bytes: int = 8, reduce_bucket_size: int = 500_000_000,
             sub_group_size: int = 1_000_000_000) -> dict:
    """Per-rank bytes and communication for every point of the grid (all arrays)."""
    p, n, stage, b, gas = g["num_params"], g["dp"], g["stage"], g["param_bytes"], g["gas"]
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
    resident = np.select([stage == 0, stage < 3], [res0, res12], res3)

    # phases (see zerocalc.peak): init, backward end, step; forward/backward starts add activations only
    ph0 = np.stack([res0 + np.where(mixed, 4 * p, -k * p), res0, res0 + b * p + b * np.minimum(p, MEMORY_OPT_ALLREDUCE_SIZE),
                    res0 + b * p + np.where(mixed, 8 * p, 0)])
    ph12_init = res12 - k * s + b * p + np.where(n == 1, b * s, 0)
    largest = p - (TENSORS - 1) * tensor
    r = reduce_bucket_size   # the ipg buffer is reduce_bucket_size elements whatever P is
    bwd1 = res12 + b * np.maximum(p, np.maximum(p - r, 0) + g_in) + c * r
    bwd2 = res12 + b * g_in * np.where(gas > 1, 2, 1) + b * largest + c * r
    ph12 = np.stack([ph12_init, res12, np.where(stage == 1, bwd1, bwd2),
                     res12 + b * g_in + b * s + np.where(mixed, 4 * s, 0)])
    kept_frac, gathered_frac = np.zeros_like(p), np.zeros_like(p)
    is3 = (stage == 3) & (n > 1)
    if is3.any():
        keys, inverse = np.unique(p[is3], return_inverse=True)
        table = np.array([_kept_and_gathered(int(a)) for a in keys])
        kept_frac[is3], gathered_frac[is3] = table[inverse.ravel(), 0], table[inverse.ravel(), 1]
    fetch = np.where(n > 1, 2 * b * np.minimum(50_000_000, largest), 0)
    sub = np.minimum(sub_group_size, s3)
    kept = b * kept_frac * p
    ph3 = np.stack([res3 - k * s3 + b * largest * np.minimum(n, 2), res3 + kept + fetch,
                    res3 + b * largest + kept + c * np.minimum(reduce_bucket_size, n * s3), res3 + (b + 4) * sub])
    phases = np.select([stage == 0, stage < 3], [ph0, ph12], ph3)
    peak_phase = phases.argmax(axis=0)
    peak = phases.max(axis=0)

    # logged communication per optimizer step (zerocalc.comm)
    comm0 = c * p + np.where(mixed, 0, 4)
    small12 = 4 + np.where(mixed, 1, 0)
    comm12 = np.where(stage == 2, gas, 1) * c * p + np.where(n > 1, b * s, 0) + small12
    groups = np.maximum(1, np.ceil(s3 / sub_group_size))
    gathered = b * gathered_frac * p / n      # per-rank shards all-gathered per micro-step
    comm3 = np.where(n > 1, gas * gathered, 0) + gas * c * n * s3 + 8 * groups
    comm = np.select([stage == 0, stage < 3], [comm0, comm12], comm3)
    ring = (n - 1) / n
    wire0 = 2 * ring * c * p
    wire12 = np.where(stage == 2, gas, 1) * 2 * ring * c * p + (n - 1) * b * s
    wire3 = gas * ((n - 1) * gathered + ring * c * n * s3)
    wire = np.select([stage == 0, stage < 3], [wire0, wire12], wire3)
    return {"resident_bytes": resident, "peak_bytes": peak, "peak_phase": PHASES[peak_phase],
            "comm_bytes": comm, "wire_bytes": wire, "volume_over_params": wire / (p * c)}


def sweep(**axes):
    """A DataFrame with one row per grid point: the axes, then `evaluate`'s columns."""
    import pandas as pd
    options = {k: axes.pop(k) for k in ("optimizer_state_bytes", "reduce_bucket_size", "sub_group_size") if k in axes}
    g = grid(**axes)
    out = evaluate(g, **options)
    frame = {k: g[k].astype(np.int64) for k in AXES}
    frame.update(out)
    return pd.DataFrame(frame)
