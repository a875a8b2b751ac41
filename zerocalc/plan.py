"""`zerocalc plan`: every stage × offload × GPU count × micro-batch × accumulation × checkpointing that
fits the GPU and the host's memory, ranked by predicted throughput (or cost). Built on `estimate` (memory, communication)
and `timing` (step time); nothing new is modelled here. Candidates are judged with the calibrated
reserved/allocated ratio (hundreds of allocator simulations would take seconds); those shown (`top`,
and the one `--min-gpus` picks) are judged again as `estimate` judges them, its allocator simulation
included, so the two agree on every row shown: its GiB, fits and tight."""
from dataclasses import dataclass, replace

from zerocalc import host
from zerocalc.estimate import Estimate, estimate
from zerocalc.hardware import Hardware
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage, validate_setup

OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Space:
    """What `plan` may choose. A ds_config fixes what it sets (`from_ds_config`): its stage and offload,
    and its micro-batch and accumulation where they are numbers, not "auto"."""
    stages: tuple[Stage, ...] = tuple(Stage)
    offloads: tuple[tuple[str, str], ...] = OFFLOADS
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    gas: int | None = None        # fixed: only setups whose micro-batch × GPUs × gas is the global batch


def from_ds_config(ds) -> Space:
    """The choices a parsed ds_config (`dsconfig.DsConfig`) leaves to `plan`."""
    f = ds.fields
    return Space(stages=(Stage(f["stage"]),), offloads=((f["offload_optimizer"], f["offload_param"]),),
                 micro_batches=(ds.micro_batch,) if ds.micro_batch else MICRO_BATCHES, gas=ds.gas)


@dataclass(frozen=True)
class Candidate:
    setup: Setup
    estimate: Estimate | None
    rejected: str | None           # why it cannot run, None if it fits

    @property
    def tokens_per_s(self) -> float:
        return self.estimate.time.tokens_per_s if self.estimate and self.estimate.time else 0.0

    def cost_per_mtoken(self, price_per_gpu_hour: float) -> float:
        return price_per_gpu_hour * self.setup.dp / 3600 / self.tokens_per_s * 1e6 if self.tokens_per_s else float("inf")


def gpu_counts(min_gpus: int, max_gpus: int, gpus_per_node: int) -> list[int]:
    """Powers of two up to a node, then whole nodes in powers of two."""
    counts, n = [], 1
    while n <= max_gpus:
        if n >= min_gpus and (n <= gpus_per_node or n % gpus_per_node == 0):
            counts.append(n)
        n *= 2
    return counts


def rejection(e: Estimate, how: str = "") -> str | None:
    """Why an estimate cannot run, naming each side that does not fit; None if it fits. Where the
    allocator's replay against the card decided (`Estimate.at_capacity`), where it ran out."""
    reasons = []
    oom = e.at_capacity.oom if e.at_capacity is not None else None
    if e.fits_device is False and oom is not None:
        a = e.at_capacity
        rank = f", rank {a.oom_rank}" if a.oom_rank else ""
        late = (f", frees {a.oom_delay} allocations late" if a.oom_delay else "") + \
            (", new segments placed outside the ranges a retry freed" if a.oom_placement == "below" else "")
        reasons.append(f"allocator: OOM at {a.oom_phase} (event {oom.event}{rank}{late}): a {oom.segment_bytes / 2**30:.2f} "
                       f"GiB cudaMalloc with {oom.reserved_bytes / 2**30:.1f} "
                       f"GiB reserved, {oom.allocated_bytes / 2**30:.1f} allocated, after freeing the cache; "
                       f"{a.capacity_bytes / 2**30:.1f} GiB of {e.gpu_memory_bytes / 2**30:.1f} left to it")
    elif e.fits_device is False:
        reasons.append(f"needs {e.device_bytes / 2**30:.1f} GiB per GPU ({e.peak.name} peak{how}), has "
                       f"{e.gpu_memory_bytes / 2**30:.1f}")
    if e.fits_host is False:
        reasons.append(host_rejection(e.host, e.host_ranks, e.host_memory_bytes))
    return "; ".join(reasons) or None


def host_rejection(h: host.HostBytes, ranks: int, host_memory_bytes: int) -> str:
    return (f"needs {h.node_bytes(ranks) / 2**30:.1f} GiB of host memory per node ({ranks} ranks × "
            f"{h.peak_bytes / 2**30:.1f} GiB, {h.peak_phase} peak), has {host_memory_bytes / 2**30:.1f}")


def _batch(global_batch: int | None, micro: int, n: int, gas: int | None) -> tuple[int | None, str | None]:
    """(GAS, None) for micro-batch × N GPUs, or (None, why not). global_batch None: a fixed gas sets it."""
    if global_batch is None:
        return gas, None
    if global_batch % (micro * n):
        return None, f"global batch {global_batch} is not a multiple of micro-batch {micro} × {n} GPUs"
    if gas is not None and global_batch != micro * n * gas:
        return None, f"global batch {global_batch} is not micro-batch {micro} × {n} GPUs × the ds_config's GAS {gas}"
    return global_batch // (micro * n), None


def candidates(model: ModelSpec, hw: Hardware, base: Setup, global_batch: int | None, gpu_memory_bytes: int,
               min_gpus: int = 1, max_gpus: int = 8, cal: dict | None = None,
               host_memory_bytes: int | None = None, explain: bool = True, space: Space = Space()) -> list[Candidate]:
    """host_memory_bytes: the host's memory per node; a node holds min(N, GPUs per node) ranks.
    explain=False: a candidate its host cannot hold is rejected on that alone, its GPU side not
    estimated (estimate None, the reason the host's only), for a caller that shows no rejected
    candidate (`zerocalc plan` without --explain); the candidates that fit are the same.
    global_batch None: each GPU count's own, micro-batch × N × `space.gas` (a ds_config fixing both)."""
    if global_batch is None and space.gas is None:
        raise ValueError("a plan without a global batch needs a fixed gradient accumulation")
    out = []
    for n in gpu_counts(min_gpus, max_gpus, hw.gpus_per_node):
        for stage in space.stages:
            for offload_optimizer, offload_param in space.offloads:
                if (offload_optimizer != "none" and stage == Stage.DISABLED) or \
                        (offload_param != "none" and stage != Stage.PARAMETERS):
                    continue
                for micro in space.micro_batches:
                    for ckpt in (False, True):
                        gas, why = _batch(global_batch, micro, n, space.gas)
                        setup = replace(base, stage=stage, dp=n, micro_batch=micro, activation_checkpointing=ckpt,
                                        offload_optimizer=offload_optimizer, offload_param=offload_param,
                                        gas=gas or base.gas)
                        if why:
                            out.append(Candidate(setup, None, why))
                            continue
                        ranks = min(n, hw.gpus_per_node)
                        if not explain and host_memory_bytes is not None:
                            validate_setup(setup)
                            h = host.host_memory(model, setup, cal)
                            if h.node_bytes(ranks) > host_memory_bytes:
                                out.append(Candidate(setup, None, host_rejection(h, ranks, host_memory_bytes)))
                                continue
                        e = estimate(model, setup, gpu_memory_bytes, cal, hw, simulate=False, host_memory_bytes=
                                     host_memory_bytes, ranks_per_node=ranks)
                        out.append(Candidate(setup, e, rejection(e)))
    return out


def rank(cands: list[Candidate], price_per_gpu_hour: float | None = None) -> list[Candidate]:
    ok = [c for c in cands if c.rejected is None]
    if price_per_gpu_hour:
        return sorted(ok, key=lambda c: c.cost_per_mtoken(price_per_gpu_hour))
    return sorted(ok, key=lambda c: -c.tokens_per_s)


def judged(c: Candidate) -> Candidate:
    """The candidate as `estimate` judges it: the allocator simulation where it applies (which may
    reject what the ratio let through, or find room the ratio did not), its replay against the card
    where the simulated reserved exceeds it (`Estimate.fits_device`), fits and tight as it prints them."""
    e = c.estimate
    full = estimate(e.model, c.setup, e.gpu_memory_bytes, e.calibration, e.hardware,
                    host_memory_bytes=e.host_memory_bytes, ranks_per_node=e.ranks_per_node)
    return Candidate(c.setup, full, rejection(full, ", allocator simulated"))


def top(ranked: list[Candidate], n: int) -> tuple[list[Candidate], list[Candidate]]:
    """(the first n of `ranked` that fit by `estimate`'s judgement (`judged`), in rank order; those
    ranked above them that it rejected)."""
    shown, dropped = [], []
    for c in ranked:
        if len(shown) == n:
            break
        j = judged(c)
        (dropped if j.rejected else shown).append(j)
    return shown, dropped


def fewest_gpus(cands: list[Candidate]) -> Candidate | None:
    """The fastest candidate on the fewest GPUs that fits by `estimate`'s own judgement (`judged`)."""
    shown, _ = top(sorted((c for c in cands if c.rejected is None), key=lambda c: (c.setup.dp, -c.tokens_per_s)), 1)
    return shown[0] if shown else None
