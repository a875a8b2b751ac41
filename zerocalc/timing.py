"""Step time per optimizer step: compute at a calibrated efficiency, the per-layer launch floor,
ZeRO-3's per-module hooks, the optimizer, and the communication an α–β ring model gives for the
logged collectives (`zerocalc.comm`), hidden by overlap where DeepSpeed overlaps it.

    compute   = GAS · max(FLOPs / (η · peak), L · t_launch · (3 + ckpt) + 2 · modules · t_module)
                the GPU's time, or the CPU's when launching kernels (and, at stage 3, running the
                fetch/release hooks of every module) cannot keep ahead of it
                FLOPs per micro-step = (6 + 2·ckpt) · P · T + 12 · L · h · s · T · (1 + ckpt/3)
                (6PT for forward + backward, the attention scores and values 12·L·h·s per token,
                recomputation with activation checkpointing; Kaplan et al. 2020, Korthikanti et al.
                2022 Table 2 for the attention term)
    optimizer = t_element · optimizer elements per rank + t_step
    comm      = Σ wire_bytes / (ε · link bandwidth) + calls · α
    exposed   = comm at stages 1/2 (overlap_comm off by default); at stage 3 what backward compute
                (2/3 of compute) does not hide
    offload   = optimizer offload: fp32 gradients down and parameters up over PCIe (4 + b bytes per
                optimizer element) plus DeepSpeedCPUAdam on the host; parameter offload: the
                parameters cross PCIe again in forward and backward (2·b per shard element per
                micro-step). From data sheets and an assumed CPU Adam rate: not measured yet.
T = micro-batch × sequence length tokens per micro-step per rank. The constants η, t_launch,
t_module, t_element, t_step, ε are fitted on H200 runs (`python -m validate fit`); on another GPU they
are assumed to carry over, which is a guess until it is measured.
"""
from dataclasses import dataclass

from zerocalc import calibration
from zerocalc.hardware import Hardware
from zerocalc.partition import partition
from zerocalc.training import Stage

ALPHA_S = 20e-6    # per-collective latency (NCCL launch + ring setup), a typical figure


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    hooks_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    comm_share: float

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "comm_share": self.comm_share, "compute_s": self.compute_s, "hooks_s": self.hooks_s,
                "optimizer_s": self.optimizer_s, "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "offload_s": self.offload_s}


def flops_per_micro_step(model, setup) -> float:
    a = model.architecture
    tokens, ck = setup.micro_batch * setup.seq_len, int(setup.activation_checkpointing)
    attention = 12 * a.num_layers * a.hidden_size * setup.seq_len * tokens * (1 + ck / 3)
    return (6 + 2 * ck) * model.num_params * tokens + attention


def optimizer_elements(model, setup) -> int:
    part = partition(model.param_numels, setup)
    if setup.stage == Stage.DISABLED:
        return part.num_params
    return part.flat_shard if setup.stage < Stage.PARAMETERS else part.stage3_shard


def link_bytes_per_s(setup, hw: Hardware) -> float:
    return hw.intra_node_bytes_per_s if setup.dp <= hw.gpus_per_node else hw.inter_node_bytes_per_s


def features(model, setup, collectives, hw: Hardware) -> dict:
    """The quantities the fitted constants multiply; `validate fit` regresses on them."""
    a = model.architecture
    wire = sum(c.wire_bytes for c in collectives)
    return {"flops_over_peak": flops_per_micro_step(model, setup) / hw.peak_flops_per_s,
            "launch_layers": a.num_layers * (3 + int(setup.activation_checkpointing)),
            "modules": len(model.trace) + len(model.backward(setup.activation_checkpointing))
            if setup.stage == Stage.PARAMETERS else 0,
            "optimizer_elements": optimizer_elements(model, setup),
            "wire_over_bandwidth": wire / link_bytes_per_s(setup, hw),
            "calls": sum(c.calls for c in collectives),
            "gas": setup.gas}


def step_time(model, setup, collectives, hw: Hardware, cal: dict | None = None) -> StepTime | None:
    if model.architecture is None or setup.seq_len is None:
        return None
    k = (cal or calibration.default())["time"]
    f = features(model, setup, collectives, hw)
    cpu = f["launch_layers"] * k["launch_s_per_layer"] + f["modules"] * k["module_hook_s"]
    compute = f["gas"] * max(f["flops_over_peak"] / k["efficiency"], cpu)
    hooks = f["gas"] * f["modules"] * k["module_hook_s"]   # part of compute's CPU side, reported apart
    optimizer = f["optimizer_elements"] * k["optimizer_s_per_element"] + k["step_overhead_s"]
    comm = f["wire_over_bandwidth"] / k["link_efficiency"] + f["calls"] * ALPHA_S if setup.dp > 1 else 0.0
    exposed = max(0.0, comm - 2 / 3 * compute) if setup.overlap else comm
    offload = 0.0
    if setup.offload_optimizer != "none":
        elements = f["optimizer_elements"]
        offload += (4 + setup.param_bytes) * elements / hw.pcie_bytes_per_s + elements / hw.cpu_adam_elements_per_s
        optimizer = 0.0   # the step runs on the host instead
    if setup.offload_param != "none":
        offload += f["gas"] * 2 * setup.param_bytes * f["optimizer_elements"] / hw.pcie_bytes_per_s
    step = compute + optimizer + exposed + offload
    tokens = setup.micro_batch * setup.seq_len * setup.gas * setup.dp
    mfu = 6 * model.num_params * tokens / (step * setup.dp * hw.peak_flops_per_s)
    return StepTime(compute, hooks, optimizer, comm, exposed, offload, step, tokens / step, mfu, exposed / step)
