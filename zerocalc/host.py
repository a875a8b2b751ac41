"""Host (CPU) memory per rank over a job's life, as DeepSpeed 0.19.8 and PyTorch really hold it.

What a rank's process holds on the host, in the order a job builds it (runtime, model build,
initialize, first step); the peak resident set (`VmHWM`) is the largest running total. Notation as in
`zerocalc.states`: P params (nᵢ each), N ranks, b the model dtype's bytes, g the gradient-accumulation
dtype's, K the optimizer's state bytes per parameter, S = Pp/N the stage-1/2 shard, S3 = Σ⌈nᵢ/N⌉ the
stage-3 one, S3_j its optimizer sub-groups.

Two rules the device side does not have: pinned memory is rounded up to a power of two by PyTorch's
caching host allocator and never given back (`pinned(x)` below), and a pinned copy is made from a
pageable one, so both exist for a moment. Every term with its DeepSpeed/PyTorch source, and the H200
rows it is checked against (`data/h200-host-*.csv`), is in docs/host-memory.md; the runtime
constants (`BASELINE_BYTES`, `TRANSFORMERS_BYTES`, `RUNTIME_GROWTH_BYTES`) are measured there.
NVMe offload (swap buffers only) is not measured.
"""
from dataclasses import dataclass
from functools import cached_property, lru_cache
from operator import attrgetter
from math import ceil

from zerocalc.model import ModelSpec
from zerocalc.partition import partition, sub_groups
from zerocalc.training import Setup, Stage

FP32 = 4
MiB = 2**20
# The process before the model is built: Python, torch with CUDA initialized, the NCCL process group and
# DeepSpeed imported. Measured at the start of each job on H200 (torch 2.11 cu130): 0.62 GiB in all 24
# rows of data/h200-host-{a,b,c,d}.csv (`measured_host_baseline_bytes`; 633-634 MiB).
BASELINE_BYTES = 634 * MiB
# transformers' import, paid when a Hugging Face model is built: the build phase's peak minus the fp32
# model and the baseline, 0.30 GiB on every Llama row (the GPT-2 rows add their untied head, below).
TRANSFORMERS_BYTES = 310 * MiB
# What the process grows by through initialize and the first step beyond the terms below (the CPU Adam
# extension, CUDA kernels and libraries loaded on first use, DeepSpeed's own structures): the resident
# set after the first step minus the baseline, transformers and the modelled buffers, median of the
# 24 H200 rows (0.95-1.50 GiB; fitted on them, not predicted).
RUNTIME_GROWTH_BYTES = 1111 * MiB
NVME_OPTIMIZER_BUFFER_COUNT = 4          # offload_optimizer.buffer_count default
NVME_PARAM_BUFFER_COUNT = 5              # offload_param.buffer_count default
NVME_PARAM_BUFFER_ELEMENTS = 100_000_000  # offload_param.buffer_size default


def pinned(nbytes: int) -> int:
    """What PyTorch's caching host allocator takes for a pinned request: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


@dataclass(frozen=True)
class Event:
    """The host at one moment of a job: what it holds then, by term."""
    phase: str                 # build, init, first_step
    what: str                  # the moment, with its DeepSpeed source
    terms: tuple[tuple[str, int], ...]

    @cached_property   # frozen: summed once (plan asks each candidate's peak several times)
    def bytes(self) -> int:
        return sum(v for _, v in self.terms)


@dataclass(frozen=True)
class HostBytes:
    events: tuple[Event, ...]
    pinned_bytes: int          # page-locked after initialize (rounded, cached blocks included)
    steady_bytes: int          # held after the first step
    nvme_bytes: int            # bytes kept on NVMe (offload device "nvme")

    @cached_property
    def peak_event(self) -> Event:
        return max(self.events, key=lambda e: e.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_event.bytes

    @property
    def peak_phase(self) -> str:
        return self.peak_event.phase

    def node_bytes(self, ranks_per_node: int) -> int:
        """The node's need: every rank on it at its peak (an upper bound: they peak at about the same
        moment, each in its own initialize). The ranks share no host buffers in DeepSpeed 0.19.8."""
        return ranks_per_node * self.peak_bytes

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "peak_at": self.peak_event.what,
                "peak_terms": dict(self.peak_event.terms), "pinned_bytes": self.pinned_bytes,
                "steady_bytes": self.steady_bytes, "nvme_bytes": self.nvme_bytes}


@lru_cache(maxsize=256)   # per model and N: plan asks at every candidate
def _pinned_partitions(numels: tuple[int, ...], n: int, b: int) -> int:
    """Each parameter's b-byte partition of ceil(nᵢ / N) elements, pinned one by one."""
    return sum(pinned(b * ceil(x / n)) for x in numels)


@lru_cache(maxsize=256)
def _partition_sub_groups(numels: tuple[int, ...], n: int, sub_group_size: int) -> tuple[int, ...]:
    """`partition.sub_groups` of the per-parameter partitions ceil(nᵢ / N)."""
    return tuple(sub_groups([ceil(x / n) for x in numels], sub_group_size))


def host_memory(model: ModelSpec, setup: Setup, cal: dict | None = None) -> HostBytes:
    """The host bytes per rank at each moment of a job that sets a candidate for the peak."""
    k_host = (cal or {}).get("host", {})
    base = int(k_host.get("baseline_bytes", BASELINE_BYTES))
    growth = int(k_host.get("runtime_growth_bytes", RUNTIME_GROWTH_BYTES))
    a = model.architecture
    if a is not None and a.family.startswith("hf-"):
        base += int(k_host.get("transformers_bytes", TRANSFORMERS_BYTES))
    return _kept(model, _host_key(setup), base, growth)


# What the host side reads of a setup: not the micro-batch, sequence length, checkpointing or anything
# else of the device side, and of the accumulation steps only whether there are several at stage 2.
# `plan`'s candidates that differ in those alone (a dozen per GPU count, stage and offload) share one
# answer; the key is a plain tuple because `plan` looks it up about a thousand times.
HOST_FIELDS = ("stage", "dp", "dtype", "optimizer", "grad_accum_dtype", "param_persistence_threshold",
               "model_persistence_threshold", "sub_group_size", "offload_optimizer", "offload_param", "zero_init")
_host_fields = attrgetter(*HOST_FIELDS)


def _host_key(setup: Setup) -> tuple:
    return (*_host_fields(setup), min(setup.gas, 2) if setup.stage == Stage.GRADIENTS else 1)


@lru_cache(maxsize=256)
def _kept(model: ModelSpec, key: tuple, base: int, growth: int) -> HostBytes:
    return host_bytes(model, Setup(**dict(zip(HOST_FIELDS + ("gas",), key))), base, growth)


def host_bytes(model: ModelSpec, setup: Setup, base: int, growth: int) -> HostBytes:
    """`host_memory` with the runtime's bytes resolved: `base` before the model is built (transformers'
    import included where the model is a Hugging Face one), `growth` what initialize and the first step add."""
    a = model.architecture
    untied_head = FP32 * a.vocab_size * a.hidden_size if a is not None and a.tie_embeddings else 0
    p, b, g, n = model.num_params, setup.param_bytes, setup.grad_accum_bytes, setup.dp
    k = setup.optimizer.state_bytes_per_param
    buffers = sum(model.buffer_numels) * FP32
    part = partition(model.param_numels, setup)
    tpart = partition(model.trainable_numels, setup)   # what the optimizer holds: the trained tensors'
    trained = model.trainable_numels
    # Stages 1-2 offload to host memory whatever the device (stage_1_and_2.py: any device but "none")
    staged = setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS)
    opt_cpu = setup.offload_optimizer == "cpu" or (staged and setup.offload_optimizer == "nvme")
    opt_nvme = setup.offload_optimizer == "nvme" and not staged
    par_cpu = setup.offload_param == "cpu" and setup.stage == Stage.PARAMETERS
    par_nvme = setup.offload_param == "nvme" and setup.stage == Stage.PARAMETERS
    zero_init = setup.zero_init and setup.stage == Stage.PARAMETERS
    events = []

    def at(phase, what, **terms):
        runtime = (("runtime", base),) + ((("runtime_growth", growth),) if phase != "build" else ())
        events.append(Event(phase, what, runtime + tuple((k, v) for k, v in terms.items() if v)))

    # Build: the whole fp32 module, or under zero.Init one module's fp32 parameters at a time while the
    # partitions made so far stay (pinned on the host with parameter offload).
    per_param_pinned = _pinned_partitions(model.param_numels, n, b) if par_cpu else 0
    if zero_init:
        at("build", "model built under zero.Init (partition_parameters.py, _partition_param)",
           param_partitions_pinned=per_param_pinned, module_fp32=FP32 * model.largest_module_numel)
    else:
        at("build", "fp32 model built on the CPU (a tied head made before it is tied)",
           model_fp32=FP32 * p + buffers, untied_head=untied_head)
        if b != FP32:
            at("init", "engine casts the module to the training dtype on the CPU (_cast_module_mixed_precision)",
               model_fp32=FP32 * p + buffers, cast_copy=b * model.largest_param_numel)
    held = {}          # what initialize leaves on the host, by term
    if setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS) and opt_cpu:
        s = tpart.flat_shard
        at("init", "fp32 master pinned from its pageable copy (weights_partition)",
           master_pageable=FP32 * s, master_pinned=pinned(FP32 * s))
        held["master_pinned"] = pinned(FP32 * s)
        at("init", "16-bit upload buffer pinned (param_buffer_of_bit16_for_cpu_offload_groups)",
           **held, bit16_pageable=b * s, bit16_pinned=pinned(b * s))
        held["bit16_pinned"] = pinned(b * s)
        held["grad_staging_pinned"] = pinned(b * model.largest_trainable_numel)    # temp_grad_buffer_for_cpu_offload
        at("init", "fp32 gradient partition pinned (initialize_optimizer_states)",
           **held, grads_pageable=FP32 * s, grads_pinned=pinned(FP32 * s))
        held["grads_pinned"] = pinned(FP32 * s)
        if setup.stage == Stage.GRADIENTS and setup.gas > 1:
            # accumulated_grads_in_cpu: one pinned b·nᵢ buffer per parameter of the shard (at N = 1 all)
            held["accumulate_pinned"] = sum(pinned(b * x) for x in trained[:max(1, len(trained) // n)])
        moments = k * s
    elif setup.stage == Stage.PARAMETERS and (opt_cpu or par_cpu or opt_nvme or par_nvme):
        s3, s3_t = part.stage3_shard, tpart.stage3_shard
        if par_cpu:
            held["param_partitions_pinned"] = per_param_pinned       # cached after the copy below
            held["param_flat_pinned"] = pinned(b * s3)               # param_groups_fp16_flat_cpu_memory
            at("init", "parameter partitions pinned, then their flat buffer", **held)
        subs = list(_partition_sub_groups(trained, n, setup.sub_group_size))
        if opt_cpu:
            done = 0
            for j, sj in enumerate(subs):
                at("init", f"fp32 master of sub-group {j}: .to(cpu, fp32) and its clone (_create_fp32_partitions)",
                   **held, master_pageable=FP32 * done + 2 * FP32 * sj)
                done += sj
            held["master_pageable"] = FP32 * s3_t
            grads = 0
            for j, sj in enumerate(subs):
                at("init", f"fp32 gradient of sub-group {j} pinned (initialize_optimizer_states)",
                   **held, unused_gradient_buffer=FP32 * max(subs), grads_pinned=grads + pinned(FP32 * sj),
                   grads_pageable=FP32 * sj)
                grads += pinned(FP32 * sj)
            held["grads_pinned"] = grads
        if opt_cpu or opt_nvme:
            at("init", "gradient partitions pinned (grad_partitions_flat_buffer)",
               **held, grad_partitions_pageable=g * s3_t, grad_partitions_pinned=pinned(g * s3_t))
            held["grad_partitions_pinned"] = pinned(g * s3_t)
        if opt_nvme:
            held["nvme_swap_buffers_pinned"] = NVME_OPTIMIZER_BUFFER_COUNT * pinned(FP32 * max(subs))
        if par_nvme:
            held["nvme_param_buffers_pinned"] = NVME_PARAM_BUFFER_COUNT * pinned(b * NVME_PARAM_BUFFER_ELEMENTS)
        moments = k * s3_t if opt_cpu else 0
        if opt_cpu and not par_cpu and b != FP32:
            at("first_step", "fp32 master copied into the 16-bit partitions on the GPU, converted on the CPU "
               "first (_reassign_or_swap_out_partitioned_parameters)", **held, optimizer_states=moments,
               dtype_conversion=b * max(subs))
    else:
        moments = 0
    pinned_total = sum(v for t, v in held.items() if t.endswith("pinned"))
    at("first_step", "optimizer state made at the first step (DeepSpeedCPUAdam)", **held, optimizer_states=moments)
    steady = events[-1].bytes
    nvme = 0
    if setup.stage == Stage.PARAMETERS:
        nvme = ((FP32 + k) * tpart.stage3_shard if opt_nvme else 0) + (b * part.stage3_shard if par_nvme else 0)
    return HostBytes(tuple(events), pinned_total, steady, nvme)
