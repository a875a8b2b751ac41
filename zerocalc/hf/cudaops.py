"""What a CUDA device runs where the CPU runs a model's code otherwise, for the traces (`memtrace`,
`optrace`): the H200 the rows ran on, torch 2.11.0+cu130 with the cuDNN its wheel pins (9.19), bf16.

- dropout: `at::dropout` calls the fused `native_dropout` on CUDA (`is_fused_kernel_acceptable`:
  0 < p < 1, training, a non-empty input), which keeps a bool mask for backward; the CPU draws a
  noise tensor of the input's dtype (empty_like, bernoulli_, div_) and keeps it. CUDA's kernel
  allocates the mask before the output, which it returns second (`allocation_order`);
- scaled_dot_product_attention: CUDA picks a kernel by `sdp::select_sdp_backend` (`sdpa_backend`),
  the CPU by its own rules: its flash kernel takes no dropout and no unequal head dims and falls back
  to the math path, which keeps every score of a layer in fp32 for backward. CUDA's fused kernels
  apply dropout inside (a philox seed and offset) and keep the output and the log-sum-exp only.

torch is imported lazily (by `memtrace` and `optrace`, which call this); `zerocalc` itself stays torch-free.
"""
from contextlib import contextmanager

# sdp_utils.cpp (torch 2.11) on an H200: cuDNN first (`check_prefer_cudnn_attention`: sm90 with a
# runtime cuDNN past 9.15), head dims up to 256 (sm90 with cuDNN >= 9.5.1), dropout taken at any p.
CUDNN_MAX_HEAD_DIM = 256
FLASH_MAX_HEAD_DIM = 256
HALF = ("torch.float16", "torch.bfloat16")

# Operators whose CUDA kernel allocates its outputs in another order than it returns them: the returned
# outputs' positions in the order of allocation. `native_dropout` returns (output, mask); CUDA's
# `dropout_cuda` (Dropout.cu, torch 2.11) makes the mask (`empty_like` of dtype bool) before the output.
ALLOCATION_ORDER = {"aten.native_dropout.default": (1, 0)}


def allocation_order(name: str, out):
    """`out`, an operator's outputs, in the order CUDA's kernel allocates them (`ALLOCATION_ORDER`);
    as returned for every other operator. Which storage comes first decides where the caching
    allocator places each (the H200 row of Phi-2 at 4 x 2048 tokens, data/README.md)."""
    order = ALLOCATION_ORDER.get(name)
    return tuple(out[i] for i in order) if order and isinstance(out, tuple) else out


def sdpa_backend(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False) -> str:
    """The kernel torch 2.11's `select_sdp_backend` runs on an H200 for dense 4-d inputs: "cudnn",
    "flash", "efficient" or "math", the first whose checks pass in that order (`can_use_cudnn_attention`:
    fp16/bf16, head dims at most 256 and multiples of 8, any mask, dropout and grouped heads;
    `can_use_flash_attention`: no mask, equal head dims at most 256, fp16/bf16, causal only square;
    `can_use_mem_efficient_attention`: equal query and key head dims, multiples of 8 (4 in fp32)).
    Dropout decides nothing here (the cuDNN 9.19 the wheel pins takes it, and the 1/16 resolution
    check came after the 2.11 branch cut). The H200 history of Gemma-2-2B with SDPA
    (`data/snapshots/hf-diag/`, head dim 256, grouped heads) shows cuDNN's calls: its seed and
    offset (8 bytes each), the output and the log-sum-exp, a 256-byte workspace."""
    heads_q, heads_k = q.shape[1], k.shape[1]
    heads_ok = heads_q == heads_k or (enable_gqa and heads_q % heads_k == 0 and heads_k == v.shape[1])
    strides_ok = all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    dense = q.dim() == k.dim() == v.dim() == 4 and heads_ok and min(q.shape[-2], k.shape[-2]) > 0
    d_qk, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    half = str(q.dtype) in HALF
    if (dense and strides_ok and half and d_qk == d_k and k.shape[-2] != 1
            and max(d_qk, d_v) <= CUDNN_MAX_HEAD_DIM and d_qk % 8 == 0 and d_v % 8 == 0):
        return "cudnn"
    if (dense and strides_ok and half and attn_mask is None and d_qk == d_k == d_v <= FLASH_MAX_HEAD_DIM
            and (not is_causal or q.shape[-2] == k.shape[-2])):
        return "flash"
    align = 8 if half else 4
    if (dense and all(t.stride(-1) == 1 for t in (q, k, v)) and d_qk == d_k and d_qk % align == 0
            and d_v % align == 0 and str(q.dtype) in HALF + ("torch.float32",)):
        return "efficient"
    return "math"


def _fused_ops():
    """`zerocalc::fused_attention` and its backward: what a fused CUDA kernel allocates where the CPU
    has none for the call (query and value head dims that differ: latent attention's 192 and 128).
    Forward: the output (the query's shape with the value's head dim) and the log-sum-exp, fp32 per
    query position and head, both kept; backward: the three input gradients. Uninitialised, on real
    tensors too: only the allocations matter."""
    import torch
    if hasattr(torch.ops.zerocalc, "fused_attention"):
        return torch.ops.zerocalc.fused_attention
    lib = torch.library.Library("zerocalc", "DEF")       # noqa: F841 (kept alive by torch's registry)
    _fused_ops.lib = lib
    lib.define("fused_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float? scale) -> (Tensor, Tensor)")
    lib.define("fused_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               "Tensor? mask, bool causal, float? scale) -> (Tensor, Tensor, Tensor)")

    def forward(q, k, v, mask, causal, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def backward(grad, q, k, v, out, lse, mask, causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lib.impl("fused_attention", forward, "CPU")
    lib.impl("fused_attention_backward", backward, "CPU")
    torch.library.register_fake("zerocalc::fused_attention", forward, lib=lib)
    torch.library.register_fake("zerocalc::fused_attention_backward", backward, lib=lib)

    def setup_context(ctx, inputs, output):
        q, k, v, mask, causal, scale = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1])
        ctx.mask, ctx.causal, ctx.scale = mask, causal, scale
        ctx.set_materialize_grads(False)       # the log-sum-exp takes no gradient: none made

    def grads(ctx, grad, _lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.zerocalc.fused_attention_backward(grad, q, k, v, out, lse, ctx.mask, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None
    torch.library.register_autograd("zerocalc::fused_attention", grads, setup_context=setup_context)
    return torch.ops.zerocalc.fused_attention


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """`at::_scaled_dot_product_attention_math` (torch 2.11, attention.cpp) as CUDA runs it: fp16/bf16
    upcast to fp32, q and k each scaled by the square root of the scale, a causal mask made as an
    [s, s] bool and turned additive, grouped heads repeated, the mask added to the scores in place
    (a fake tensor, being a tensor subclass, gets an out-of-place add there), softmax, dropout by
    the fused kernel (a bool mask kept), the output cast back, and the probabilities' cast the op
    also returns, dropped by the caller."""
    import torch
    dtype = query.dtype
    up = (lambda t: t.float()) if str(dtype) in HALF else (lambda t: t)
    q, k, v = up(query), up(key), up(value)
    factor = (scale if scale is not None else q.shape[-1] ** -0.5) ** 0.5
    q = q * factor
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, torch.tensor(0.0, dtype=q.dtype), torch.tensor(float("-inf"), dtype=q.dtype))
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn.add_(attn_mask)
    attn = torch._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    out = torch.matmul(attn, v).to(dtype)
    attn.to(dtype)
    return out


@contextmanager
def cuda_dispatch():
    """Dropout and SDPA as CUDA runs them (the module's docstring), `torch.nn.functional`'s two
    functions replaced while the model runs (modules and transformers look them up at each call):
    dropout through `native_dropout` where the fused kernel takes it; SDPA by `sdpa_backend`: a fused
    kernel runs without its dropout (applied inside, nothing kept for it) as the CPU's flash kernel
    (output and log-sum-exp), or as `zerocalc::fused_attention` where the head dims differ; the math
    path as `_math`."""
    import torch
    F = torch.nn.functional
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def fused_dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and input.numel() > 0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
        backend = sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa)
        if backend == "math":
            return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if query.shape[-1] == value.shape[-1]:
            return sdpa(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[1] != query.shape[1]:
            raise ValueError("grouped heads with unequal head dims: not traced")
        return _fused_ops()(query, key, value, attn_mask, is_causal, scale)[0]

    F.dropout, F.scaled_dot_product_attention = fused_dropout, sdpa_kernel
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa
