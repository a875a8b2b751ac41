"""Other people's figures, shown beside zerocalc's for comparison; never used for its own answer.

- The ZeRO paper (Rajbhandari et al., arXiv:1910.02054, figure 1 and §7): mixed-precision Adam holds
  2Ψ fp16 params + 2Ψ fp16 grads + KΨ optimizer states (K = 12: fp32 params, momentum, variance);
  P_os divides KΨ by N_d, P_os+g also the grads, P_os+g+p everything. Communication per step: 2Ψ
  elements for stages 0–2 (reduce-scatter + all-gather), 3Ψ for stage 3.
- DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` in
  `runtime/zero/stage_1_and_2.py`, `estimate_zero3_model_states_mem_needs` in `runtime/zero/stage3.py`,
  0.19.8), copied here so that zerocalc never imports DeepSpeed.
"""
from zerocalc.training import Stage

PAPER_K = 12


def paper_model_states_bytes(num_params: int, dp: int, stage: int, k: int = PAPER_K) -> float:
    """Figure 1 of the ZeRO paper: bytes per device for Ψ = num_params, N_d = dp."""
    psi = num_params
    if stage == Stage.DISABLED:
        return (2 + 2 + k) * psi
    if stage == Stage.OPTIMIZER_STATES:
        return 2 * psi + 2 * psi + k * psi / dp
    if stage == Stage.GRADIENTS:
        return 2 * psi + (2 + k) * psi / dp
    return (2 + 2 + k) * psi / dp


def paper_comm_volume_over_params(stage: int) -> float:
    """Elements each rank moves per step, as a multiple of Ψ (§7.2 of the paper)."""
    return 3.0 if stage == Stage.PARAMETERS else 2.0


def deepspeed_estimator_gpu_bytes(num_params: int, largest_layer_params: int, dp: int, stage: int,
                                  offload_optimizer: bool = False, offload_param: bool = False,
                                  gpus_per_node: int | None = None) -> int | None:
    """GPU bytes per rank from DeepSpeed's estimator functions; None for stages it has no function for."""
    gpus_per_node = gpus_per_node or dp
    total_gpus = dp
    if stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS):
        # 2 = params_16bit, 18 = 2 grads16 + 4 grads32 + 4 params32 + 8 optimizer states (DeepSpeed's comment)
        if offload_optimizer:
            return 2 * num_params
        return 2 * num_params + int(18 * num_params / total_gpus)
    if stage == Stage.PARAMETERS:
        largest_layer_memory = 4 * largest_layer_params
        if offload_optimizer and offload_param:
            return largest_layer_memory
        if offload_optimizer:
            return largest_layer_memory + int(2 * num_params / total_gpus)
        return largest_layer_memory + int(18 * num_params / total_gpus)
    return None
