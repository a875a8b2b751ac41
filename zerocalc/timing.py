"""Step time per optimizer step, phase by phase as the validator times them (forward, backward,
optimizer step), each the slower of what the GPU must compute and what the host must issue, plus
what waits on communication:

    forward   = max(F_fwd / (η·peak) + μ·M / hbm, L·(t_launch_fwd + ck·t_ckpt_fwd) + o_fwd·t_op + m_fwd·t_hook)
                + g_fwd·t_gather + W_fwd / (ε·link)
    backward  = max(F_bwd / (η·peak) + μ·(2·M + ck·M_layers) / hbm, L·(t_launch_bwd + ck·t_launch_fwd) + o_bwd·t_op + m_bwd·t_hook)
                + g_bwd·t_gather + W_bwd / (ε·link) + n_tensors·t_grad_hook (stage 2)
    step      = t0[stage] + t_element[stage]·(optimizer elements on this rank) + t_tensor[stage]·n_tensors
                + W_step / (ε·link)
    step_s    = GAS·(forward + backward) + W_reduce / (ε·link) + n_tensors·t_grad_move (stage 1) + step  (+ offload)
                (+ GAS·t_trainer + n_tensors·t_zero_grad through HF Trainer)
                with overlap_comm at stages 1/2, W_reduce / (ε·link) becomes
                max(0, W_reduce / (ε·link) - passes·backward) + t0[stage]

- F: FLOPs per micro-step. Forward 2·P'·T + 4·L·h·s·T (the attention scores and values), P' the
  parameters less the token embedding, which is read by index (Kaplan et al. 2020 leave it out of N;
  GPT-2's position table too), backward twice that (Korthikanti et al. 2022, Table 2). T = micro-batch
  × sequence tokens on this rank. Activation checkpointing adds the recomputation, which is not one
  more forward as the usual 8·P·T has it: PyTorch's non-reentrant checkpoint (the validator's, HF's
  with use_reentrant=False) rebuilds the layers only, not the head, and stops early, before each
  layer's MLP down projection, whose input is the last tensor the layer saves. Recomputation is
  2·L·(layer params − h·f)·T + 4·L·h·s·T: 0.78 of a forward for Llama-2-7B at 2k tokens. Counted on
  torch 2.13 (CPU, FlopCounterMode, both families: tests/test_validate_models.py); on the H200 rows it
  took the checkpointed device-bound steps from 7.4% to 3-4% over their measured time.
  A model read from its own code (a profile, `zerocalc.hf.optrace`) has F as its code multiplies: the
  traced matmuls per token and attention's per token per position, forward, backward, and backward
  with the recomputation as checkpointing stops it; an MoE layer's router and the top-k experts each
  token is sent to (balanced), not every expert as 2·P'·T would; norms and biases, which 2·P'·T counts
  (under 1% of a layer), are left to the traffic term.
- M: the bytes one forward writes outside the matmuls' operands: every layer's activations as if
  nothing were checkpointed (`zerocalc.activations`) and the loss path's 10·V bytes per token (the
  logits, their fp32 copy, the log-probs). Element-wise kernels (norms, GELU/SiLU, softmax, dropout,
  the upcast) are bound by HBM bandwidth, not by FLOPs: μ passes of M at `hbm` bandwidth; backward
  reads them and writes as much again (2μ), and recomputing writes the layers' part M_layers again
  (not the loss path). Without this
  term, small hidden sizes and long eager-attention sequences ran 2–3× slower than FLOPs said.
- The host side: a cost per layer pass (Python, modules, autograd), one per operator dispatched
  (o: traced from the model's code, `zerocalc.hf.optrace`: a profile's own, the transcribed families'
  in family_steps.json; each is a trip through PyTorch's dispatcher and most a kernel launch) and, at stage 3, DeepSpeed's fetch/release hooks per module step of the trace
  (`zerocalc.stage3_trace`: forward's modules, then backward's, the recomputed layers included). On a
  GPU this fast small steps are host-bound: that is the max. A Llama layer dispatches 38 operators
  forward and 71 backward (sdpa), the seed's GPT layer 25 and 43; with the per-layer cost alone the
  host-bound Llama rows came out 5-7% under their measured steps and the GPT ones 5-6% over, at stages
  0 and 2. t_op fitted: 12.7 us, beside the 9.5 us the hosts took to launch one kernel from Python.
- Activation checkpointing (ck = 1): backward's host pays the recomputation as the forward pass it is
  (L·t_launch_fwd, its operators in o_bwd), not as a second backward pass: cross-validated
  (`python -m validate crossval`), 229/304 rows and 86/100 configurations within 15% against 222 and 85
  (before the t11 rows).
  It costs the host more in forward too: PyTorch's non-reentrant
  checkpoint runs each layer under saved-tensor hooks (t_ckpt_fwd per layer, fitted); measured
  checkpointed forwards of small models took 2–2.5× the plain ones.
- Stage 3 at N > 1: each all-gather call is issued and waited for inside a hook (t_gather per
  call) and its wire bytes W cross the link; the gradient reduce-scatter overlaps backward
  (overlap_comm is on at stage 3) and is taken as hidden. t_gather fitted on 0.16-1.4B models alone
  (1.58 ms) over-predicted 3-7B steps by 31-78%, blind (`data/h200-t11-blind-s3-*`); with them in the fit
  it is 0.81 ms. Those steps are host-bound still at 4k-8k tokens: a profile of rank 0
  (`data/profiles/t11/`) showed 224 all-gather kernels of 98 us each in one job, and 2.7 ms each in
  another where they waited for the other rank's host. Counting the calls inside the host's side of the
  max instead (hidden behind compute) predicted no better and was not adopted.
- Stages 0–2 at N > 1: gradient all-reduce wire bytes W_reduce (overlap_comm is off by default:
  exposed), stages 1/2 the all-gather of updated parameters at the step. Stage 2 also spends
  t_grad_hook per parameter tensor in its hook copying each gradient into the ipg buffer during
  backward; stage 1 keeps the gradients and moves them into the buckets once, at the end of the
  step's last backward (`stage_1_and_2.py:971`): t_grad_move per tensor. Fitted apart, the move costs a
  fifth of the hook (21 vs 99 us per tensor on H200); with one shared constant stage 1 was
  over-predicted by 17% on average at N = 2. With `overlap_comm` at stages 1/2 (measured on H200,
  N = 2: `data/h200-t6-overlap-*.csv`) stage 1 takes stage 2's hooks (stage_1_and_2.py:2290), the
  reduction runs beside the backward passes that fill its buckets (every micro-step's at stage 2, the
  boundary's at stage 1: `passes`) and only what outlasts them waits, and backward's epilogue
  synchronizes the device (stage_1_and_2.py:1026): the host can no longer issue the step while the
  device finishes backward, so the step's host time t0 is spent again with the device idle. Over
  NVLink the reduction is short and the synchronize dominates: the steps were 28–52% slower than
  without overlap_comm (1.4B GPT stage 2: 160 vs 125 ms, stage 1: 184 vs 121 ms; 1.1B Llama stage 2:
  179 vs 152 ms). That the reduction hides behind backward where the link is slow (between nodes) is
  DeepSpeed's design, not measured here.
- Offload (measured on a 2×H200 host with 32 vCPUs and a 1×H200 host with 16, which agreed to 1–4%
  on the same jobs; `data/h200-t2-offload-*.csv`): the host's memory, PCIe root and cores are shared
  by the R = min(N, GPUs per node) ranks on it, so each term counts the host's bytes or elements, R
  times the rank's. With optimizer offload each micro-step's
  backward copies the shard's gradients down as fp32 (4·S bytes, not overlapped: backward measured
  0.16–0.18 s longer) at `host_link`; the step runs DeepSpeedCPUAdam on S elements
  (`host_adam_elements_per_s`) and sends the updated shard up: stages 1/2 from a pinned
  low-precision copy (b·S at `host_link`), stage 3 without parameter offload as an fp32 copy_ from
  pageable memory into the device's partition (4·S at `host_pageable`, the slow part: 1.3 s of a
  1.7 s step for 1.4B). With parameter offload each forward and backward fetch the shard up again
  (b·S per pass); DeepSpeed prefetches on its own stream, so a pass takes the longer of its compute
  and that copy (measured: no slower than without parameter offload).
- The host's speed: every host-side term above (t_launch_*, t_op, t_ckpt_fwd, t_hook, t_gather, t_grad_hook,
  t_grad_move, t0) is the fitted hosts' and is h times longer on a host whose cost to issue a kernel
  from Python is r times theirs (`--host-launch-us`; their median is 9.5 us on the H200 VMs):
  h = 1 + φ·(r - 1) (`host_scale`), φ the share of that host time which follows the launch cost, the
  rest being Python that issues nothing (fitted: 0.75). Measured on those VMs (`data/h200-t7-*.csv`):
  these steps are host-bound, the launch cost drifted between 7 and 25 us within minutes with no
  run-queue wait, steal or garbage collection behind it, and a configuration's step time followed it
  (r = 0.65-0.90 over its steps). With each row's launch cost (the median of the probes taken before
  each of its timed steps) 126 of the 157 rows that have them are within 15% (121 at the fitted hosts'
  speed); on the 110 of them there were before, φ = 1 (all host time scaling, the model before) put
  one row fewer within 15% at a 4% higher fit cost. At N = 2 a row's launch cost is the slower rank's
  before each step (the ranks wait for each other): on its first seven rows (`data/h200-t9-second-a.csv`)
  that was 11.0-12.0 us where the same host's N = 1 rows probed 9.7-11.1, and the predictions on it
  were 11% over the measured steps (mean; 4 of 7 within 15%), at the fitted hosts' speed 3% under
  (6 of 7): the slower of two noisy probes overstates the host; with nine more N = 2 rows that keep
  every rank's probes (`data/h200-t10-third-n2.csv`) the slower rank's, the mean, the faster and rank
  0's put 4, 5, 4 and 6 of 9 within 15%: not settled. A probe of the interpreter's own speed
  (`validate.measure.host_python_s`, `data/probes/`) switched between two states 2x apart (0.25 and
  0.5-0.6 us per call) in step with the launch probe (r = 0.78-0.83) and followed the step time no
  better (r = 0.23-0.54 over each configuration's steps, as the launch probe): the part of the host's
  time the launch cost does not explain is not the interpreter's speed at the moment of the probe. Where
  the launch cost does not explain the spread: stage 3 at N = 2 and offload, re-timed in
  `data/h200-t8-retime-*.csv`, differed from their earlier jobs by up to 54% at an ordinary launch
  cost.
- The optimizer step's host work per parameter tensor (t_tensor[stage class]): DeepSpeed walks the
  parameters in Python around the fused update (stage 0's bf16 optimizer moves each gradient into its
  fp32 copy and each updated weight back; stages 1-3 clear each gradient and point each weight at its
  new values), so a model of few large tensors steps faster per element than one of many small ones.
  Measured on H200 (the optimizer step between synchronizes, `measured_step_phase_s`): Phi-3 (6
  layers, 39 tensors, 0.88e9 elements) stepped in 24 ms at stage 0 where Qwen2.5-0.5B (290 tensors,
  0.49e9 elements) took 48-63 ms; with a cost per element only the fit put its constant time in t0
  and over-predicted the few-tensor models' steps by 24-34% (Phi-3, Mixtral, Gemma-2).
- HF Trainer (`Setup.hf_trainer`, a ds_config with "auto" values): the same engine step, plus the
  Trainer's own loop on the host: per micro-step t_trainer (the batch to the device, `model.train()`,
  the loss's NaN check, which waits for the device, FLOP and token counting, callbacks), and per
  optimizer step its `model.zero_grad()`, which walks the parameters again after the engine's own
  (t_zero_grad per tensor). Both run with the device idle (after the NaN check's wait, or before the
  step's first kernel), so they add to the step. Measured, not fitted, by the validator's probes of
  each call Trainer makes (`validate.hf_trainer.TrainerClock`, `validate.fit.trainer_host_constants`):
  on Qwen2.5-0.5B at stage 2, 5.1 ms of loop and 1.05 ms of zero_grad in 190-200-ms steps
  (`data/README.md`). The gradient norm Trainer reads back (0.1 ms: DeepSpeed clips inside its step)
  and the scheduler (DeepSpeed's, stepped inside its step) are in the loop's share; the loss path (the
  model's own shifted cross-entropy) is counted as the validator's, which the trace holds (forward
  with the loss: 40-42 ms synchronized through Trainer, 38-48 ms bare). Logging and the next batch
  run between steps (1.4 ms), outside the step as it is timed and predicted.
η is fitted no higher than the rate of a large bf16 matmul on the same GPU, measured beside every job
(0.80 of an H200's peak, `validate.fit.matmul_ceiling`): with no ceiling, the fit traded it against μ
(0.75-1.0 against 5.8-7.9 over the cross-validation folds of `python -m validate crossval`).
The constants η, μ, t_launch_*, t_op, t_ckpt_fwd, t_hook, t_gather, ε, t_grad_hook, t_grad_move, t0[·], t_element[·],
t_tensor[·], φ and the three host rates are fitted on H200 runs (t_trainer and t_zero_grad measured: above) (`python -m validate fit`, `zerocalc/calibration/h200.json`;
the host rates can be given: `--cpu-adam-rate`, `--host-link-gbps`); on another GPU they are
assumed to carry over, which is a guess until it is measured. They are fitted on, and judged
against, whole steps timed as training runs them (no synchronize between phases; `data/README.md`);
there one configuration's median step differs by 19% between separate jobs (median over six
configurations without offload), and stage-3 steps drift by ±25% within a job: on these hosts ±15% is at the
measurement's own floor (H200, DeepSpeed 0.19.8, torch 2.11).
"""
import json
import os
from dataclasses import dataclass, replace
from functools import lru_cache

from zerocalc import activations, arch, calibration, stage3_trace
from zerocalc.hardware import Hardware
from zerocalc.partition import partition
from zerocalc.training import Stage

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
    rebuilt_per_layer = sum(arch.layer_numels(a)) - a.hidden_size * a.ffn_hidden_size   # all but down
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
    """The work MFU divides by, all ranks: 6·P per token; for a model read from its code, the traced
    forward and backward without the recomputation (an MoE's routed experts, not all of them)."""
    tokens = setup.micro_batch * setup.seq_len * setup.gas * setup.dp
    p = getattr(model, "profile", None)
    if p is not None and p.steps:
        fwd, bwd = flops_per_micro_step(model, replace(setup, activation_checkpointing=False))
        return (fwd + bwd) * setup.gas * setup.dp
    return 6 * model.num_params * tokens


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
    """(M above, its layers' part): what one micro-step's forward writes outside the matmuls,
    checkpointing or not, and the part of it recomputation writes again (the layers, not the loss path)."""
    full = activations.breakdown(model, replace(setup, activation_checkpointing=False), cal)
    tokens = setup.micro_batch * setup.seq_len
    return full.layers_bytes + 10 * tokens * model.architecture.vocab_size, full.layers_bytes


def link_bytes_per_s(setup, hw: Hardware) -> float:
    return hw.intra_node_bytes_per_s if setup.dp <= hw.gpus_per_node else hw.inter_node_bytes_per_s


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
    by = {"forward": 0, "backward": 0, "step": 0, "reduce": 0}
    for c in collectives:
        if c.op == "all_gather_into_tensor":
            by[c.phase] += c.wire_bytes
        elif not s3:
            by["reduce"] += c.wire_bytes
    gas = setup.gas
    traffic, layers_traffic = activation_traffic_bytes(model, setup, cal)
    ops_fwd, ops_bwd = dispatched_ops(model, setup)
    return {
        "gas": gas,
        "forward_at_peak_s": fwd / hw.peak_flops_per_s,
        "backward_at_peak_s": bwd / hw.peak_flops_per_s,
        "traffic_at_hbm_s": traffic / hw.hbm_bytes_per_s,
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
        # per micro-step: the collectives are summed over GAS micro-steps
        "gather_fwd_at_link_s": by["forward"] / gas / link,
        "gather_bwd_at_link_s": by["backward"] / gas / link,
        "step_gather_at_link_s": by["step"] / link,
        "reduce_at_link_s": by["reduce"] / link,
        # ZeRO-2 copies each gradient into the bucket in its hook, during backward; ZeRO-1 keeps the
        # gradients and moves them into buckets at the end of backward (stage_1_and_2.py:971), once per
        # step, unless overlap_comm puts it on ZeRO-2's path (stage_1_and_2.py:2290)
        "grad_hooks": len(model.trainable_numels) if setup.stage == Stage.GRADIENTS or stage12_overlap else 0,
        "grad_moves": len(model.trainable_numels) if setup.stage == Stage.OPTIMIZER_STATES and not stage12_overlap else 0,
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
    eff, mu = k["link_efficiency"], k.get("activation_passes", 0.0)
    h = host_scale(f["host_launch_ratio"], k)   # the host-side constants below are the fitted hosts'; h × on this host
    t_op = k.get("launch_s_per_op", 0.0)
    host_fwd = h * (f["layer_passes_fwd"] * k["launch_fwd_s_per_layer"] + f["ops_fwd"] * t_op + f["modules_fwd"] * k["module_hook_s"]
                    + f["recompute"] * f["layer_passes_fwd"] * k.get("checkpoint_fwd_s_per_layer", 0.0))
    forward = max(f["forward_at_peak_s"] / k["efficiency"] + mu * f["traffic_at_hbm_s"], host_fwd) \
        + h * f["gathers_fwd"] * k["gather_call_s"] + f["gather_fwd_at_link_s"] / eff
    backward = max(f["backward_at_peak_s"] / k["efficiency"]
                   + mu * (2 * f["traffic_at_hbm_s"] + f["recompute_traffic_at_hbm_s"]),
                   h * (f["layer_passes_bwd"] * k["launch_bwd_s_per_layer"] + f["ops_bwd"] * t_op
                        + f["recompute"] * f["layer_passes_fwd"] * k["launch_fwd_s_per_layer"]
                        + f["modules_bwd"] * k["module_hook_s"])) \
        + h * (f["gathers_bwd"] * k["gather_call_s"] + f["grad_hooks"] * k["grad_hook_s"]) \
        + f["gather_bwd_at_link_s"] / eff
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
    link = link_bytes_per_s(setup, hw) * k["link_efficiency"]
    comm = sum(c.wire_bytes for c in collectives) / link
    hidden = sum(c.wire_bytes for c in collectives if c.op == "reduce_scatter_tensor") / link
    if f["overlap_passes"]:   # overlap_comm at stages 1/2: as much of the reduction as backward covers
        hidden += min(f["reduce_at_link_s"] / k["link_efficiency"], f["overlap_passes"] * backward)
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
