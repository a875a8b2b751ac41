"""What the trace allocates where CUDA runs a model's code otherwise than the CPU (`zerocalc.hf.cudaops`):
SDPA's kernel chosen as torch 2.11 chooses it on an H200, dropout inside the fused kernels and as
`native_dropout` elsewhere, the math path, latent attention's unequal head dims; each by hand."""
import contextlib
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from zerocalc.hf import cudaops, memtrace, trace  # noqa: E402

B, HEADS, S, D = 2, 4, 8, 16          # a query of 2 x 4 x 8 x 16 bf16: 1,024 elements, 2,048 bytes


class _Kept(TorchDispatchMode):
    """The storages made while it is active, and those still alive: what the call keeps for backward."""

    def __init__(self):
        super().__init__()
        self.made, self.alive = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.alive:
                st = t.untyped_storage()
                self.alive[st._cdata] = st.nbytes()
                self.made.append(st.nbytes())
                weakref.finalize(st, self.alive.pop, st._cdata, None)
        return out

    def kept(self) -> list[int]:
        return sorted(self.alive.values())


def _qkv(d=D, dv=D, heads_kv=HEADS, mode=None):
    with mode:
        return (torch.randn(B, HEADS, S, d, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(B, heads_kv, S, d, dtype=torch.bfloat16, requires_grad=True),
                torch.randn(B, heads_kv, S, dv, dtype=torch.bfloat16, requires_grad=True))


def _attend(cuda: bool, dropout: float, d=D, dv=D, heads_kv=HEADS, mask=False, gqa=False):
    """(kept bytes, made bytes, the output) of one causal SDPA call on fake tensors."""
    mode = FakeTensorMode()
    q, k, v = _qkv(d, dv, heads_kv, mode)
    with mode:
        m = torch.zeros(B, 1, S, S, dtype=torch.bfloat16) if mask else None
    rec = _Kept()
    with mode, (cudaops.cuda_dispatch() if cuda else contextlib.nullcontext()), rec:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout,
                                                               is_causal=not mask, enable_gqa=gqa)
    return rec.kept(), rec.made, out


@pytest.mark.parametrize("shape, expected", [
    # (query heads, key/value heads, query/key head dim, value head dim, mask, enable_gqa, dtype)
    ((32, 8, 128, 128, False, True, "bf16"), "cudnn"),      # a Llama: cuDNN first on sm90 (cuDNN 9.19 > 9.15)
    ((8, 1, 256, 256, False, True, "bf16"), "cudnn"),       # Gemma-2B: head dim 256, one key/value head
    ((16, 16, 64, 64, True, False, "bf16"), "cudnn"),       # a float mask (ALiBi folded in): cuDNN takes it
    ((128, 128, 192, 128, False, False, "bf16"), "cudnn"),  # DeepSeek-V3's latent attention: 192 and 128
    ((71, 1, 64, 64, True, False, "bf16"), "math"),         # Falcon-7B under transformers 5.17: one K/V head
                                                            # broadcast without enable_gqa: no kernel takes it
    ((4, 4, 12, 12, False, False, "bf16"), "flash"),        # head dim 12: not cuDNN's (a multiple of 8), flash's
    ((4, 4, 12, 12, True, False, "bf16"), "math"),          # ... with a mask: neither flash nor efficient's
    ((4, 4, 288, 288, False, False, "bf16"), "efficient"),  # past 256: the memory-efficient kernel
    ((4, 4, 64, 64, False, False, "fp32"), "efficient"),    # fp32: neither cuDNN nor flash
])
def test_the_kernel_torch_2_11_picks_on_an_h200(shape, expected):
    hq, hkv, d, dv, mask, gqa, dtype = shape
    with FakeTensorMode():
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        q, k, v = (torch.empty(2, hq, 16, d, dtype=dt), torch.empty(2, hkv, 16, d, dtype=dt),
                   torch.empty(2, hkv, 16, dv, dtype=dt))
        m = torch.zeros(2, 1, 16, 16, dtype=dt) if mask else None
    assert cudaops.sdpa_backend(q, k, v, m, not mask, gqa) == expected


def test_sdpa_with_dropout_keeps_what_cudnn_keeps():
    """Causal SDPA with dropout 0.1 on 2 x 4 heads x 8 positions x 16 (bf16). On the H200 cuDNN takes it
    and applies the dropout inside (a philox seed and offset): kept are the output, 2·4·8·16 x 2 B =
    2,048, and the log-sum-exp, fp32 per head and position, 2·4·8 x 4 B = 256; as without dropout.
    The CPU's math path (its flash kernel takes no dropout) keeps instead: q and k scaled in fp32
    (4,096 each), the softmax and the dropped scores in fp32 (2·4·8·8 x 4 B = 2,048 each), the
    dropout's fp32 noise (2,048), v in fp32 (4,096) and the output (2,048): the s² terms that made
    StarCoderBase-1B's stage-2 row 24% high."""
    kept, made, out = _attend(cuda=True, dropout=0.1)
    assert kept == [256, 2048] and made == [2048, 256]
    assert _attend(cuda=True, dropout=0.0)[0] == kept
    cpu, _, _ = _attend(cuda=False, dropout=0.1)
    assert cpu == sorted([4096, 4096, 2048, 2048, 2048, 4096, 2048])


def test_the_fused_kernels_backward_is_one_operator_and_its_workspace():
    """Backward of the call above: the three input gradients (2,048 B each) from one operator, whose
    workspace the allocation sequence adds (`memtrace.SDPA_BACKWARD`: two fp32 copies of the query
    and the log-sum-exp, 8·1,024 + 4·64 = 8,448 B, the H200 histories')."""
    mode = FakeTensorMode()
    q, k, v = _qkv(mode=mode)
    rec, names = _Kept(), []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))
    with mode, cudaops.cuda_dispatch(), rec, Names():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        out.backward(torch.ones_like(out))
    assert [n for n in names if n in memtrace.SDPA_BACKWARD] == \
        ["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    # forward: output, log-sum-exp; the output's gradient (ones); backward: dq, dk, dv
    assert rec.made[:6] == [2048, 256, 2048, 2048, 2048, 2048]


def test_dropout_keeps_a_bool_mask_on_cuda():
    """nn.Dropout on 2 x 8 x 16 bf16 (512 B): CUDA's fused `native_dropout` makes the output (512 B)
    and keeps a bool mask, 1 B an element (256 B); the CPU draws a bf16 noise tensor (512 B) and keeps
    it: StarCoder2's residual and embedding dropouts, 1 byte an element less."""
    mode = FakeTensorMode()
    with mode:
        x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    for cuda, kept in ((True, [256, 512]), (False, [512, 512])):
        rec = _Kept()
        with mode, (cudaops.cuda_dispatch() if cuda else contextlib.nullcontext()), rec:
            y = torch.nn.functional.dropout(x, 0.1, True)
        assert rec.kept() == kept
    with mode, cudaops.cuda_dispatch():
        assert torch.nn.functional.dropout(x, 0.0, True) is x        # p = 0: the input itself, as on the CPU


def test_dropout_allocates_its_mask_before_its_output():
    """`native_dropout` returns (output, mask); CUDA's `dropout_cuda` (Dropout.cu, torch 2.11) allocates
    the mask first (`empty_like` as bool), then the output. The recorders take an operator's new
    storages in CUDA's order: on 2 x 8 x 16 bf16, the mask's 256 B (1 B an element), then the output's
    512 B; any other operator's as returned (native_layer_norm: the output's 512 B, then mean and
    rstd, 2 x 8 bf16 = 32 B each)."""
    mode = FakeTensorMode()
    with mode:
        x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
        w = torch.ones(16, dtype=torch.bfloat16)
        dropped = torch.ops.aten.native_dropout.default(x, 0.1, True)
        normed = torch.ops.aten.native_layer_norm.default(x, [16], w, w, 1e-5)

    def order(func, out):
        return [st.nbytes() for _, st in memtrace._new_storages(out, {}, func)]
    assert [t.untyped_storage().nbytes() for t in dropped] == [512, 256]       # as returned
    assert order(torch.ops.aten.native_dropout.default, dropped) == [256, 512]
    assert order(torch.ops.aten.native_layer_norm.default, normed) == [512, 32, 32]


def test_the_math_path_as_cuda_runs_it():
    """Head dim 12 with a mask: no fused kernel on the H200 (cuDNN and the efficient kernel need a
    multiple of 8, flash no mask), so the math path (fp32, 2 x 4 x 8 x 12 = 768 elements): kept are q
    and k scaled (3,072 B each), v in fp32 (3,072), the softmax (2·4·8·8 x 4 B = 2,048), the dropped
    scores (2,048) and the dropout's bool mask (512), and the output cast to bf16 (1,536); the scores
    get the mask in place, as on CUDA, and the probabilities' bf16 cast (1,024) is dropped."""
    kept, made, out = _attend(cuda=True, dropout=0.1, d=12, dv=12, mask=True)
    assert kept == sorted([3072, 3072, 3072, 2048, 2048, 512, 1536])
    assert made == [3072, 3072, 3072, 3072, 3072, 2048, 2048, 2048, 512, 3072, 1536, 1024]


def test_latent_attentions_unequal_head_dims_keep_the_output_and_log_sum_exp():
    """Query and key head dim 24, value 16 (DeepSeek's 192 and 128, scaled down): cuDNN takes it; the
    CPU's flash kernel cannot, its math path would keep the fp32 scores. Traced as the kernel: the
    output 2·4·8·16 x 2 B = 2,048 and the log-sum-exp 256; backward the gradients of q and k (2·4·8·24
    x 2 B = 3,072 each) and v (2,048)."""
    kept, made, out = _attend(cuda=True, dropout=0.0, d=24, dv=16)
    assert kept == [256, 2048] and tuple(out.shape) == (B, HEADS, S, 16)
    mode = FakeTensorMode()
    q, k, v = _qkv(24, 16, mode=mode)
    rec = _Kept()
    with mode, cudaops.cuda_dispatch(), rec:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    assert rec.made == [2048, 256, 2048, 3072, 3072, 2048]     # output, log-sum-exp, its gradient, dq, dk, dv


def test_dropout_inside_the_kernel_keeps_nothing_per_score():
    """A GPTBigCode layer (h 64, 4 heads of 16, one key/value head) with every dropout at 0.1 against
    the same at 0: per token the two residual dropouts each keep a bool mask of h (2·64 B); the
    attention dropout keeps nothing (inside cuDNN's kernel) and no byte grows with s²."""
    def kept(p):
        cfg = transformers.GPTBigCodeConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            multi_query=True, attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
        cfg._attn_implementation = "sdpa"
        model, mode = trace.build(cfg)
        return memtrace.layer_activations(model, mode)
    with_dropout, without = kept(0.1), kept(0.0)
    assert with_dropout["bytes_per_sequence_squared"] == without["bytes_per_sequence_squared"] == 0
    assert with_dropout["bytes_per_token"] - without["bytes_per_token"] == 2 * (2 * 64)
