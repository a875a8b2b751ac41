"""The allocation sequence of a DeepSpeed job's first two training steps, generated from the
architecture and the setup, for `zerocalc.allocator` to replay: the reserved peak without a ratio.

What it emits (sizes in bytes; H200 allocator histories, `data/snapshots/t3-warmup*`, `t4-warmup`):
- init: the module's parameters as `model.to(device)` makes them, then DeepSpeed's flatten and
  partition copies and their frees, per stage;
- forward per layer: every activation of at least T·h/4 bytes (T = micro-batch · sequence tokens)
  in the order the layer's code makes it, kept ones to their layer's backward, temporaries freed
  where the history frees them; the logits, their fp32 copy and the fp32 log-softmax;
- backward: the loss path's fp32 gradients, then per layer (recomputing it first under activation
  checkpointing) a gradient of each kept activation's size while it is freed, and the layer's
  parameter gradients, each through DeepSpeed's hook for the stage (kept; copied into the ipg
  bucket and freed);
- step: DeepSpeed's flatten, fp32 cast and Adam's lazily made moments (first step), per stage.

Backward is approximate: its temporaries are not recorded with a call site (autograd's C++ threads),
so it frees and allocates at the granularity of the kept tensors; forward, init and step follow the
histories allocation by allocation. Stages 0-2 without offload are generated; others return None.
"""
from zerocalc.allocator import replay
from zerocalc.model import ModelSpec
from zerocalc.partition import partition
from zerocalc.training import Setup, Stage


class _Trace:
    """Allocation events with fresh handles: `alloc` returns a handle, `free` takes it."""

    def __init__(self):
        self.events, self._next = [], 0

    def alloc(self, n_bytes: int) -> int:
        self._next += 1
        self.events.append(("alloc", self._next, int(n_bytes), 0))
        return self._next

    def free(self, *handles) -> None:
        for h in handles:
            self.events.append(("free", h))


def _layer_forward(t: _Trace, arch, setup: Setup, x: int, keep_input: bool) -> tuple[int, list]:
    """One layer's forward on input handle x: (output handle, handles kept for backward with sizes).
    keep_input: the input outlives the layer (activation checkpointing saves it)."""
    b, tok = setup.param_bytes, setup.micro_batch * setup.seq_len
    h, f, heads = arch.hidden_size, arch.ffn_hidden_size, arch.num_heads
    th = b * tok * h
    kept = []

    def keep(n):
        kept.append((t.alloc(n), n))
        return kept[-1][0]

    if arch.family == "hf-llama":
        kv = b * tok * arch.num_kv_heads * arch.head_dim

        def rms_norm():   # LlamaRMSNorm: fp32 copy, pow (freed), normalised fp32 (freed), cast, weight
            keep(2 * th)
            tmp = t.alloc(2 * th)
            t.free(tmp)
            tmp = t.alloc(2 * th)
            keep(th)
            out = keep(th)
            t.free(tmp)
            return out

        def rotary(n):    # q·cos + rotate_half(q)·sin: the sum is kept
            a = t.alloc(n)
            half = t.alloc(n // 2)
            cat = t.alloc(n)
            t.free(half)
            s = t.alloc(n)
            t.free(cat)
            keep(n)
            t.free(a, s)

        rms_norm()
        q, k = t.alloc(th), t.alloc(kv)
        keep(kv)                                  # v
        rotary(th)
        rotary(kv)
        t.free(q, k)
        keep(th)                                  # sdpa output
        keep(4 * tok * heads // 1)                # its log-sum-exp, fp32 per head
        o = t.alloc(th)
        res1 = t.alloc(th)
        t.free(o)
        if not keep_input:
            t.free(x)
        rms_norm()
        for _ in range(4):                        # gate, SiLU, up, product
            keep(b * tok * f)
        down = t.alloc(th)
        out = t.alloc(th)
        t.free(down, res1)
        return out, kept

    # seed-gpt: LayerNorm → nn.MultiheadAttention (eager, need_weights) → LayerNorm → MLP
    kept.append((x, th))                          # the layer's input stays alive for its backward
    del keep_input
    att = b * setup.micro_batch * heads * setup.seq_len ** 2
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
    avg = t.alloc(b * setup.micro_batch * setup.seq_len ** 2)   # head-averaged weights (need_weights)
    t.free(qs, avg)
    res1 = keep(th)
    t.free(proj)
    keep(th)                                      # ln2
    keep(b * tok * f)                             # fc1
    keep(b * tok * f)                             # GELU
    fc2 = t.alloc(th)
    out = t.alloc(th)
    t.free(fc2)
    del res1
    return out, kept


def _layer_backward(t: _Trace, kept: list, grad: int, grad_bytes: int) -> int:
    """Free a layer's kept activations in reverse, each beside a gradient of its size; returns the
    gradient of the layer's input."""
    for handle, n in reversed(kept):
        g = t.alloc(n)
        t.free(handle)
        t.free(g)
    g_in = t.alloc(grad_bytes)
    t.free(grad)
    return g_in


class _Stage:
    """DeepSpeed's init, per-gradient hook, end of backward and step for stages 0-2 (no offload)."""

    def __init__(self, t: _Trace, model: ModelSpec, setup: Setup):
        self.t, self.model, self.setup = t, model, setup
        self.b = setup.param_bytes
        self.part = partition(model.param_numels, setup)
        self.grads, self.bucket, self.bucket_fill, self.partition_grads = {}, None, 0, None
        self.moments = None

    def init(self, params: list) -> None:
        t, b, s, p = self.t, self.b, self.part.flat_shard, self.part.padded_flat
        if self.setup.stage == Stage.DISABLED:
            # FP16_Optimizer (fused_optimizer.py:94-133): per-parameter copies flattened into one
            # buffer, the module's tensors freed; a clone and its fp32 master; fp32 zero gradients for
            # the dummy step that makes Adam's moments, then freed.
            copies = [t.alloc(b * n) for n in self.model.param_numels]
            flat = t.alloc(b * p)
            t.free(*copies)
            t.free(*params)
            clone = t.alloc(b * p)
            t.alloc(4 * p)
            t.free(clone)
            zero = t.alloc(4 * p)
            self.moments = (t.alloc(4 * p), t.alloc(4 * p))
            t.free(zero)
            del flat
            return
        flat = t.alloc(b * p)                         # flatten_dense_tensors_aligned
        t.free(*params)                               # the module's tensors become views of it
        clone = t.alloc(b * s) if self.setup.dp == 1 else None
        t.alloc(4 * s)                                # fp32 master partition
        if clone:
            t.free(clone)
        zero = t.alloc(4 * s)                         # initialize_optimizer_states: freed again
        t.free(zero)
        del flat

    def grad_ready(self, index: int, numel: int, g: int | None = None) -> None:
        """Parameter `index`'s gradient (allocated here unless given) reaches DeepSpeed's hook."""
        t, b = self.t, self.b
        g = t.alloc(b * numel) if g is None else g
        if self.setup.stage == Stage.DISABLED:
            self.grads[index] = g
            return
        if self.bucket is None:                       # setup_buckets at the first hook of a backward
            self.bucket = t.alloc(self.setup.comm_bytes * self.setup.reduce_bucket_size)
        if self.setup.stage == Stage.GRADIENTS:
            self._into_bucket(numel)
            t.free(g)
        else:
            self.grads[index] = g                     # ZeRO-1: moved at the end of backward

    def _into_bucket(self, numel: int) -> None:
        if self.bucket_fill + numel > self.setup.reduce_bucket_size and self.bucket_fill:
            self._reduce()
        self.bucket_fill += numel

    def _reduce(self) -> None:
        if self.partition_grads is None:              # copy_grads_in_partition, first reduction
            self.partition_grads = self.t.alloc(self.b * self.part.flat_shard)
        self.bucket_fill = 0

    def end_backward(self) -> None:
        t, b = self.t, self.b
        if self.setup.stage == Stage.DISABLED:
            # allreduce_bucket flattens each bucket of MEMORY_OPT_ALLREDUCE_SIZE elements.
            t.free(t.alloc(b * min(self.part.num_params, 500_000_000)))
            return
        if self.setup.stage == Stage.OPTIMIZER_STATES:
            for index in sorted(self.grads, reverse=True):
                self._into_bucket(self.model.param_numels[index])
                t.free(self.grads.pop(index))
        self._reduce()
        t.free(self.bucket)
        self.bucket, self.bucket_fill = None, 0

    def step(self) -> None:
        t, b, s = self.t, self.b, self.part.flat_shard
        if self.setup.stage == Stage.DISABLED:
            # fused_optimizer.py:286-314: an fp32 copy of each gradient, one flat fp32 copy, the
            # copies freed, the bit16 gradients set to None, the flat copy freed.
            numels = self.model.param_numels
            copies = [t.alloc(4 * n) for n in numels]
            flat = t.alloc(4 * self.part.num_params)
            t.free(*copies)
            t.free(*(self.grads.pop(i) for i in sorted(self.grads)))
            t.free(flat)
            return
        # get_grad_norm_direct: an fp64 copy of each of the rank's gradient pieces in turn (rank 0's:
        # the first S elements of the flat group).
        pieces, left = [], s
        for n in self.model.param_numels:
            pieces.append(min(n, left))
            left -= pieces[-1]
            if left <= 0:
                break
        for n in pieces:
            t.free(t.alloc(8 * n))
        flat = t.alloc(b * s)                         # flatten the partition gradients
        cast = t.alloc(4 * s)                         # their fp32 cast
        t.free(flat, self.partition_grads)
        self.partition_grads = None
        if self.moments is None:                      # Adam's moments, made at the first step
            self.moments = (t.alloc(4 * s), t.alloc(4 * s))
        t.free(cast)


def generated(model: ModelSpec, setup: Setup) -> bool:
    """Whether `events` generates this configuration: what the histories cover (stages 0-2 without
    offload, seed-gpt and hf-llama, bf16/fp16 through DeepSpeed's ZeRO or FP16 optimizer, one
    micro-step per step, one gradient bucket, gradients in the training dtype)."""
    arch = model.architecture
    return (arch is not None and setup.seq_len is not None and setup.stage != Stage.PARAMETERS
            and setup.offload_optimizer == "none" and arch.family in ("hf-llama", "seed-gpt")
            and setup.attention == {"seed-gpt": "eager", "hf-llama": "sdpa"}[arch.family]
            and setup.mixed_precision and setup.gas == 1 and not setup.overlap
            and setup.grad_accum_dtype in (None, setup.dtype) and not setup.bf16_optimizer
            and setup.contiguous_gradients)


CUBLAS_WORKSPACE_BYTES = 32 << 20   # per cuBLAS handle and stream, made at its first matmul, kept (H200)


def events(model: ModelSpec, setup: Setup, steps: int = 2, fresh_process: bool = True):
    """The allocation events of init and `steps` training steps, or None where not generated.
    cuBLAS takes a workspace at the first matmul of the main thread (forward) and of autograd's
    thread (backward) and keeps it (32 MiB each: the histories' allocations without a free; later
    jobs of a process start with 64 MiB allocated). fresh_process=False: a later job's, made before."""
    arch = model.architecture
    if not generated(model, setup):
        return None
    t = _Trace()
    workspaces = [] if fresh_process else [t.alloc(CUBLAS_WORKSPACE_BYTES), t.alloc(CUBLAS_WORKSPACE_BYTES)]
    b, tok, v, h = setup.param_bytes, setup.micro_batch * setup.seq_len, arch.vocab_size, arch.hidden_size
    th = b * tok * h
    params = [t.alloc(b * n) for n in model.param_numels]
    ds = _Stage(t, model, setup)
    ds.init(params)
    final_norm = 2 if arch.family == "seed-gpt" else 1             # LayerNorm weight and bias; RMSNorm weight
    head = 0 if arch.tie_embeddings else 1
    per_layer = (len(model.param_numels) - 1 - final_norm - head) // arch.num_layers
    for _ in range(steps):
        x = t.alloc(th)                                       # embedding output
        if not workspaces:   # forward's first matmul: the rotary angles (hf-llama), in_proj (seed-gpt)
            workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
        layers = []
        for _ in range(arch.num_layers):
            if setup.activation_checkpointing:
                y, kept = _layer_forward(t, arch, setup, x, keep_input=True)
                for handle, _n in kept:
                    if handle != x:
                        t.free(handle)
                layers.append([(x, th)])
                x = y
            else:
                x, kept = _layer_forward(t, arch, setup, x, keep_input=False)
                layers.append(kept)
        norm = t.alloc(th)                                    # final norm output
        logits = t.alloc(b * tok * v)
        fp32 = t.alloc(4 * tok * v)                           # logits.float()
        logprobs = t.alloc(4 * tok * v)                       # log_softmax, kept for its backward
        t.free(fp32, logits)
        t.free(x)
        if len(workspaces) < 2:   # autograd's thread: its first matmul
            workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
        # backward of the loss path: nll's fp32 gradient, log_softmax's, the cast back
        g1 = t.alloc(4 * tok * v)
        g2 = t.alloc(4 * tok * v)
        t.free(g1)
        g3 = t.alloc(b * tok * v)
        t.free(g2, logprobs)
        n_params = len(model.param_numels)
        # The head's weight gradient and the final norm's input gradient; the logits' gradient is
        # freed before the head's hook runs (the bucket comes after it).
        head_grad = t.alloc(b * model.param_numels[-1]) if head else None
        grad = t.alloc(th)
        t.free(g3, norm)
        if head:
            ds.grad_ready(n_params - 1, model.param_numels[-1], head_grad)
        for i in range(n_params - head - final_norm, n_params - head):
            ds.grad_ready(i, model.param_numels[i])                  # final norm
        for layer in reversed(range(arch.num_layers)):
            kept = layers[layer]
            if setup.activation_checkpointing:
                y, rebuilt = _layer_forward(t, arch, setup, kept[0][0], keep_input=True)
                t.free(y)
                kept = kept[:1] + [k for k in rebuilt if k[0] != kept[0][0]]
            grad = _layer_backward(t, kept, grad, th)
            first = 1 + layer * per_layer
            for i in reversed(range(first, first + per_layer)):
                ds.grad_ready(i, model.param_numels[i])
        t.free(grad)
        ds.grad_ready(0, model.param_numels[0])                      # the embedding
        ds.end_backward()
        ds.step()
    return t.events


def peak_reserved_bytes(model: ModelSpec, setup: Setup) -> int | None:
    ev = events(model, setup)
    if ev is None:
        return None
    return replay(ev, expandable_segments=setup.expandable_segments).peak_reserved_bytes
