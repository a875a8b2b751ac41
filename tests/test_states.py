"""Model-state bytes per rank, worked out by hand term by term.

A toy model of three tensors, n = (10, 7, 5), P = 22, bf16 (b = 2), Adam (8 bytes/param of moments)."""
from zerocalc.model import ModelSpec
from zerocalc.states import model_states
from zerocalc.training import OPTIMIZERS, Setup, Stage

TOY = ModelSpec("toy", (10, 7, 5), ((), (0,), (1,), (2,)))


def setup(stage, dp, **kw):
    return Setup(stage=Stage(stage), dp=dp, **kw)


def test_stage0_bf16_holds_params_master_and_adam_for_all_p():
    st = model_states(TOY, setup(0, 4, dtype="bf16"))
    assert st.params_bytes == 2 * 22          # bf16 parameters, all P
    assert st.master_bytes == 4 * 22          # FP16_Optimizer's flat fp32 master, all P
    assert st.moments_bytes == 8 * 22         # exp_avg + exp_avg_sq, fp32, all P
    assert st.grads_bytes == 0                # gradients are freed after the step
    assert st.resident_bytes == 44 + 88 + 176


def test_stage0_fp32_has_no_master_copy():
    st = model_states(TOY, setup(0, 4, dtype="fp32"))
    assert st.params_bytes == 4 * 22          # the fp32 parameters are the master
    assert st.master_bytes == 0
    assert st.resident_bytes == 88 + 176      # 12 bytes/param


def test_stage1_pads_the_flat_group_to_2n_and_shards_master_and_moments():
    st = model_states(TOY, setup(1, 4))
    # 2N = 8: Pp = ceil(22 / 8) * 8 = 24, S = Pp / N = 6
    assert st.params_bytes == 2 * 24          # bit16_groups_flat, padding included
    assert st.master_bytes == 4 * 6           # single_partition_of_fp32_groups
    assert st.moments_bytes == 8 * 6
    assert st.resident_bytes == 48 + 24 + 48


def test_stage2_resident_equals_stage1():
    assert model_states(TOY, setup(2, 4)).resident_bytes == model_states(TOY, setup(1, 4)).resident_bytes


def test_stage1_fp32_still_clones_the_master():
    st = model_states(TOY, setup(1, 4, dtype="fp32"))
    assert st.params_bytes == 4 * 24
    assert st.master_bytes == 4 * 6           # a copy even though params are fp32


def test_bf16_optimizer_keeps_full_fp32_gradients():
    st = model_states(TOY, setup(1, 4, grad_accum_dtype="fp32"))
    assert st.params_bytes == 2 * 24
    assert st.grads_bytes == 4 * 24           # persistent full fp32 gradient buffer of Pp
    assert st.master_bytes == 4 * 6
    assert st.moments_bytes == 8 * 6


def test_stage3_pads_per_tensor_and_keeps_small_params_whole():
    st = model_states(TOY, setup(3, 4))
    # shards: ceil(10/4) = 3, ceil(7/4) = 2, ceil(5/4) = 2 -> S3 = 7
    # every tensor is under the persistence threshold (1e5): whole copies, padded: 4*3 + 4*2 + 4*2 = 28
    assert st.params_bytes == 2 * (7 + 28)
    assert st.master_bytes == 4 * 7
    assert st.moments_bytes == 8 * 7
    assert st.grads_bytes == 2 * 7            # grad_partitions_flat_buffer
    assert st.buffers_bytes == 2 * 500_000_000  # the ipg bucket: reduce_bucket_size elements, kept
    assert st.resident_bytes == 70 + 28 + 56 + 14 + 1_000_000_000


def test_stage3_with_threshold_zero_keeps_no_whole_copies():
    st = model_states(TOY, setup(3, 4, param_persistence_threshold=0, reduce_bucket_size=100))
    assert st.params_bytes == 2 * 7
    assert st.buffers_bytes == 2 * 100


def test_stage3_at_one_rank_has_no_separate_whole_copy():
    st = model_states(TOY, setup(3, 1, reduce_bucket_size=100))
    assert st.params_bytes == 2 * 22          # parameters are views of their partitions
    assert st.master_bytes == 4 * 22


def test_sgd_without_momentum_has_no_moments():
    st = model_states(TOY, setup(2, 4, optimizer=OPTIMIZERS["sgd"]))
    assert st.moments_bytes == 0
    assert model_states(TOY, setup(2, 4, optimizer=OPTIMIZERS["sgd-momentum"])).moments_bytes == 4 * 6


def test_stage2_optimizer_offload_moves_master_moments_and_fp32_grads_to_the_host():
    st = model_states(TOY, setup(2, 4, offload_optimizer="cpu"))
    # Pp = 24, S = 6; the largest tensor has 10 elements
    assert st.resident_bytes == 2 * 24 + 2 * 10           # bf16 flat params + device gradient staging
    assert st.cpu_bytes == 4 * 6 + 8 * 6 + 4 * 6 + 2 * 6 + 2 * 10   # master, Adam, fp32 grads, bf16 copy, staging
    assert st.total_bytes == st.resident_bytes + st.cpu_bytes


def test_stage3_offload_keeps_the_same_tensors_on_other_sides():
    on_gpu = model_states(TOY, setup(3, 4, param_persistence_threshold=0, reduce_bucket_size=100))
    off = model_states(TOY, setup(3, 4, param_persistence_threshold=0, reduce_bucket_size=100,
                                  offload_optimizer="cpu", offload_param="cpu"))
    assert off.total_bytes == on_gpu.total_bytes
    # master, Adam, bf16 gradient partitions, bf16 parameter partitions (S3 = 3 + 2 + 2 = 7)
    assert off.cpu_bytes == 4 * 7 + 8 * 7 + 2 * 7 + 2 * 7
    assert off.resident_bytes == 2 * 100                   # the ipg bucket (bf16, 100 elements) alone


def test_stage3_optimizer_offload_leaves_parameter_partitions_and_the_bucket_on_the_device():
    # `grad_partitions_flat_buffer` is made on the optimizer's device: the host under offload
    # (measured on H200: 3,828,910,592 B on the device for 1.4B = 2·P + the 1e9 B bucket).
    st = model_states(TOY, setup(3, 4, param_persistence_threshold=0, reduce_bucket_size=100, offload_optimizer="cpu"))
    assert st.resident_bytes == 2 * 7 + 2 * 100            # bf16 partitions + ipg bucket
    assert st.cpu_bytes == 4 * 7 + 8 * 7 + 2 * 7            # master, Adam, bf16 gradient partitions


def test_stage3_parameter_offload_at_n1_keeps_persistent_parameters_whole_on_the_device():
    # Threshold 6: only the 5-element tensor persists. At N = 1 its partition is the parameter itself,
    # until the partitions move to the host: then a whole copy stays on the device (2·5 B).
    kw = dict(param_persistence_threshold=6, reduce_bucket_size=100)
    on_gpu = model_states(TOY, setup(3, 1, **kw))
    off = model_states(TOY, setup(3, 1, offload_optimizer="cpu", offload_param="cpu", **kw))
    assert on_gpu.resident_bytes == (2 + 4 + 8 + 2) * 22 + 2 * 100
    assert off.resident_bytes == 2 * 5 + 2 * 100
    assert off.cpu_bytes == (4 + 8 + 2 + 2) * 22


def test_module_buffers_by_their_dtypes():
    """A traced model's buffers by their dtypes (`ModelSpec.buffer_bytes`, from the profile): a bool
    causal mask of 8192² (GPTBigCode's `bias`: 1 B an element), a YaRN rotary `inv_freq` of 32 fp32
    that zero.Init leaves fp32 (made from integers after DeepSpeed's tensor constructors) and Llama's
    default `inv_freq` of 32 fp32 that zero.Init makes bf16 (an `arange` in float)."""
    from zerocalc.profile import Tensor, buffer_element_bytes
    buffers = (Tensor("transformer.bias", (8192, 8192), "bool"),
               Tensor("model.rotary_emb.inv_freq", (32,), "float32", "float32"),
               Tensor("model.layers.0.rotary_emb.inv_freq", (32,), "float32"))
    model = ModelSpec("toy", (10, 7, 5), ((), (0,), (1,), (2,)), tuple(b.numel for b in buffers),
                      buffer_bytes=tuple(buffer_element_bytes(b) for b in buffers))
    assert model.buffer_bytes == ((1, 1), (4, 4), (4, 0))
    # stages 0-2: as built, 8192² x 1 + 32 x 4 + 32 x 4 (the old rule, 4 B for each, was 3·2^26 too many)
    for stage in (0, 1, 2, 3):
        assert model_states(model, setup(stage, 1)).buffers_bytes - (2 * 500_000_000 if stage == 3 else 0) \
            == 8192 ** 2 + 128 + 128
    # stage 3 under zero.Init: the mask and the YaRN inv_freq as built, the default one in bf16, 32 x 2
    st = model_states(model, setup(3, 1, zero_init=True))
    assert st.buffers_bytes == 2 * 500_000_000 + 8192 ** 2 + 128 + 64
    # without dtypes (a transcribed family, a recorded run): 4 B an element, the training dtype's under zero.Init
    plain = ModelSpec("toy", (10, 7, 5), ((), (0,), (1,), (2,)), (32, 32))
    assert model_states(plain, setup(2, 1)).buffers_bytes == 2 * 32 * 4
    assert model_states(plain, setup(3, 1, zero_init=True)).buffers_bytes == 2 * 500_000_000 + 2 * 32 * 2
