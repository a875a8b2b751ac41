"""Step time per optimizer step, phase by phase as the validator times them (forward, backward,
optimizer step), each the slower of what the GPU must compute and what the host must issue, plus
what waits on communication:

    forward   = max(F_fwd / (η·peak) + (μ·M_layers + λ·M_loss) / hbm, host issue time) + gathers + wire
    backward  = the same with backward's FLOPs, traffic (μ_b, λ_b) and operators (and the recomputation;
                at stage 2 each gradient's copy into its bucket on the device, its hook on the host)
    step      = t_step[stage] + t_element[stage]·elements + t_tensor[stage]·n_tensors + wire
    step_s    = GAS·(forward + backward) + exposed reduction + step  (+ offload, + HF Trainer's loop)

The device's constants are measured on forwards and backwards run without DeepSpeed
(data/h200-kernel-time.jsonl), the rest fitted on H200 runs (`python -m validate fit`, calibration/h200.json)
and scaled to the host's launch cost (`host_scale`). Every term's derivation and the measurements behind
it: docs/step-time.md; the accuracy on the H200 rows: docs/accuracy.md.
"""
import json
import os
from dataclasses import dataclass, replace
from functools import lru_cache

from zerocalc import activations, calibration, stage3_trace
from zerocalc.hardware import Hardware
from zerocalc.partition import partition
from zerocalc.training import DTYPE_BYTES, Stage

STEP_CLASSES = ("stage0", "stage12", "stage3")


@dataclass(frozen=True)
class StepTime:
    forward_s: float         # per micro-step
    backward_s: float        # per micro-step
    optimizer_s: float       # the optimizer step (on the host with offload)
    comm_s: float            # all communication at link speed, hidden or not
    exposed_comm_s: float    # what the step waits for on communication: exposed_wire_s + gather_calls_s
    hooks_s: float           # stage 3's fetch/release hooks, host time per optimizer step
    offload_s: float         # offload's share of the above: gradients down, the host's step
    step_s: float
    tokens_per_s: float
    mfu: float
    comm_share: float        # exposed_comm_s / step_s
    # exposed_comm_s in its two parts: bytes crossing the link that nothing hides (W / (ε·link)), and
    # stage 3's per-call cost of its all-gathers (t_gather per call: the hook issuing each call on the
    # host and waiting for it), which a faster link would not shorten. Both are in step_s already.
    exposed_wire_s: float = 0.0
    gather_calls_s: float = 0.0
    trainer_s: float = 0.0   # HF Trainer's own loop per optimizer step (host, device idle); in step_s

    @property
    def wire_share(self) -> float:
        return self.exposed_wire_s / self.step_s

    @property
    def gather_calls_share(self) -> float:
        return self.gather_calls_s / self.step_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "wire_share": self.wire_share, "gather_calls_share": self.gather_calls_share}


def flops_per_micro_step(model, setup) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-step on one rank; backward includes recomputation.

    Recomputation is not one more forward (module docstring): it rebuilds the layers only (the head
    and the loss are not checkpointed), and stops before each layer's last matmul, the MLP's down
    projection, whose saved input is the last tensor the layer saves (torch.utils.checkpoint,
    non-reentrant, early stop on: checked on torch 2.13 CPU by tests/test_validate_models.py).
    A traced model's come from its profile (`traced_flops`)."""
    fwd, bwd = _full_flops_per_micro_step(model, setup)
    if model.frozen:
        # A frozen weight needs no weight gradient: backward drops that half of its work (≈ forward's
        # matmuls over the frozen share, P_f/P). An estimate; not yet held to measured LoRA steps.
        bwd -= fwd * model.num_frozen / model.num_params
    return fwd, bwd


def _full_flops_per_micro_step(model, setup) -> tuple[float, float]:
    a = model.architecture
    p = getattr(model, "profile", None)
    if p is not None and p.steps:   # (`step_counts` reads them)
        return traced_flops(step_counts(model, setup), a.num_layers, setup)
    tokens = setup.micro_batch * setup.seq_len
    attention = 4 * a.num_layers * a.hidden_size * setup.seq_len * tokens
    forward = 2 * (model.num_params - lookup_params(a)) * tokens + attention
    if not setup.activation_checkpointing:
        return forward, 2 * forward
    rebuilt_per_layer = model.layer_numel - a.hidden_size * a.ffn_hidden_size   # all but down
    return forward, 2 * forward + 2 * a.num_layers * rebuilt_per_layer * tokens + attention


def traced_flops(counts: dict, layers: int, setup) -> tuple[float, float]:
    """(forward, backward) FLOPs from the traced counts (`zerocalc.hf.optrace`): the matmuls', per token
    (T = micro-batch × sequence), and attention's, per token per position (T·s). What the code
    multiplies, so an MoE layer counts the router and its top-k experts for each token (balanced
    routing), not every expert; norms and biases are element-wise work (the traffic term), not FLOPs."""
    tokens = setup.micro_batch * setup.seq_len
    backward = "backward_checkpointed" if setup.activation_checkpointing else "backward"
    return tuple(_at(counts, phase, "flops_per_token", layers) * tokens
                 + _at(counts, phase, "attention_flops_per_token_seq", layers) * tokens * setup.seq_len
                 for phase in ("forward", backward))


def model_flops_per_step(model, setup) -> float:
    """The work MFU divides by, all ranks: the model's forward and backward without the recomputation
    (`flops_per_micro_step`: an MoE's routed experts, not all of them), 6 FLOPs per token for each
    weight multiplied plus attention's 12·L·h·s (PaLM's MFU, arXiv:2204.02311 appendix B), not 6·P,
    which counts the embedding's lookup as a matmul and leaves attention out (docs/step-time.md)."""
    fwd, bwd = flops_per_micro_step(model, replace(setup, activation_checkpointing=False))
    return (fwd + bwd) * setup.gas * setup.dp


def lookup_params(a) -> int:
    """Parameters read by index, not multiplied: the token embedding (unless the head shares it) and
    GPT-2's position table. A forward spends 2 FLOPs per token on every weight it multiplies by and
    none on these (Kaplan et al. 2020 leave the embeddings out of N)."""
    token = 0 if a.tie_embeddings else a.vocab_size * a.hidden_size
    return token + (a.max_positions * a.hidden_size if a.family == "hf-gpt2" else 0)


def optimizer_elements(model, setup) -> int:
    part = partition(model.trainable_numels, setup)
    if setup.stage == Stage.DISABLED:
        return part.num_params
    return part.flat_shard if setup.stage < Stage.PARAMETERS else part.stage3_shard


def activation_traffic_bytes(model, setup, cal: dict | None = None) -> tuple[float, float]:
    """(the layers' part of M above, the loss path's): what one micro-step's forward writes outside the
    matmuls, checkpointing or not. The layers' part is also what recomputation writes again; the loss
    path (the head's logits, their fp32 copy, log-softmax) writes 10 bytes per token per vocabulary entry."""
    full = activations.breakdown(model, replace(setup, activation_checkpointing=False), cal)
    tokens = setup.micro_batch * setup.seq_len
    return full.layers_bytes, 10 * tokens * model.architecture.vocab_size


def unaligned_head_flops(model, setup) -> float:
    """The forward's head matmul (2·T·h·V) where the vocabulary is not a multiple of 16 bytes' worth of
    elements: cuBLAS cannot run it on its aligned tensor-core kernels (Granite-3.0's 49,155-row head took
    13.6 ms more per forward at 4 × 2048 than the same model with 49,152 rows; data/h200-kernel-time.jsonl).
    0 for an aligned vocabulary."""
    a = model.architecture
    if a.vocab_size % (16 // DTYPE_BYTES[setup.dtype]) == 0:
        return 0.0
    return 2 * setup.micro_batch * setup.seq_len * a.hidden_size * a.vocab_size


def inter_node(setup, hw: Hardware) -> bool:
    """Whether the job's collectives cross nodes: N ranks over more than one node's GPUs. A ring or
    tree across nodes then runs at the network's pace (each GPU's share of it), not NVLink's."""
    return setup.dp > hw.gpus_per_node


def link_bytes_per_s(setup, hw: Hardware) -> float:
    return hw.inter_node_bytes_per_s if inter_node(setup, hw) else hw.intra_node_bytes_per_s


def link_efficiency(f: dict, k: dict) -> float:
    """ε of the link the job uses: `inter_node_link_efficiency` across nodes where the calibration has
    one (`zerocalc calibrate` fits it on rows of jobs that spanned nodes), else `link_efficiency`."""
    if f.get("inter_node") and "inter_node_link_efficiency" in k:
        return k["inter_node_link_efficiency"]
    return k["link_efficiency"]


def features(model, setup, collectives, hw: Hardware, cal: dict | None = None) -> dict:
    """What the fitted constants multiply (seconds at peak or link speed, counts); `validate fit`
    regresses on these."""
    fwd, bwd = flops_per_micro_step(model, setup)
    elements = optimizer_elements(model, setup)
    link = link_bytes_per_s(setup, hw)
    s3 = setup.stage == Stage.PARAMETERS
    ck = setup.activation_checkpointing
    it = stage3_trace.simulate(model, setup) if s3 else None
    stage12_overlap = setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS) and setup.overlap
    hooked = setup.stage == Stage.GRADIENTS or stage12_overlap   # each gradient copied into its bucket in its hook
    by = {"forward": 0, "backward": 0, "step": 0, "reduce": 0}
    for c in collectives:
        if c.op == "all_gather_into_tensor":
            by[c.phase] += c.wire_bytes
        elif not s3:
            by["reduce"] += c.wire_bytes
    gas = setup.gas
    layers_traffic, loss_traffic = activation_traffic_bytes(model, setup, cal)
    ops_fwd, ops_bwd = dispatched_ops(model, setup)
    return {
        "gas": gas,
        "inter_node": 1 if inter_node(setup, hw) else 0,
        "forward_at_peak_s": fwd / hw.peak_flops_per_s,
        "backward_at_peak_s": bwd / hw.peak_flops_per_s,
        "traffic_at_hbm_s": layers_traffic / hw.hbm_bytes_per_s,
        "loss_traffic_at_hbm_s": loss_traffic / hw.hbm_bytes_per_s,
        "unaligned_head_at_peak_s": unaligned_head_flops(model, setup) / hw.peak_flops_per_s,
        "recompute_traffic_at_hbm_s": layers_traffic / hw.hbm_bytes_per_s if ck else 0.0,
        "recompute": 1 if ck else 0,
        "layer_passes_fwd": model.architecture.num_layers,
        "layer_passes_bwd": model.architecture.num_layers,
        "ops_fwd": ops_fwd,
        "ops_bwd": ops_bwd,
        "modules_fwd": len(model.trace) if s3 else 0,
        "modules_bwd": len(model.backward(ck)) if s3 else 0,
        # collective calls only (a copy under parameter offload at N = 1 is `host_fetch_bytes` below)
        "gathers_fwd": it.all_gathers("forward")[0] if s3 else 0,
        "gathers_bwd": it.all_gathers("backward")[0] if s3 else 0,
        # stage 3's reduce-scatters: each bucket's host work in backward (HF's auto bucket, h², reduces
        # tensor by tensor: 195 calls a step for Pythia-410M instead of 1, +41%: data/h200-hf-s3-knob-split.csv)
        "reduce_calls": sum(c.calls for c in collectives if c.op == "reduce_scatter_tensor") // gas if s3 else 0,
        # per micro-step: the collectives are summed over GAS micro-steps
        "gather_fwd_at_link_s": by["forward"] / gas / link,
        "gather_bwd_at_link_s": by["backward"] / gas / link,
        "step_gather_at_link_s": by["step"] / link,
        "reduce_at_link_s": by["reduce"] / link,
        # ZeRO-2 copies each gradient into the bucket in its hook, during backward; ZeRO-1 keeps the
        # gradients and moves them into buckets at the end of backward (stage_1_and_2.py:971), once per
        # step, unless overlap_comm puts it on ZeRO-2's path (stage_1_and_2.py:2290)
        "grad_hooks": len(model.trainable_numels) if hooked else 0,
        "grad_moves": len(model.trainable_numels) if setup.stage == Stage.OPTIMIZER_STATES and not stage12_overlap else 0,
        # ... and each hooked gradient is read and written into its bucket on the device
        "grad_hook_at_hbm_s": 2 * setup.grad_accum_bytes * model.num_trainable / hw.hbm_bytes_per_s if hooked else 0.0,
        # the optimizer step walks every parameter tensor in Python (module docstring)
        "param_tensors": len(model.trainable_numels),
        # HF Trainer's loop: per micro-step, and its zero_grad over the parameters per optimizer step
        "trainer_micro_steps": gas if setup.hf_trainer else 0,
        "trainer_tensors": len(model.param_numels) if setup.hf_trainer else 0,
        # overlap_comm at stages 1/2: the backward passes its reduction can hide behind (stage 2 reduces
        # in every micro-step, stage 1 in the boundary's); 0 without it
        "overlap_passes": (gas if setup.stage == Stage.GRADIENTS else 1) if stage12_overlap else 0,
        "step_class": STEP_CLASSES[0 if setup.stage == Stage.DISABLED else 2 if s3 else 1],
        "host_launch_ratio": host_launch_ratio(cal),
        "optimizer_elements": elements,
        **offload_features(setup, elements, hw),
    }


# What a micro-step dispatches and computes, read from the model's own code (`zerocalc.hf.optrace`): a
# traced model's profile carries its own (`Profile.steps`); the transcribed families' are traced from the
# validator's models into family_steps.json (`python -m zerocalc.hf.optrace`). Each per phase (forward,
# backward, backward under checkpointing with its recomputation) as [n layers' model, each further layer].
FAMILY_STEPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "family_steps.json")


@lru_cache(maxsize=1)
def family_steps() -> dict:
    with open(FAMILY_STEPS) as f:
        return json.load(f)


def step_counts(model, setup) -> dict:
    """The traced counts for this model and attention (flash dispatches one attention operator as SDPA
    does): its profile's (for a model whose code supports one attention only, Gemma-2's eager, that
    one), else its family's (a profile traced before the counts were: Llama's)."""
    attention = "eager" if setup.attention == "eager" else "sdpa"
    p = getattr(model, "profile", None)
    if p is not None and p.steps:
        return p.steps.get(attention) or p.steps.get("sdpa") or p.steps["eager"]
    family = model.architecture.family if model.architecture.family in ("seed-gpt", "hf-gpt2") else "hf-llama"
    return family_steps()[f"{family}/{attention}"]


def _at(counts: dict, phase: str, key: str, layers: int) -> float:
    base, per_layer = counts[phase][key]
    return base + (layers - counts["base_layers"]) * per_layer


def dispatched_ops(model, setup) -> tuple[int, int]:
    """(forward, backward) operators one micro-step dispatches, all layers and the rest (`step_counts`);
    views and metadata reads left out, the loss the validator's, not the model's. Each costs the host a
    trip through the dispatcher and most a kernel launch (t_op). A Llama layer with SDPA dispatches 38
    forward, 71 backward, 107 checkpointed; the seed's GPT layer 25, 43 and 66 (tests/test_optrace.py)."""
    c, layers = step_counts(model, setup), model.architecture.num_layers
    backward = "backward_checkpointed" if setup.activation_checkpointing else "backward"
    return round(_at(c, "forward", "ops", layers)), round(_at(c, backward, "ops", layers))


def accuracy_regime(stage: int, dp: int, offloaded: bool) -> str:
    """Which of the calibration's accuracy groups (`time.accuracy.by_regime`, written by `validate fit`) a
    step falls in: CPU offload (the host's Adam and PCIe), else stage 3 or stages 0-2, at N = 1 or more.
    They differ in what sets the pace: stage 3 at N > 1 is host-bound up to 7B on H200 (its fetch hooks
    and all-gather calls), stages 0-2 turn device-bound from about 1B at 8k tokens."""
    if offloaded:
        return "offload"
    return f"{'stage 3' if int(stage) == 3 else 'stages 0-2'}, N {'= 1' if dp == 1 else '> 1'}"


def host_launch_ratio(cal: dict | None = None) -> float:
    """This host's cost to issue a kernel over the fitted hosts': its launch cost (`host_launch_s`:
    seconds to issue one tiny kernel from Python, `--host-launch-us`, or the median of the validator's
    probes beside a row's timed steps) over the fitted hosts' median (`host_launch_s_fitted`). 1 where
    either is unknown."""
    k = (cal or calibration.default())["time"]
    now, fitted = k.get("host_launch_s"), k.get("host_launch_s_fitted")
    return now / fitted if now and fitted else 1.0


def host_scale(launch_ratio: float, k: dict) -> float:
    """How much longer this host takes for the host-side work the constants hold at the fitted hosts'
    speed: the share φ of it that follows the cost to issue a kernel (`host_launch_share`, fitted)
    scales with `launch_ratio`, the rest (Python that issues nothing) does not: 1 + φ·(ratio - 1).
    φ = 1 where the calibration has none."""
    return 1 + k.get("host_launch_share", 1.0) * (launch_ratio - 1)


def offload_features(setup, elements: int, hw: Hardware) -> dict:
    """The host's share of an offloaded step (module docstring): bytes and elements for the whole host,
    the R ranks on it together."""
    opt, par = setup.offload_optimizer != "none", setup.offload_param != "none"
    s3, b = setup.stage == Stage.PARAMETERS, setup.param_bytes
    host = elements * min(setup.dp, hw.gpus_per_node)
    return {
        "host_grad_bytes": 4 * host if opt else 0,                    # per micro-step, fp32 gradients down
        "host_adam_elements": host if opt else 0,                     # per step
        "host_upload_bytes": b * host if opt and not s3 else 0,       # per step, pinned low-precision copy up
        "host_pageable_bytes": 4 * host if opt and s3 and not par else 0,   # per step, fp32 copy_ up
        "host_fetch_bytes": b * host if par else 0,                   # per pass, parameters up (prefetched)
    }


def phase_times(f: dict, k: dict) -> tuple[float, float, float, float]:
    """(forward, backward per micro-step, optimizer step, what else waits once per step: the exposed
    reduce, stage 1's gradient moves, HF Trainer's loop) in seconds from `features` and the time
    constants `k` (the calibration's "time" section)."""
    eff = link_efficiency(f, k)
    mu, mu_b, lam, lam_b = traffic_passes(k)
    h = host_scale(f["host_launch_ratio"], k)   # the host-side constants below are the fitted hosts'; h × on this host
    t_op = k.get("launch_s_per_op", 0.0)
    layers_traffic, loss_traffic = f["traffic_at_hbm_s"], f["loss_traffic_at_hbm_s"]
    host_fwd = h * (f["layer_passes_fwd"] * k["launch_fwd_s_per_layer"] + f["ops_fwd"] * t_op + f["modules_fwd"] * k["module_hook_s"]
                    + f["recompute"] * f["layer_passes_fwd"] * k.get("checkpoint_fwd_s_per_layer", 0.0))
    # an unaligned head's matmuls at their own efficiency: forward's one, backward's two (input and weight)
    unaligned = f["unaligned_head_at_peak_s"] * (1 / k["unaligned_head_efficiency"] - 1 / k["efficiency"]) \
        if k.get("unaligned_head_efficiency") else 0.0
    forward = max(f["forward_at_peak_s"] / k["efficiency"] + unaligned + mu * layers_traffic + lam * loss_traffic,
                  host_fwd) \
        + h * f["gathers_fwd"] * k["gather_call_s"] + f["gather_fwd_at_link_s"] / eff
    # A stage-2 gradient's hook copies it into the bucket on the device and spends its Python on the host
    # while earlier kernels run (a 1B model's 145 hooks added 4.4 ms to a 75 ms backward, not 15:
    # data/h200-kernel-time.jsonl beside data/h200-hf-types-timed.csv).
    backward = max(f["backward_at_peak_s"] / k["efficiency"] + 2 * unaligned
                   + mu_b * layers_traffic + lam_b * loss_traffic + mu * f["recompute_traffic_at_hbm_s"]
                   + k.get("grad_copy_passes", mu) * f["grad_hook_at_hbm_s"],
                   h * (f["layer_passes_bwd"] * k["launch_bwd_s_per_layer"] + f["ops_bwd"] * t_op
                        + f["recompute"] * f["layer_passes_fwd"] * k["launch_fwd_s_per_layer"]
                        + f["modules_bwd"] * k["module_hook_s"] + f["grad_hooks"] * k["grad_hook_s"]
                        + f["reduce_calls"] * k.get("reduce_call_s", 0.0))) \
        + h * f["gathers_bwd"] * k["gather_call_s"] + f["gather_bwd_at_link_s"] / eff
    optimizer = k["optimizer_s_per_element"][f["step_class"]] * f["optimizer_elements"] \
        + h * k.get("optimizer_s_per_tensor", {}).get(f["step_class"], 0.0) * f["param_tensors"]
    t0 = h * k["step_overhead_s"][f["step_class"]]
    if f["host_fetch_bytes"]:
        fetch = f["host_fetch_bytes"] / k["host_link_bytes_per_s"]
        forward, backward = max(forward, fetch), max(backward, fetch)
    if f["host_adam_elements"]:
        backward += f["host_grad_bytes"] / k["host_link_bytes_per_s"]
        optimizer = host_step_s(f, k)
    step = t0 + optimizer + f["step_gather_at_link_s"] / eff
    reduce = f["reduce_at_link_s"] / eff
    if f["overlap_passes"]:
        # overlap_comm: the reduction runs on its own stream beside the backward passes that make its
        # buckets and only what outlasts them waits; then backward's synchronize stops the host from
        # issuing the step while the device finishes, and the step's host time is spent again with the
        # device idle.
        reduce = max(0.0, reduce - f["overlap_passes"] * backward) + t0
    return forward, backward, step, reduce + h * f["grad_moves"] * k["grad_move_s"] + trainer_host_s(f, k)


def traffic_passes(k: dict) -> tuple[float, float, float, float]:
    """(μ, μ_b, λ, λ_b): HBM passes per byte the forward writes outside the matmuls, of the layers' bytes
    in forward and backward and of the loss path's (the logits in fp32, log-softmax: fewer passes per byte
    than a layer's norms and activations). Where a calibration has only μ: backward twice forward, the
    loss path as the layers."""
    mu = k.get("activation_passes", 0.0)
    lam = k.get("loss_passes", mu)
    return mu, k.get("backward_activation_passes", 2 * mu), lam, k.get("loss_passes_backward", 2 * lam)


def trainer_host_s(f: dict, k: dict) -> float:
    """HF Trainer's own host work per optimizer step, with the device idle (module docstring): its loop
    per micro-step and its zero_grad per parameter tensor, on this host (`host_scale`); 0 for a bare
    engine step."""
    h = host_scale(f["host_launch_ratio"], k)
    return h * (f["trainer_micro_steps"] * k.get("trainer_s_per_micro_step", 0.0)
                + f["trainer_tensors"] * k.get("trainer_zero_grad_s_per_tensor", 0.0))


def host_step_s(f: dict, k: dict) -> float:
    """The optimizer's work under optimizer offload: CPU Adam and the updated shard's way back up."""
    return f["host_adam_elements"] / k["host_adam_elements_per_s"] + f["host_upload_bytes"] / k["host_link_bytes_per_s"] \
        + f["host_pageable_bytes"] / k["host_pageable_bytes_per_s"]


def whole_step_s(f: dict, forward: float, backward: float, optimizer: float, reduce: float) -> float:
    """One optimizer step from its parts: GAS micro-steps of forward and backward, the exposed
    reductions, the optimizer step (with optimizer offload, the host's)."""
    return f["gas"] * (forward + backward) + reduce + optimizer


def step_time(model, setup, collectives, hw: Hardware, cal: dict | None = None) -> StepTime | None:
    if model.architecture is None or setup.seq_len is None:
        return None
    cal = cal or calibration.default()
    k = cal["time"]
    f = features(model, setup, collectives, hw, cal)
    forward, backward, optimizer, reduce = phase_times(f, k)
    eff = link_efficiency(f, k)
    link = link_bytes_per_s(setup, hw) * eff
    comm = sum(c.wire_bytes for c in collectives) / link
    hidden = sum(c.wire_bytes for c in collectives if c.op == "reduce_scatter_tensor") / link
    if f["overlap_passes"]:   # overlap_comm at stages 1/2: as much of the reduction as backward covers
        hidden += min(f["reduce_at_link_s"] / eff, f["overlap_passes"] * backward)
    h = host_scale(f["host_launch_ratio"], k)
    gather_calls = h * f["gas"] * (f["gathers_fwd"] + f["gathers_bwd"]) * k["gather_call_s"]
    exposed = comm - hidden + gather_calls
    hooks = h * f["gas"] * (f["modules_fwd"] + f["modules_bwd"]) * k["module_hook_s"]
    # Offload's own time (inside forward, backward and the step above): the gradients' way down and
    # the host's step; parameter fetches are overlapped with compute.
    offload = f["gas"] * f["host_grad_bytes"] / k["host_link_bytes_per_s"] + host_step_s(f, k) \
        if f["host_adam_elements"] else 0.0
    step = whole_step_s(f, forward, backward, optimizer, reduce)
    tokens = setup.micro_batch * setup.seq_len * setup.gas * setup.dp
    mfu = model_flops_per_step(model, setup) / (step * setup.dp * hw.peak_flops_per_s)
    return StepTime(forward, backward, optimizer, comm, exposed, hooks, offload, step, tokens / step, mfu,
                    exposed / step, exposed_wire_s=comm - hidden, gather_calls_s=gather_calls,
                    trainer_s=trainer_host_s(f, k))
