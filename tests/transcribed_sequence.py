"""The transcribed layers: seed-gpt's and hf-llama's forward and backward written allocation by
allocation from the H200 allocator histories (`data/snapshots/`), parametric in the model's
dimensions. `zerocalc.sequence` plays the families' traced streams (`zerocalc/family_streams.json`);
these hand-written sequences are the oracle those streams are checked against
(`tests/test_family_stream.py`), with DeepSpeed's side (`sequence._Stage`, `_Stage3`) as it is.

`events` is the whole job as the transcription generates it: init, then per micro-step the
embedding's output, the layers, the final norm, the logits and the validator's fp32 loss, and
backward, with every gradient handed to DeepSpeed's hook.
"""
from zerocalc.model import ModelSpec
from zerocalc.sequence import (CUBLAS_WORKSPACE_BYTES, REDUCTION_STAGING_BYTES, _Stage, _Stage3, _Trace,
                               _to_device_order)
from zerocalc.training import Setup, Stage


def _sum_over_tokens(t: "_Trace", tokens: int, width: int) -> None:
    """A norm's weight or a bias gradient: a [tokens, width] tensor summed over its tokens. PyTorch's
    reduction splits the tokens across thread blocks and stages partial sums in a global-memory
    buffer from the caching allocator (Reduce.cuh), freed at once: 8 bytes per input element up to
    132 MiB on H200 (every seed-gpt and hf-llama history: 12 MiB at 2048 x 768 ... 128 MiB at 8192 x
    2048; 132 MiB at 16384 x 2048, 4096 x 8192, 32768 x 768). The cap depends on how many blocks the
    GPU runs at once; another GPU's is not measured."""
    t.free(t.alloc(min(8 * tokens * width, REDUCTION_STAGING_BYTES)))


def _handles(kept) -> list:
    """The handles of a layer's kept tensors: a dict of name -> handle (or pair of handles), or a
    list of (handle, bytes)."""
    if isinstance(kept, dict):
        return [h for v in kept.values() for h in (v if isinstance(v, tuple) else (v,))]
    return [h for h, _n in kept]


class _SeedGpt:
    """seed-gpt's layer (LayerNorm → nn.MultiheadAttention, eager with need_weights → LayerNorm →
    Linear, GELU, Linear), allocation by allocation as the H200 histories record it: at stages 0-2
    (nn.Linear) forward and backward (`_forward_linear`, `_backward_linear`); at stage 3
    (LinearFunctionForZeroStage3) the forward, and the backward at the granularity of the kept
    tensors (each freed beside a gradient of its size), which reproduces the stage-3 histories to
    0.1%. The residual stream's gradient is one tensor that autograd accumulates in place through
    the layers (an 8 MiB block of the 1.4B GPT's history lives from backward's start past the first
    bucket's reduction, `snapshots/t5-process/`)."""

    def __init__(self, t: _Trace, arch, setup: Setup):
        self.t, self.arch, self.setup = t, arch, setup
        self.th = setup.param_bytes * setup.micro_batch * setup.seq_len * arch.hidden_size

    def _sizes(self):
        """(b, T, h, f, and the bytes of a hidden state b·T·h, an MLP activation b·T·f, and the
        attention scores b·micro-batch·heads·s²)."""
        setup, arch = self.setup, self.arch
        b, tok, h, f = setup.param_bytes, setup.micro_batch * setup.seq_len, arch.hidden_size, arch.ffn_hidden_size
        return b, tok, h, f, b * tok * h, b * tok * f, b * setup.micro_batch * arch.num_heads * setup.seq_len ** 2

    def _forward(self, x: int) -> tuple[int, dict | list]:
        if self.setup.stage == Stage.PARAMETERS:
            return self._forward_stage3(x)
        return self._forward_linear(x)

    def _forward_linear(self, x: int) -> tuple[int, dict]:
        """Stages 0-2 (nn.Linear): the layer as its H200 history records it (`snapshots/t6-overlap/
        seed-gpt-h2048-l24-s2-bf16-n2-b4x1024-*`, events 1030-1076). nn.MultiheadAttention with
        batch_first gets transposed views: each of the q, k, v projections copies its input
        contiguous (kept by the projection for its weight gradient) and makes its output; q's output
        is scaled into a copy and dropped, the layer norm outputs are dropped after attention; the
        need_weights average is made and dropped. Returns (output, the kept tensors by name)."""
        t = self.t
        b, tok, h, f, th, tf, att = self._sizes()
        st = 4 * tok                                  # a LayerNorm's mean and rstd, fp32 per token
        kept = {"x": x}
        normed = []
        for k in "abc":                               # ln1(x) once each for query, key and value
            normed.append(t.alloc(th))
            kept["s1" + k] = (t.alloc(st), t.alloc(st))
        kept["q_in"], q_out = t.alloc(th), t.alloc(th)
        kept["k_in"], kept["k"] = t.alloc(th), t.alloc(th)
        kept["v_in"], kept["v"] = t.alloc(th), t.alloc(th)
        kept["q"] = t.alloc(th)                       # q scaled
        scores = t.alloc(att)
        kept["softmax"] = t.alloc(att)
        t.free(scores)
        ctx = t.alloc(th)
        kept["ctx"] = t.alloc(th)                     # the attention output made contiguous
        t.free(ctx)
        proj = t.alloc(th)                            # out_proj
        avg = t.alloc(b * self.setup.micro_batch * self.setup.seq_len ** 2)   # head-averaged weights
        t.free(q_out, *normed, avg)
        kept["res"] = t.alloc(th)                     # the residual after attention
        t.free(proj)
        kept["n2"], kept["s2"] = t.alloc(th), (t.alloc(st), t.alloc(st))
        kept["fc1"], kept["gelu"] = t.alloc(tf), t.alloc(tf)
        fc2 = t.alloc(th)
        out = t.alloc(th)
        t.free(fc2)
        return out, kept

    def _forward_stage3(self, x: int) -> tuple[int, list]:
        """Stage 3 (LinearFunctionForZeroStage3 in place of nn.Linear): the forward with which the
        stage-3 histories are reproduced to 0.1% (not checked allocation by allocation); the kept
        tensors in order, each with its size."""
        t = self.t
        b, tok, h, f, th, tf, att = self._sizes()
        kept = []

        def keep(n):
            kept.append((t.alloc(n), n))
            return kept[-1][0]

        kept.append((x, th))                          # the layer's input stays alive for its backward
        for _ in range(3):                            # ln1(x) once each for query, key and value
            keep(th)
        for _ in range(3):                            # q, k, v projections
            keep(th)
        qs = t.alloc(th)
        scores = t.alloc(att)
        keep(att)                                     # softmax
        t.free(scores)
        ao = t.alloc(th)
        keep(th)                                      # attention output made contiguous
        t.free(ao)
        proj = t.alloc(th)
        avg = t.alloc(b * self.setup.micro_batch * self.setup.seq_len ** 2)   # head-averaged weights (need_weights)
        t.free(qs, avg)
        keep(th)                                      # the residual after attention
        t.free(proj)
        keep(th)                                      # ln2
        keep(tf)                                      # fc1
        keep(tf)                                      # GELU
        fc2 = t.alloc(th)
        out = t.alloc(th)
        t.free(fc2)
        return out, kept

    def final_norm(self, x: int):
        """The final LayerNorm's output; its input, the last layer's output, lives to the loss."""
        out = self.t.alloc(self.th)
        return out, {"input": x, "out": out}

    def after_loss(self, saved: dict) -> None:
        self.t.free(saved["input"])

    def final_norm_backward(self, saved: dict, g_out: int) -> int:
        return g_out

    def forward(self, x: int, first: bool):
        """(output, what backward needs): the kept tensors, or under checkpointing the input alone."""
        out, kept = self._forward(x)
        if not self.setup.activation_checkpointing:
            return out, kept
        self.t.free(*(h for h in _handles(kept) if h != x))
        return out, {"x": x} if isinstance(kept, dict) else [(x, self.th)]

    def _bias_grads(self, widths) -> None:
        """ZeRO-3's LinearFunctionForZeroStage3.backward sums a 3-d output gradient for the bias
        (`_sum_over_tokens`: 128 MiB for the 1.4B GPT's fc1 at 2x1024 tokens, 96 MiB for the 160M
        one's at 4x1024)."""
        if self.setup.stage == Stage.PARAMETERS:
            for w in widths:
                _sum_over_tokens(self.t, self.setup.micro_batch * self.setup.seq_len, w)

    def backward(self, kept, grad: int, hook) -> int:
        if self.setup.stage != Stage.PARAMETERS:
            return self._backward_linear(kept, grad, hook)
        t, arch = self.t, self.arch
        if self.setup.activation_checkpointing:        # rebuild the layer from its saved input
            y, rebuilt = self._forward(kept[0][0])
            t.free(y)
            kept = kept[:1] + [k for k in rebuilt if k[0] != kept[0][0]]
        self._bias_grads((arch.hidden_size, arch.ffn_hidden_size))          # fc2, fc1
        for handle, n in reversed(kept):
            g = t.alloc(n)
            t.free(handle, g)
        self._bias_grads((arch.hidden_size,) * 3)                           # v, k, q (in_proj)
        for k in reversed(range(12)):                  # _seed_gpt_layer's parameters, last first
            hook(k)
        return grad                                    # the residual stream's gradient, accumulated in place

    def _backward_linear(self, kept: dict, grad: int, hook) -> int:
        """Stages 0-2: one layer's backward as its H200 history records it (autograd's thread, no call
        sites: the order and sizes of `snapshots/t6-overlap/seed-gpt-h2048-l24-s2-bf16-n2-b4x1024-*`,
        events 6965-7174, with these formulas). `hook(index, handle)` hands a parameter's gradient
        (_seed_gpt_layer's order) to DeepSpeed. A bias's gradient is summed over the tokens through the
        reduction's staging buffer (`_sum_over_tokens`); the gradient flowing between layers is
        accumulated in place."""
        t = self.t
        if self.setup.activation_checkpointing:        # rebuild the layer from its saved input
            y, kept = self._forward(kept["x"])
            t.free(y)
        b, tok, h, f, th, tf, att = self._sizes()
        wh, wf = b * h * h, b * f * h
        # MLP: fc2, GELU, fc1
        g_gelu, w = t.alloc(tf), t.alloc(wf)
        bias = t.alloc(b * h)
        _sum_over_tokens(t, tok, h)
        t.free(kept["gelu"])
        hook(11, bias)
        hook(10, w)
        g_fc1 = t.alloc(tf)
        t.free(g_gelu, kept["fc1"])
        g_n2, w, bias = t.alloc(th), t.alloc(wf), t.alloc(b * f)
        _sum_over_tokens(t, tok, f)
        t.free(g_fc1, kept["n2"])
        hook(9, bias)
        hook(8, w)
        # ln2, its input gradient added into the residual stream's
        g_res, w, bias = t.alloc(th), t.alloc(b * h), t.alloc(b * h)
        t.free(g_n2, kept["res"], *kept["s2"], g_res)
        hook(6, w)
        hook(7, bias)
        # out_proj
        g_out, g_ctx, w, bias = t.alloc(th), t.alloc(th), t.alloc(wh), t.alloc(b * h)
        _sum_over_tokens(t, tok, h)
        t.free(g_out, kept["ctx"])
        hook(5, bias)
        hook(4, w)
        # attention: softmax · v, softmax, q · kᵀ
        g_v, g_att = t.alloc(th), t.alloc(att)
        t.free(g_ctx, kept["v"])
        a1, a2 = t.alloc(att), t.alloc(att)
        t.free(a2, g_att, kept["softmax"])
        g_q, g_k = t.alloc(th), t.alloc(th)
        t.free(a1, kept["k"], kept["q"])
        g_q2 = t.alloc(th)
        t.free(g_k)
        g_k2 = t.alloc(th)
        t.free(g_v)
        g_v2 = t.alloc(th)
        t.free(g_q2)
        # in_proj, chunk by chunk (v, k, q), then its gradients concatenated
        biases, weights, g_in = [], [], []
        for g_chunk, saved, contiguous in ((g_k2, "v_in", True), (g_q, "k_in", False), (g_v2, "q_in", True)):
            biases.append(t.alloc(b * h))
            if contiguous:
                _sum_over_tokens(t, tok, h)
                weights.append(t.alloc(wh))
                g_in.append(t.alloc(th))
                t.free(g_chunk, kept[saved])
            else:                                      # k's gradient copied contiguous first, no staging
                copy = t.alloc(th)
                t.free(g_chunk)
                weights.append(t.alloc(wh))
                g_in.append(t.alloc(th))
                t.free(copy, kept[saved])
        cat = t.alloc(3 * b * h)
        t.free(*reversed(biases))
        hook(3, cat)
        cat = t.alloc(3 * wh)
        t.free(*reversed(weights))
        hook(2, cat)
        # ln1, three times (v's, k's, q's input), into x's gradient
        grads_w = []
        for k, g_chunk in zip("cba", g_in):
            g_x, w, bias = t.alloc(th), t.alloc(b * h), t.alloc(b * h)
            t.free(t.alloc(th), g_chunk)
            if k == "a":
                t.free(kept["x"])
            t.free(*kept["s1" + k], g_x)
            grads_w.append((w, bias))
            if k != "c":
                t.free(w, bias)                        # added into the first application's gradients
        hook(0, grads_w[0][0])
        hook(1, grads_w[0][1])
        return grad


class _LlamaSizes:
    """Bytes of one hf-llama layer's tensors (T = micro-batch · sequence tokens, b = dtype bytes)."""

    def __init__(self, arch, setup: Setup):
        b, tok = setup.param_bytes, setup.micro_batch * setup.seq_len
        kv_dim = arch.num_kv_heads * arch.head_dim
        self.tokens, self.width = tok, arch.hidden_size
        self.h = b * tok * arch.hidden_size               # hidden states
        self.f32 = 4 * tok * arch.hidden_size             # RMSNorm's fp32 upcast
        self.f = b * tok * arch.ffn_hidden_size           # MLP activations
        self.kv = b * tok * kv_dim                        # k, v
        self.lse = 4 * tok * arch.num_heads               # sdpa's log-sum-exp, fp32 per head
        self.w_q = b * arch.hidden_size ** 2              # q_proj, o_proj weight gradients
        self.w_kv = b * kv_dim * arch.hidden_size         # k_proj, v_proj
        self.w_f = b * arch.ffn_hidden_size * arch.hidden_size   # gate, up, down


def _rms_norm(t: _Trace, z: _LlamaSizes, kept: dict, name: str) -> None:
    """LlamaRMSNorm saving for backward: fp32 copy (kept), pow (freed), rsqrt·x in fp32 (freed),
    the cast back and the weight's product (kept)."""
    kept[name + "_f32"] = t.alloc(z.f32)
    t.free(t.alloc(z.f32))
    tmp = t.alloc(z.f32)
    kept[name + "_cast"] = t.alloc(z.h)
    kept[name + "_out"] = t.alloc(z.h)
    t.free(tmp)


def _rotary(t: _Trace, n: int) -> int:
    """apply_rotary_pos_emb on a tensor of n bytes: q·cos, rotate_half's half and concatenation,
    ·sin, the sum (returned; the rest freed)."""
    a, half = t.alloc(n), t.alloc(n // 2)
    cat = t.alloc(n)
    t.free(half)
    s = t.alloc(n)
    t.free(cat)
    out = t.alloc(n)
    t.free(a, s)
    return out


def _llama_forward(t: _Trace, z: _LlamaSizes, x: int, keep_input: bool, recompute: bool = False):
    """LlamaDecoderLayer with sdpa, allocation by allocation as the H200 histories record it
    (transformers 5.17: modeling_llama.py). Returns (output handle or None, kept handles by name).
    recompute: checkpointing's rebuild in backward, which stops once the MLP's saved tensors exist
    (torch.utils.checkpoint's early stop) and frees the attention residual."""
    kept = {}
    _rms_norm(t, z, kept, "n1")
    q, k = t.alloc(z.h), t.alloc(z.kv)
    kept["v"] = t.alloc(z.kv)
    kept["q_rot"], kept["k_rot"] = _rotary(t, z.h), _rotary(t, z.kv)
    t.free(q, k)
    kept["attn"], kept["lse"] = t.alloc(z.h), t.alloc(z.lse)
    o = t.alloc(z.h)
    res1 = t.alloc(z.h)
    t.free(o)
    _rms_norm(t, z, kept, "n2")
    for name in ("gate", "silu", "up", "prod"):
        kept[name] = t.alloc(z.f)
    if recompute:
        t.free(res1)
        return None, kept
    down = t.alloc(z.h)
    out = t.alloc(z.h)
    t.free(down, res1)
    if not keep_input:   # LlamaModel.forward's hidden_states holds the input until the layer returns
        t.free(x)
    return out, kept


def _llama_forward_unsaved(t: _Trace, z: _LlamaSizes, x: int) -> int:
    """The layer's forward under activation checkpointing: nothing is saved for backward, so each
    tensor is freed as soon as the code drops it (H200 history, events 866-991); x, the layer's
    input, is what checkpointing keeps. Returns the output."""
    def rms_norm():   # its fp32 copy is freed once the normalised product exists
        f32, pow_ = t.alloc(z.f32), t.alloc(z.f32)
        t.free(pow_)
        xr = t.alloc(z.f32)
        t.free(f32)
        cast = t.alloc(z.h)
        out = t.alloc(z.h)
        t.free(cast, xr)
        return out

    n1 = rms_norm()
    q, k, v = t.alloc(z.h), t.alloc(z.kv), t.alloc(z.kv)
    qe, ke = _rotary(t, z.h), _rotary(t, z.kv)
    t.free(q, k)
    o = t.alloc(z.h)
    t.free(t.alloc(z.lse))
    p = t.alloc(z.h)
    t.free(o, qe, ke, v, n1)
    res1 = t.alloc(z.h)
    t.free(p)
    n2 = rms_norm()
    gate, silu = t.alloc(z.f), t.alloc(z.f)
    t.free(gate)
    up = t.alloc(z.f)
    prod = t.alloc(z.f)
    t.free(silu, up)
    down = t.alloc(z.h)
    t.free(prod, n2)
    out = t.alloc(z.h)
    t.free(down, res1)
    return out


def _rms_norm_backward(t: _Trace, z: _LlamaSizes, kept: dict, name: str, g_in: int, keep_grad: bool):
    """LlamaRMSNorm's backward through its fp32 upcast (the history's events 3750-3807): frees the
    norm's saved tensors and g_in, the gradient of its output. keep_grad: return the gradient of its
    input (the final norm's, which flows into the last layer), else it is added in place."""
    a1, a2 = t.alloc(z.h), t.alloc(z.h)
    t.free(kept[name + "_cast"])
    _sum_over_tokens(t, z.tokens, z.width)     # the weight's gradient
    t.free(a2, g_in)
    b1 = t.alloc(z.f32)
    t.free(a1)
    b2, b3 = t.alloc(z.f32), t.alloc(z.f32)
    t.free(b2, b1)
    c = [t.alloc(z.f32) for _ in range(4)]
    t.free(c[2], c[1], kept[name + "_f32"], c[0], c[3])
    d = t.alloc(z.h)
    t.free(b3)
    if keep_grad:
        return d
    t.free(d)
    return None


def _rotary_backward(t: _Trace, n: int, g_rot: int) -> int:
    """apply_rotary_pos_emb's backward for a tensor of n bytes (the history's events 3835-3863):
    frees g_rot, the rotated tensor's gradient; returns a gradient the projection's backward frees."""
    a, half = t.alloc(n), t.alloc(n // 2)
    kept = t.alloc(n)
    t.free(half)
    b = t.alloc(n)
    t.free(a, b)
    c = t.alloc(n)
    t.free(g_rot, c)
    return kept


def _llama_backward(t: _Trace, z: _LlamaSizes, kept: dict, hook) -> None:
    """One LlamaDecoderLayer's backward (autograd's thread: no call sites are recorded, so the order
    is the H200 history's, `data/snapshots/t4-warmup/hf-llama-h2048-l22-s2-...-0729e40f46`, events
    3710-3957, with its sizes as these formulas). `hook(name, handle)` hands a weight gradient to
    DeepSpeed. The gradient flowing between layers is accumulated in place: not allocated here."""
    # MLP
    w = t.alloc(z.w_f)                             # down_proj's weight gradient
    g_prod = t.alloc(z.f)
    t.free(kept["prod"])
    hook("down", w)
    g_silu, g_up = t.alloc(z.f), t.alloc(z.f)
    t.free(kept["silu"], kept["up"], g_prod)
    w = t.alloc(z.w_f)                             # up_proj
    gx_up = t.alloc(z.h)
    t.free(g_silu)
    hook("up", w)
    g_gate = t.alloc(z.f)
    t.free(kept["gate"], g_up)
    w = t.alloc(z.w_f)                             # gate_proj
    gx_gate = t.alloc(z.h)
    t.free(kept["n2_out"], g_gate)
    gx = t.alloc(z.h)
    t.free(gx_up, gx_gate)
    hook("gate", w)
    _rms_norm_backward(t, z, kept, "n2", gx, keep_grad=False)
    # attention
    w = t.alloc(z.w_q)                             # o_proj
    g_attn = t.alloc(z.h)
    hook("o", w)
    g_q, g_k, g_v = t.alloc(z.h), t.alloc(z.kv), t.alloc(z.kv)
    t.free(t.alloc(2 * z.f32 + z.lse))             # sdpa's backward workspace
    t.free(kept["attn"], kept["lse"], kept["v"], kept["q_rot"], kept["k_rot"], g_attn)
    r3 = _rotary_backward(t, z.kv, g_k)
    s3 = _rotary_backward(t, z.h, g_q)
    w = t.alloc(z.w_kv)                            # v_proj
    gx_v = t.alloc(z.h)
    t.free(g_v)
    hook("v", w)
    tmp = t.alloc(z.kv)
    t.free(r3)
    w = t.alloc(z.w_kv)                            # k_proj
    gx_k = t.alloc(z.h)
    t.free(tmp)
    gx = t.alloc(z.h)
    t.free(gx_v, gx_k)
    hook("k", w)
    u = t.alloc(z.h)
    t.free(s3)
    w = t.alloc(z.w_q)                             # q_proj
    gx_q = t.alloc(z.h)
    t.free(kept["n1_out"], u, gx_q)
    hook("q", w)
    _rms_norm_backward(t, z, kept, "n1", gx, keep_grad=False)


LLAMA_PARAMS = {"q": 0, "k": 1, "v": 2, "o": 3, "gate": 4, "up": 5, "down": 6}   # _llama_layer's order


class _Llama:
    """hf-llama's layer through `_llama_forward` / `_llama_backward`; under checkpointing only the
    input is kept and backward rebuilds the layer first."""

    def __init__(self, t: _Trace, arch, setup: Setup):
        self.t, self.z, self.ckpt = t, _LlamaSizes(arch, setup), setup.activation_checkpointing

    def forward(self, x: int, first: bool):
        """The first layer's input is the embeddings, which LlamaModel.forward holds to its end."""
        if self.ckpt:
            return _llama_forward_unsaved(self.t, self.z, x), {"input": x}
        if first:
            self.embeddings = x
        return _llama_forward(self.t, self.z, x, keep_input=first)

    def final_norm(self, x: int):
        """The model's last RMSNorm (saved for backward); then LlamaModel.forward returns, dropping
        the last layer's output and the embeddings. Returns (output, saved)."""
        saved = {}
        _rms_norm(self.t, self.z, saved, "final")
        self.t.free(x)
        if not self.ckpt:
            self.t.free(self.embeddings)
        return saved["final_out"], saved

    def after_loss(self, saved: dict) -> None:
        pass

    def final_norm_backward(self, saved: dict, g_out: int) -> int:
        """The gradient flowing into the last layer, from the norm's output gradient g_out."""
        return _rms_norm_backward(self.t, self.z, saved, "final", g_out, keep_grad=True)

    def backward(self, saved: dict, grad: int, hook) -> int:
        kept = saved
        if self.ckpt:
            _, kept = _llama_forward(self.t, self.z, saved["input"], keep_input=True, recompute=True)
        _llama_backward(self.t, self.z, kept, lambda name, g: hook(LLAMA_PARAMS[name], g))
        hook(7)                                        # the two RMSNorm weights
        hook(8)
        if self.ckpt:
            self.t.free(saved["input"])
        return grad                                    # accumulated in place


def events(model: ModelSpec, setup: Setup, steps: int = 3, fresh_process: bool = True, rank: int = 0) -> list:
    """The transcription's allocation events of init and `steps` training steps (what
    `zerocalc.sequence.events` generated before the families' streams replaced the layers)."""
    for t, _ in _pieces(model, setup, steps, fresh_process, rank):
        pass
    return t.events


def _pieces(model: ModelSpec, setup: Setup, steps: int, fresh_process: bool, rank: int):
    arch = model.architecture
    t = _Trace()
    workspaces = [] if fresh_process else [t.alloc(CUBLAS_WORKSPACE_BYTES), t.alloc(CUBLAS_WORKSPACE_BYTES)]
    b, tok, v, h = setup.param_bytes, setup.micro_batch * setup.seq_len, arch.vocab_size, arch.hidden_size
    th = b * tok * h
    params = [0] * len(model.param_numels)
    for i in _to_device_order(model):
        params[i] = t.alloc(b * model.param_numels[i])
    s3 = setup.stage == Stage.PARAMETERS
    ds = _Stage3(t, model, setup) if s3 else _Stage(t, model, setup, rank)
    ds.init(params)
    n_params = len(model.param_numels)
    final_norm = 2 if arch.family == "seed-gpt" else 1             # LayerNorm weight and bias; RMSNorm weight
    head = 0 if arch.tie_embeddings else 1
    per_layer = (n_params - 1 - final_norm - head) // arch.num_layers
    layer = (_Llama if arch.family == "hf-llama" else _SeedGpt)(t, arch, setup)
    yield t, workspaces
    for _ in range(steps):
        # The micro-steps of one optimizer step: the first, one in the middle (the rest repeat it on
        # the same cache: simulating all five of GAS 5 gave the same reserved peak on 24 Llama and GPT
        # configurations, stages 0-2, N = 1 and 2, with and without checkpointing) and the boundary.
        for micro in sorted({0, min(1, setup.gas - 1), setup.gas - 1}):
            if s3:
                ds.fetch(backward=False)
            x = t.alloc(th)                                       # embedding output
            if not workspaces:   # forward's first matmul: the rotary angles (hf-llama), in_proj (seed-gpt)
                workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
            saved = []
            for i in range(arch.num_layers):
                x, kept = layer.forward(x, first=i == 0)
                saved.append(kept)
            norm, norm_saved = layer.final_norm(x)
            logits = t.alloc(b * tok * v)
            fp32 = t.alloc(4 * tok * v)                           # logits.float()
            logprobs = t.alloc(4 * tok * v)                       # log_softmax, kept for its backward
            t.free(fp32, logits)
            layer.after_loss(norm_saved)
            # backward of the loss path: nll's fp32 gradient, log_softmax's, the cast back
            g1 = t.alloc(4 * tok * v)
            g2 = t.alloc(4 * tok * v)
            t.free(g1, logprobs)
            if s3:
                ds.fetch(backward=True)
            g3 = t.alloc(b * tok * v)
            t.free(g2)
            # The head's weight gradient (autograd's thread takes its cuBLAS workspace at this first
            # matmul) and the final norm's output gradient; the logits' gradient is freed before the
            # head's hook runs (the bucket comes after it).
            head_grad = t.alloc(b * model.param_numels[-1]) if head else None
            if len(workspaces) < 2:
                workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
            grad = t.alloc(th)                                            # of the final norm's output
            t.free(g3, norm)
            if head:
                ds.grad_ready(n_params - 1, model.param_numels[-1], head_grad)
            grad = layer.final_norm_backward(norm_saved, grad)
            for i in range(n_params - head - final_norm, n_params - head):
                ds.grad_ready(i, model.param_numels[i])                  # final norm
            for i in reversed(range(arch.num_layers)):
                first = 1 + i * per_layer
                grad = layer.backward(saved[i], grad, lambda k, g=None: ds.grad_ready(first + k, model.param_numels[first + k], g))
            t.free(grad)
            ds.grad_ready(0, model.param_numels[0])                      # the embedding
            ds.end_backward(boundary=micro == setup.gas - 1)
        ds.step()
        yield t, workspaces


