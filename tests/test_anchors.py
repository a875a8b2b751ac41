"""Anchors: the ZeRO paper's figure 1 and DeepSpeed's own estimator, with stated tolerances, and the
exact amounts by which DeepSpeed 0.19.8 differs from them."""
import pytest

from zerocalc import reference
from zerocalc.model import from_params
from zerocalc.states import model_states
from zerocalc.training import Setup, Stage

PSI, ND = 7_500_000_000, 64   # figure 1: 7.5B parameters, N_d = 64, K = 12


@pytest.mark.parametrize("stage, paper_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1(stage, paper_gb):
    # the paper prints GB = 1e9 bytes, rounded to one decimal (1.875 -> 1.9)
    assert reference.paper_model_states_bytes(PSI, ND, stage) / 1e9 == pytest.approx(paper_gb, abs=0.05)


def resident(stage, **kw):
    return model_states(from_params(PSI), Setup(stage=Stage(stage), dp=ND, dtype="fp16", **kw))


def test_stage0_deepspeed_holds_2psi_less_than_the_paper():
    # the paper keeps fp16 gradients (2Ψ) between steps; DeepSpeed frees them after the step
    assert reference.paper_model_states_bytes(PSI, ND, 0) - resident(0).resident_bytes == 2 * PSI


def test_stage1_deepspeed_holds_the_gradients_less_and_the_padding_more():
    st = resident(1)
    padded = st.params_bytes // 2                     # Pp, a multiple of 2·N_d
    assert padded - PSI < 2 * ND
    # paper: 2Ψ params + 2Ψ grads + 12Ψ/N_d; DeepSpeed: 2Pp + 12·Pp/N_d, no gradients kept
    assert st.resident_bytes == 2 * padded + 12 * padded // ND
    assert reference.paper_model_states_bytes(PSI, ND, 1) - st.resident_bytes == pytest.approx(2 * PSI, rel=1e-6)


def test_stage3_deepspeed_adds_the_persistent_ipg_bucket():
    st = resident(3)
    # 16Ψ/N_d as in the paper (2 params + 2 grads + 12 optimizer, per shard) plus the reduce bucket
    # kept at init: 2 bytes × reduce_bucket_size (5e8) = 1 GB, 53% on top of the paper's 1.875 GB
    assert st.resident_bytes - reference.paper_model_states_bytes(PSI, ND, 3) == pytest.approx(1e9, rel=1e-4)


def test_deepspeed_estimator_stage2_counts_6_bytes_per_param_of_gradient_partitions():
    # estimate_zero2_model_states_mem_needs: 2Ψ + 18Ψ/N (18 = 2 grads16 + 4 grads32 + 4 params32 + 8 Adam)
    ds = reference.deepspeed_estimator_gpu_bytes(PSI, 0, ND, 2)
    assert ds == 2 * PSI + int(18 * PSI / ND)
    # DeepSpeed's code keeps neither gradient partition between steps: 6Ψ/N_d less (padding aside)
    assert ds - resident(2).resident_bytes == pytest.approx(6 * PSI / ND, rel=1e-3)


def test_reference_copies_match_deepspeed_itself():
    ds = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    ds3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for n in (1, 8, 64):
        _, gpu = ds.estimate_zero2_model_states_mem_needs(PSI, num_gpus_per_node=n, cpu_offload=False)
        assert reference.deepspeed_estimator_gpu_bytes(PSI, 0, n, 2) == gpu
        _, gpu3, _ = ds3.estimate_zero3_model_states_mem_needs(PSI, 10**8, num_gpus_per_node=n, cpu_offload=False)
        assert reference.deepspeed_estimator_gpu_bytes(PSI, 10**8, n, 3) == gpu3
