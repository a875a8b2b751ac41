"""One estimate: model states, peak and communication for a model and a setup."""
from dataclasses import dataclass, replace
from functools import cached_property

from zerocalc import activations, calibration, comm, host, peak, reference, states, timing
from zerocalc.hardware import Hardware
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage, validate_setup

__all__ = ["COMMON_GPU_MEMORY", "Estimate", "estimate"]

# The usual per-GPU memories, as nvidia-smi reports them (16-80 GB cards hold that many GiB; the
# H200 143,771 MiB, as `hardware.PRESETS`): where no --gpu-memory is given, an estimate says the
# smallest of them it fits on.
COMMON_GPU_MEMORY = {"16 GB": 16 * 2**30, "24 GB": 24 * 2**30, "32 GB": 32 * 2**30, "40 GB": 40 * 2**30,
                     "48 GB": 48 * 2**30, "80 GB": 80 * 2**30, "141 GB": 143771 * 2**20}


@dataclass(frozen=True)
class Estimate:
    model: ModelSpec
    setup: Setup
    states: states.StateBytes
    phases: tuple[peak.Phase, ...]
    collectives: tuple[comm.Collective, ...]
    gpu_memory_bytes: int | None = None
    calibration: dict | None = None
    hardware: "Hardware | None" = None
    simulate: bool = True             # replay the allocation sequence for reserved where one is generated
    host_memory_bytes: int | None = None   # the host's memory per node, for the host side of `fits`
    ranks_per_node: int | None = None      # ranks sharing one host (None: all N on one)
    # The ranks whose replays decide the verdict on a card and its headroom: None for every rank that can
    # run out first (`sequence.simulated_ranks`), a real job's; one rank for a job of which that rank alone
    # runs (a fake world's, `validate run --fake-world --fake-rank`).
    ranks: tuple[int, ...] | None = None

    @cached_property   # frozen: found once (`plan` asks each candidate's peak several times)
    def peak(self) -> peak.Phase:
        """The phase of the peak: the simulation's where it reached its allocated peak before the first
        step (stage 3 built outside zero.Init holds the whole model first), else the largest sum's."""
        simulation = self._simulation
        if simulation is None or not simulation[0].at_init:
            return peak.peak(self.phases)
        init = self.phases[0]
        if self.setup.stage == Stage.PARAMETERS and not self.setup.zero_init and self.setup.offload_param == "none":
            return replace(init, why="the whole model on the device before the engine partitions it "
                                     "(built outside zero.Init; --zero-init builds it partitioned)")
        return init

    @property
    def peak_bytes(self) -> int:
        """Predicted `torch.cuda.max_memory_allocated()`: the allocation sequence's through the
        allocator simulation where one is generated (whole blocks, as torch counts them: on the
        H200 rows it is within 3.5% where the phases' sums miss stage 3 initialised whole by up to
        63%, docs/accuracy.md), else the largest phase's sum (`peak`)."""
        simulated = self.simulated_peaks_bytes
        return self.peak.total_bytes if simulated is None else simulated[0]

    @property
    def activation_bytes(self) -> int | None:
        """Activations at their largest (the start of backward), None without an architecture."""
        act = activations.breakdown(self.model, self.setup, self.calibration)
        return None if act is None else act.backward_peak_bytes

    @property
    def comm_bytes(self) -> int:
        return comm.total_bytes(self.collectives)

    @property
    def comm_wire_bytes(self) -> int:
        return comm.total_wire_bytes(self.collectives)

    @property
    def comm_volume_over_params(self) -> float:
        """Ring wire volume per rank over P · comm dtype bytes (0 at N = 1)."""
        s = self.setup
        return self.comm_wire_bytes / (self.model.num_params * s.comm_bytes) if s.dp > 1 else 0.0

    @property
    def cal(self) -> dict:
        return self.calibration or calibration.default()

    @property
    def allocator(self) -> dict:
        """The calibrated allocator overhead where the allocation sequence is not simulated:
        `allocator_param_offload` with stage 3's parameter offload (whose whole-module init leaves
        1.43-1.75× cached on H200), else `allocator`, each fitted on its own rows (a calibration
        without one falls back to `allocator`); under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
        times `allocator_expandable`'s factor (H200: 0.84, the mean over six configurations run with
        both allocators), with that allocator's worst measured ratio."""
        default = self.cal.get("allocator", {"reserved_over_allocated": 1.0, "reserved_extra_bytes": 0})
        base = self.cal.get("allocator_param_offload", default) if self.setup.offload_param != "none" else default
        expandable = self.cal.get("allocator_expandable")
        if not self.setup.expandable_segments or expandable is None:
            return base
        return {**base, "reserved_over_allocated": base["reserved_over_allocated"] * expandable["factor"],
                "reserved_over_allocated_worst": expandable["reserved_over_allocated_worst"]}

    @property
    def simulated_peaks_bytes(self) -> tuple[int, int] | None:
        """(`max_memory_allocated()`, `max_memory_reserved()`) of the generated allocation sequence
        replayed through PyTorch's caching allocator (`zerocalc.sequence`, `zerocalc.allocator`); None
        where no sequence is generated (see `sequence.generated`: e.g. no architecture) or simulate is
        off. Milliseconds for a 7B model, ~0.1 s for a 70B one: `plan` ranks with the ratio instead."""
        return None if self._simulation is None else tuple(self._simulation[0][:2])

    @property
    def simulated_reserved_bytes(self) -> int | None:
        simulated = self.simulated_peaks_bytes
        return None if simulated is None else simulated[1]

    @cached_property
    def _simulation(self) -> tuple | None:
        """(the unbounded replay's (allocated, reserved) peaks, the replay against the card where the
        verdict needs it (`at_capacity`), else None); None where not simulated. The job is made over
        three steps for the unbounded replay and, near the card, again over `fits.CARD_STEPS` for every
        rank and timing (`fits.near_card`); each is dropped before the cycle collector runs again (kept,
        it would be walked by every collection)."""
        if not self.simulate or self.model.architecture is None:   # no sequence without one: a P-only run
            return None                                              # never imports the simulation
        from zerocalc import sequence
        if self.gpu_memory_bytes is None or not sequence.generated(self.model, self.setup):
            peaks = sequence.peaks_bytes(self.model, self.setup, ranks=self.ranks)
            return None if peaks is None else (peaks, None)
        from zerocalc import fits
        expandable, capacity = self.setup.expandable_segments, self.device_capacity_bytes
        with sequence.cycle_collector_paused():
            jobs = fits.job_pieces(self.model, self.setup, self.ranks)
            peaks = fits.unbounded_peaks_bytes(jobs, expandable)
            near = peaks[1] * fits.LATE_REPLAY_MARGIN > capacity   # near the card: every rank and timing
            if near:
                jobs = fits.near_card(self.model, self.setup, self.ranks)
            at = fits.at_capacity(jobs, expandable, capacity) if near else None
            del jobs
        return peaks, at

    @cached_property
    def peak_reserved_late_bytes(self) -> int | None:
        """Reserved where the GPU returns released gathered parameters late: the simulated ranks' jobs
        replayed with the all-gather stream's frees `fits.LATE_RESERVED_DELAY` allocations after their
        release (`fits.late_frees`). Stage 3 at N > 1 only, where simulated; None elsewhere. Every
        stage-3 row measured at N >= 8 lies within 8% of the band between this and `peak_reserved_bytes`
        (tests/test_fake_world.py, docs/scale.md): which end a run reaches is its timing."""
        if self.setup.stage != Stage.PARAMETERS or self.setup.dp == 1 or self.simulated_reserved_bytes is None:
            return None
        from zerocalc import fits, sequence
        with sequence.cycle_collector_paused():
            late = tuple((r, fits.LATE_RESERVED_DELAY, fits.late_frees(pieces, fits.LATE_RESERVED_DELAY))
                         for r, _, pieces in fits.job_pieces(self.model, self.setup, self.ranks))
            return fits.unbounded_peaks_bytes(late, self.setup.expandable_segments, every_timing=True)[1]

    @property
    def reserved_source(self) -> str:
        """How `peak_reserved_bytes` was predicted: "simulated" (the allocation sequence through the
        allocator) or "ratio" (peak allocated times the calibrated reserved/allocated ratio)."""
        return "ratio" if self.simulated_reserved_bytes is None else "simulated"

    @cached_property
    def peak_reserved_bytes(self) -> int:
        """Predicted `torch.cuda.max_memory_reserved()` in a fresh process: simulated where the
        allocation sequence is generated, else the caching allocator's blocks around the peak as a
        calibrated ratio to it (`python -m validate fit`)."""
        if self.simulated_reserved_bytes is not None:   # never below its allocated peak, `peak_bytes`
            return self.simulated_reserved_bytes
        a = self.allocator
        return int(self.peak_bytes * a["reserved_over_allocated"] + a.get("reserved_extra_bytes", 0))

    @property
    def peak_reserved_worst_bytes(self) -> int:
        """Reserved at the worst the prediction has missed by on the fitting rows: where simulated, the
        simulation times its largest measured/simulated (`allocator_simulated`, H200: 1.08); else the
        worst reserved/allocated ratio measured on the fitting rows of this allocator setting (H200:
        1.73 by default, stage 3 with parameter offload and checkpointing; 1.36 with expandable
        segments), which one fitted ratio cannot follow (README, "How far to trust it")."""
        if self.simulated_reserved_bytes is not None:
            worst = self.cal.get("allocator_simulated", {}).get("measured_over_simulated_worst", 1.0)
            return max(self.peak_reserved_bytes, int(self.simulated_reserved_bytes * max(worst, 1.0)))
        return max(self.peak_reserved_bytes,
                   int(self.peak_bytes * self.allocator.get("reserved_over_allocated_worst", 1.0)))

    @property
    def device_bytes(self) -> int:
        """What the GPU must hold: reserved peak + CUDA context, NCCL and library workspaces."""
        return self.peak_reserved_bytes + self.context_bytes

    @property
    def device_worst_bytes(self) -> int:
        return self.peak_reserved_worst_bytes + self.context_bytes

    @property
    def context_bytes(self) -> int:
        """The CUDA context, NCCL and library workspaces beside the caching allocator (calibrated)."""
        return self.cal.get("device", {}).get("context_bytes", 0)

    @property
    def device_capacity_bytes(self) -> int | None:
        """What the card leaves the caching allocator: its memory less `context_bytes`."""
        return None if self.gpu_memory_bytes is None else self.gpu_memory_bytes - self.context_bytes

    @property
    def fits_source(self) -> str | None:
        """How `fits_device` is decided: "allocator" where the allocation sequence is simulated (the
        caching allocator's verdict on the card, retries included), "ratio" elsewhere (the reserved
        prediction, allocated × a measured ratio, against the card); None without a card."""
        if self.gpu_memory_bytes is None:
            return None
        return "ratio" if self.simulated_reserved_bytes is None else "allocator"

    @property
    def _replayed_at_capacity(self) -> bool:
        """Whether the verdict needs the sequence replayed against the card: simulated, and its
        reserved past the capacity under some timing of the frees (at or under it no cudaMalloc fails
        and nothing is retried)."""
        if self.fits_source != "allocator":
            return False
        at = self._simulation[1]
        return self.peak_reserved_bytes > self.device_capacity_bytes or (at is not None and at.pressed)

    @property
    def at_capacity(self) -> "fits.AtCapacity | None":
        """The simulated ranks' jobs replayed against `device_capacity_bytes` (`zerocalc.fits`): OOM
        or not, and the allocator's retries; None where the verdict needs no such replay."""
        return self._simulation[1] if self._replayed_at_capacity else None

    @property
    def alloc_retries(self) -> int | None:
        """torch's num_alloc_retries on the card, where the allocator decides ("allocator",
        `fits_source`): the cache released to retry a cudaMalloc (0 where the reserved fits)."""
        if self.fits_source != "allocator":
            return None
        return self.at_capacity.alloc_retries if self.at_capacity else 0

    @property
    def fits_device(self) -> bool | None:
        """Whether the GPU holds the job. Simulated ("allocator", `fits_source`): its predicted
        allocated peak fits the capacity and the caching allocator runs the sequence there without
        OOM under every timing of stage 3's late frees, freeing its cache and retrying where a
        cudaMalloc fails as torch does (`zerocalc.fits`); where the unbounded replays' reserved fits,
        that is so without retries. Otherwise ("ratio"):
        `device_bytes` within the card."""
        if self.gpu_memory_bytes is None:
            return None
        if not self._replayed_at_capacity:
            return self.device_bytes <= self.gpu_memory_bytes
        return self.peak_bytes <= self.device_capacity_bytes and self.at_capacity.runs

    @cached_property
    def headroom_bytes(self) -> int | None:
        """How far the card is from the least it needs: capacity less the smallest capacity (2 MiB
        grid) at which the allocator runs the job without OOM and the predicted allocated peak fits;
        negative: short by that much. Where the unbounded reserved fits (`headroom_is_lower_bound`),
        capacity less it, a lower bound (the smallest capacity is at most that reserved), found
        without the bisection. By the ratio ("ratio"), the card less `device_bytes`."""
        if not self._replayed_at_capacity:
            return None if self.gpu_memory_bytes is None else self.gpu_memory_bytes - self.device_bytes
        from zerocalc import allocator, fits, sequence
        capacity, expandable, at = self.device_capacity_bytes, self.setup.expandable_segments, self.at_capacity
        with sequence.cycle_collector_paused():       # the job made again (`_simulation` dropped it)
            job = fits.near_card(self.model, self.setup, self.ranks)
            below = fits.least_allocated_bytes(job) - 1        # no capacity under the live requests runs
            if at.runs:
                smallest = fits.smallest_capacity_bytes(job, expandable, below, capacity)
            else:   # it runs at the unbounded reserved (every timing's); tried first: what the request it ran out on needed
                running = max(capacity + allocator.CAPACITY_GRID_BYTES,
                              fits.unbounded_peaks_bytes(job, expandable, every_timing=True)[1])
                smallest = fits.smallest_capacity_bytes(job, expandable, max(capacity, below), running,
                                                        at.oom.demand_bytes)
            del job
        return capacity - max(smallest, self.peak_bytes)

    @property
    def headroom_is_lower_bound(self) -> bool | None:
        """Whether `headroom_bytes` is the unbounded reserved's, a lower bound (see there)."""
        if self.gpu_memory_bytes is None:
            return None
        return self.fits_source == "allocator" and not self._replayed_at_capacity

    @cached_property
    def host(self) -> host.HostBytes:
        """The host bytes per rank over the job's life (`zerocalc.host`)."""
        return host.host_memory(self.model, self.setup, self.calibration)

    @property
    def host_ranks(self) -> int:
        return self.ranks_per_node or self.setup.dp

    @property
    def host_node_bytes(self) -> int:
        """The host's need per node: its ranks at their peak."""
        return self.host.node_bytes(self.host_ranks)

    @property
    def fits_host(self) -> bool | None:
        return None if self.host_memory_bytes is None else self.host_node_bytes <= self.host_memory_bytes

    @property
    def fits(self) -> bool | None:
        """Fits the GPU and, where the host's memory is given, the host; None where the GPU's is not given."""
        if self.fits_device is None:
            return None if self.fits_host is None else self.fits_host
        return self.fits_device and self.fits_host is not False

    @property
    def fails_on(self) -> list[str]:
        """Which side does not fit: "GPU", "host", both or none."""
        return [side for side, ok in (("GPU", self.fits_device), ("host", self.fits_host)) if ok is False]

    @property
    def fits_worst_case(self) -> bool | None:
        """Fits even at the worst allocator overhead measured: `device_worst_bytes` within the card.
        `fits` and not this means tight: within the prediction's worst measured miss, or (simulated)
        running only because the allocator frees its cache and retries (its unbounded reserved, so
        its worst too, past the card)."""
        if self.gpu_memory_bytes is None:
            return None
        return self.device_worst_bytes <= self.gpu_memory_bytes and self.fits_host is not False

    @property
    def fits_on(self) -> str | None:
        """The smallest of `COMMON_GPU_MEMORY` this fits on (device_bytes within it), None if none."""
        return next((name for name, size in COMMON_GPU_MEMORY.items() if self.device_bytes <= size), None)

    @property
    def fits_on_worst_case(self) -> str | None:
        """The smallest of `COMMON_GPU_MEMORY` this fits on at the worst allocator overhead measured."""
        return next((name for name, size in COMMON_GPU_MEMORY.items() if self.device_worst_bytes <= size), None)

    @cached_property
    def time(self) -> "timing.StepTime | None":
        if self.hardware is None:
            return None
        return timing.step_time(self.model, self.setup, self.collectives, self.hardware, self.cal)

    def per_rank_bytes(self) -> dict:
        st = self.states
        # At their largest in any moment of a phase (backward's worst moment may be the loss's, before
        # the gradients and the reduction's buffers exist), not only at each phase's worst moment.
        moments = [m for ph in self.phases for m in (ph.moments or (ph,))]
        # Buffers during training (init's one-time copies show in `phases`, not here).
        buffers = st.buffers_bytes + max(m.buffers_bytes for m in moments if m.name != "init")
        grads = max([st.largest_grads_bytes] + [m.grads_bytes for m in moments])
        parts = {"params": st.params_bytes, "gradients": grads,
                 "optimizer_states": st.optimizer_states_bytes, "buffers": buffers,
                 "activations": self.activation_bytes}
        parts["total"] = sum(v for v in parts.values() if v is not None)
        return parts

    def as_dict(self) -> dict:
        p, n, s = self.model.num_params, self.setup.dp, self.setup.stage
        return {
            "stage": int(s),
            "offload_optimizer": self.setup.offload_optimizer,
            "offload_param": self.setup.offload_param,
            "per_rank_bytes": self.per_rank_bytes(),
            "master_weights_bytes": self.states.master_bytes,
            "moments_bytes": self.states.moments_bytes,
            "resident_state_bytes": self.states.resident_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_reserved_source": self.reserved_source,
            "peak_reserved_worst_bytes": self.peak_reserved_worst_bytes,
            "device_bytes": self.device_bytes,
            "peak_phase": self.peak.name,
            "peak_why": self.peak.why,
            "phases": {ph.name: {"states_bytes": ph.states_bytes, "grads_bytes": ph.grads_bytes,
                                 "buffers_bytes": ph.buffers_bytes, "activation_bytes": ph.activation_bytes,
                                 "total_bytes": ph.total_bytes, "why": ph.why}
                       for ph in self.phases},
            "cpu_bytes": self.states.cpu_bytes,
            "host": {**self.host.as_dict(), "ranks_per_node": self.host_ranks, "node_bytes": self.host_node_bytes,
                     "host_memory_bytes": self.host_memory_bytes, "fits": self.fits_host},
            "comm": {
                "bytes_per_rank_per_step": self.comm_bytes,
                "wire_bytes_per_rank_per_step": self.comm_wire_bytes,
                "volume_over_params": self.comm_volume_over_params,
                "logged_over_param_bytes": self.comm_bytes / (p * self.setup.param_bytes),
                "collectives": [c.as_dict() for c in self.collectives],
            },
            "paper": {
                "model_states_bytes": reference.paper_model_states_bytes(p, n, s),
                "comm_volume_over_params": reference.paper_comm_volume_over_params(s),
            },
            "fits": self.fits,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "fails_on": self.fails_on,
            "fits_worst_case": self.fits_worst_case,
            "fits_on_gpu_memory_bytes": COMMON_GPU_MEMORY.get(self.fits_on),
            "fits_on_worst_case_gpu_memory_bytes": COMMON_GPU_MEMORY.get(self.fits_on_worst_case),
            "fits_source": self.fits_source,
            "device_capacity_bytes": self.device_capacity_bytes,
            "headroom_bytes": self.headroom_bytes,
            "headroom_is_lower_bound": self.headroom_is_lower_bound,
            "alloc_retries": self.alloc_retries,
            "oom": self.at_capacity.oom_dict() if self.at_capacity else None,
            "oom_depends_on_timing": bool(self.at_capacity and self.at_capacity.timing_dependent),
            "time": None if self.time is None else self.time.as_dict(),
        }


def estimate(model: ModelSpec, setup: Setup, gpu_memory_bytes: int | None = None,
             cal: dict | None = None, hardware: Hardware | None = None, simulate: bool = True,
             host_memory_bytes: int | None = None, ranks_per_node: int | None = None,
             ranks: tuple[int, ...] | None = None) -> Estimate:
    validate_setup(setup)
    st = states.model_states(model, setup)
    return Estimate(model, setup, st, peak.phases(model, setup, st, cal), comm.collectives(model, setup),
                    gpu_memory_bytes, cal, hardware, simulate, host_memory_bytes, ranks_per_node, ranks)
