"""The allocation sequence of a DeepSpeed job's first training steps, generated from the
architecture and the setup, for `zerocalc.allocator` to replay: the reserved peak without a ratio.

One mechanism for every model: the model's side (forward, the validator's loss, backward) is an
allocation stream traced from the model's own code on fake tensors and played by `_TracedStep` (a
transcribed family's polynomial stream, `zerocalc.hf.familystream`, or a profile's,
`zerocalc.hf.memtrace.step_stream`). This module holds DeepSpeed 0.19.8's side beside it (sizes in
bytes): init's parameters, flatten and partition copies; each gradient through the stage's hook;
the step's norm, casts and lazily made moments; stage 3's partitions, flat buffers and the
all-gathers the coordinator runs (`_Stage3`, `stage3_trace.fetches`); optimizer and parameter
offload; cuBLAS's workspaces. Each event with its DeepSpeed source and the H200 histories it was
read from (`data/snapshots/`) is in docs/reserved-memory.md, "The sequence, generated"; every
configuration recorded as a fresh process's first job is reproduced (`tests/test_sequence.py`;
oracle: `tests/transcribed_sequence.py`). What `generated` says is covered; others: None.
"""
import gc
from contextlib import contextmanager
from itertools import accumulate
from math import ceil
from typing import NamedTuple

from zerocalc import stage3_trace
from zerocalc import allocator
from zerocalc.allocator import Replay, replay
from zerocalc.comm import stage0_allreduce_bucket_tensors
from zerocalc.model import ModelSpec
from zerocalc.partition import grads_in_partition, partition, persistent_mask, sub_groups
from zerocalc.profile import traced_under
from zerocalc.states import module_buffers_bytes, wide_stage3_elements
from zerocalc.training import Setup, Stage


REDUCTION_STAGING_BYTES = 132 << 20   # the cap measured on H200 (which has 132 SMs): see `_TracedStep`


def staging_bytes(elements: int) -> int:
    """The reduction's staging buffer for a sum over the tokens of `elements` inputs (`_TracedStep`)."""
    return min(8 * elements, REDUCTION_STAGING_BYTES)


class _Trace:
    """Allocation events with fresh handles: `alloc` returns a handle, `free` takes it."""

    def __init__(self):
        self.events, self._next = [], 0

    @property
    def last_handle(self) -> int:
        return self._next

    def alloc(self, n_bytes: int, stream: int = 0) -> int:
        self._next += 1
        self.events.append(("alloc", self._next, int(n_bytes), stream))
        return self._next

    def empty_cache(self) -> None:
        self.events.append(("empty_cache",))

    def free(self, *handles) -> None:
        for h in handles:
            self.events.append(("free", h))


_COMPILED: dict = {}


def _parse_ref(ref: str) -> tuple:
    """A stream's handle name ("P:3", "F~-1:5" relative to the segment's layer, "F@-1:5" the last
    layer's) as (segment, mode: 0 none / 1 relative / 2 absolute layer, layer, allocation index)."""
    where, j = ref.rsplit(":", 1)
    if len(where) > 1 and where[1] in "~@":
        return where[0], 1 if where[1] == "~" else 2, int(where[2:]), int(j)
    return where, 0, 0, int(j)


def _parse_param(ref: str) -> tuple:
    """A stream's parameter ("#3", "#-1" from the end, "~0:4" the segment's layer's fifth, "@-1:4")."""
    if ref[0] == "#":
        return 0, int(ref[1:]), 0
    where, local = ref.split(":")
    return 1 if where[0] == "~" else 2, int(where[1:]), int(local)


def _compiled(stream: dict, variant: str, name: str) -> list:
    """A stored segment (`zerocalc.hf.memtrace._compact`) as events with sizes and names parsed, once
    per segment: ("a", coefficients), ("f", name or (None, d) the d-th allocation back in the same
    segment), ("g", parameter, name), ("s", coefficients), ("d", coefficients, coefficients), ("w",)."""
    seg = stream[variant][name]
    while isinstance(seg, str):                   # stored once: the name of an equal segment
        variant, name = seg.split(".")
        seg = stream[variant][name]
    hit = _COMPILED.get(id(seg))
    if hit is None or hit[0] is not seg:
        sizes, out, j = stream["sizes"], [], 0
        for e in seg:
            if isinstance(e, int) and e >= 0:
                out.append(("a", tuple(sizes[e])))
                j += 1
            elif isinstance(e, int):
                out.append(("f", (None, 0, 0, j + e)))
            elif isinstance(e, str):
                out.append(("f", _parse_ref(e)))
            elif e[0] == "g":
                out.append(("g", _parse_param(e[1]), _parse_ref(e[2])))
            elif e[0] in ("s", "d", "t"):
                out.append((e[0], *(tuple(sizes[x]) for x in e[1:])))
            else:
                out.append(tuple(e))
        hit = _COMPILED[id(seg)] = (seg, out)
    return hit[1]


# `_TracedStep._ops`' operations
_ALLOC, _FREE_SAME, _FREE_LAYER, _FREE_AT, _TRANSIENT, _GRAD, _FETCH, _FIRST_WORKSPACE, _WORKSPACE = range(9)
# Handle keys (`_TracedStep._instance`): allocation j of the k-th segment name played at layer i is
# i·_LAYER + k·_SLOT + j, and at no layer (_NAMES + k)·_SLOT + j: a distinct integer for every (name,
# layer, j), whatever the layer, for up to _NAMES names and _SLOT allocations a segment (the shipped
# streams: 6 names, at most 207 allocations).
_NAMES, _SLOT = 16, 1 << 20
_LAYER = 2 * _NAMES * _SLOT


def _head_matmul(st: dict, variant: str) -> int | None:
    """The index among the allocations of a stream's "Hb" segment of the one made just before its "w"
    (backward's first matmul: the head's), None where it has none."""
    hb = st[variant]["Hb"]
    while isinstance(hb, str):
        v, seg = hb.split(".")
        hb = st[v][seg]
    allocs = 0
    for e in hb:
        if e == ["w"]:
            return allocs - 1 if allocs else None
        allocs += isinstance(e, int) and e >= 0
    return None


def played_as(i: int, layers: int, traced: int, leading: int = 0, period: int = 1) -> int:
    """The traced layer (of `traced`) played as layer i of `layers`: the `leading` dense ones, the first
    period of the layers' pattern after them and the last two as traced, every other as the traced
    layer of the period just before the last two that has its place in the pattern (the second past
    the leading ones where every layer is alike, `period` 1). The first layer of each kind is the last
    in backward to use what the model made for that kind before its layers (Qwen3-Next's
    full-attention layers' rotary tables: the first one's backward frees them); the layer before the
    last two frees what the second-last one made in backward, as the model's does (Gemma 4's
    second-last layer, next to the head, allocates otherwise than a middle one). The trace's last
    layer has the model's last one's place in the pattern (`memtrace.stream_depth`)."""
    if layers <= traced or i < leading + period:
        return i
    if i >= layers - 2:
        return traced - (layers - i)
    return traced - 2 - period + (i - (layers - 2 - period)) % period


class _TracedStep:
    """A model's forward, loss and backward from its stream (a family's, `zerocalc.hf.familystream`,
    or a traced profile's, `zerocalc.hf.memtrace.step_stream`): what its code allocates and frees on
    fake tensors (sizes evaluated on the stream's basis, `basis_values`), with the CUDA kernels' own
    allocations added where the CPU trace cannot show them, each read from the H200 histories: a
    reduction's staging buffer (`REDUCTION_STAGING_BYTES`), SDPA's backward workspace, a softmax
    backward's temporary, cuBLAS's workspaces (`CUBLAS_WORKSPACE_BYTES`). The loss is the
    validator's: the cross-entropy of the logits' fp32 copy. A model deeper than the traced one
    repeats the middle layers' segments: layer 0, 1 and the last two as traced, every other as layer 1.
    At stage 3 the stream's `_zero3` variant is played where it has one (`familystream.zero3_linear`).
    Each rule with its evidence: docs/reserved-memory.md, "Any Hugging Face model: the traced stream"."""

    def __init__(self, t: _Trace, model: ModelSpec, setup: Setup, ds, workspaces: list, stream: dict | None = None):
        st = stream if stream is not None else step_stream(model, setup)
        self.t, self.ds, self.workspaces = t, ds, workspaces
        variant = "checkpointed" if setup.activation_checkpointing else "plain"
        if setup.stage == Stage.PARAMETERS and variant + "_zero3" in st:     # `familystream.zero3_linear`
            variant += "_zero3"
        self.stream, self.variant = st, variant
        self.k, self.first, self.per_layer = st["layers"], st["first_layer_param"], st["params_per_layer"]
        self.leading = list(accumulate(st.get("leading_layer_params", ()), initial=0))   # their first params
        self.period = st.get("period", 1)
        # the layers past the leading ones: each one's first parameter, counted from the first of them
        # (the first period's as traced, each later layer's by its place in the pattern)
        first, counts = st.get("first_period_params", []), st.get("period_params", [self.per_layer])
        self.after_leading = list(accumulate(first + [counts[i % len(counts)] for i in
                                                      range(len(first), model.architecture.num_layers)], initial=0))
        self.layers = model.architecture.num_layers
        self.numels = model.param_numels
        self.x = basis_values(st["basis"], setup.micro_batch, setup.seq_len, model.architecture)
        # what a chunked kernel keeps per layer beyond its traced lengths (`memtrace.at_length`): held
        # from the layer's forward (its recompute, checkpointed) to the end of its backward
        self.beyond = int(st.get("kept_bytes_per_token_beyond_trace", 0) * setup.micro_batch * setup.seq_len)
        self.kept, self.checkpointed = {}, setup.activation_checkpointing
        self.handles, self.sizes, self.evaluated, self.names = {}, {}, {}, {}
        # stage 3's backward fetches (`on_fetch`): where the stream says (`backward_fetch_at`, the
        # families'), else at the head's first backward matmul (its output, the allocation before the
        # stream's "w"): DeepSpeed's pre-backward hook on the head's output fires once the loss path's
        # gradients exist (rank 0 of 8, Qwen2-1.5B: 1.87 GiB of forward-kept parameters alive then)
        self.fetch_at, self.on_fetch = st.get("backward_fetch_at", _head_matmul(st, variant)), None

    def _size(self, coefs) -> int:
        """Bytes of a size's coefficients at this setup, each distinct size evaluated once."""
        n = self.sizes.get(coefs)
        if n is None:
            n = self.sizes[coefs] = sum(c * x for c, x in zip(coefs, self.x))
        return n

    def _template(self, i: int) -> int:
        return played_as(i, self.layers, self.k, len(self.leading) - 1, self.period)

    def _first_param(self, i: int) -> int:
        """Layer i's first parameter: after the leading layers' (`leading_layer_params`), and the
        layers' before it past them (`params_per_layer` each, or by their place in the pattern,
        `period_params`)."""
        lead = len(self.leading) - 1
        if i < lead:
            return self.first + self.leading[i]
        return self.first + self.leading[-1] + self.after_leading[i - lead]

    def _instance(self, name: str, layer: int | None) -> int:
        """The handle key of allocation 0 of segment `name` played at `layer` (None: a segment of no
        layer); allocation j's is this + j. Integers, not (name, layer, j) tuples: the play loop
        stores and pops one per event."""
        k = self.names.get(name)
        if k is None:
            k = self.names[name] = len(self.names)
            if k == _NAMES:
                raise ValueError(f"a stream with more than {_NAMES} segment names: raise sequence._NAMES")
        return (k + _NAMES) * _SLOT if layer is None else layer * _LAYER + k * _SLOT

    def _key(self, ref: tuple) -> tuple[int, int]:
        """(op, x) of a parsed handle reference (`_parse_ref`): _FREE_SAME (x: the allocation index in
        the segment played), _FREE_LAYER (x + the played layer·_LAYER) or _FREE_AT (x: the key)."""
        where, mode, value, j = ref
        if where is None:
            return _FREE_SAME, j
        if mode == 1:
            return _FREE_LAYER, self._instance(where, value) + j
        if mode == 2:
            return _FREE_AT, self._instance(where, value if value >= 0 else self.layers + value) + j
        return _FREE_AT, self._instance(where, None) + j

    def _ops(self, name: str, template: str) -> list:
        """Segment `template` (stored) as played for `name`: (op, x, y) triples with sizes evaluated
        at this setup (bytes) and handle keys resolved (`_key`), made once per segment; the rules tied
        to a segment's name (stage 3's backward fetch in "Hb", forward's first-matmul workspace in
        "P") placed as ops of their own."""
        ops = self.evaluated.get(template)
        if ops is not None:
            return ops
        ops, j = [], 0
        for e in _compiled(self.stream, self.variant, template):
            kind = e[0]
            if kind == "a":
                if j == _SLOT:
                    raise ValueError(f"segment {template} has more than {_SLOT} allocations: raise sequence._SLOT")
                if name == "Hb" and j == self.fetch_at:
                    ops.append((_FETCH, 0, 0))
                ops.append((_ALLOC, int(self._size(e[1])), j))
                j += 1
                if name == "P" and j == 1:
                    ops.append((_FIRST_WORKSPACE, 0, 0))
            elif kind == "f":
                ops.append((*self._key(e[1]), 0))
            elif kind == "g":
                pmode, pvalue, local = e[1]
                if pmode == 0:
                    param = (pvalue if pvalue >= 0 else len(self.numels) + pvalue, None)
                elif pmode == 1:
                    param = (local, pvalue)          # layer (played + pvalue)'s, at play
                else:
                    param = (self._first_param(pvalue if pvalue >= 0 else self.layers + pvalue) + local, None)
                ops.append((_GRAD, param, self._key(e[2])))
            elif kind == "t":                          # a CUDA rule's buffer, made and freed at once
                ops.append((_TRANSIENT, int(self._size(e[1])), 0))
            elif kind == "s":
                ops.append((_TRANSIENT, staging_bytes(self._size(e[1])), 0))
            elif kind == "d":
                ops.append((_TRANSIENT, 8 * self._size(e[1]) + 4 * self._size(e[2]), 0))
            elif kind == "w":
                ops.append((_WORKSPACE, 0, 0))
        self.evaluated[template] = ops
        return ops

    def run(self, name: str, layer: int | None = None) -> None:
        """Play segment `name` (at `layer`) into the trace: its allocations and frees appended as
        `_Trace.alloc` and `free` append them (written out: this runs for every event of the model's
        side), the gradients handed to DeepSpeed's hook."""
        t, handles = self.t, self.handles
        if layer is None:
            ops, base, shift = self._ops(name, name), self._instance(name, None), 0
        else:
            ops = self._ops(name, f"{name}{self._template(layer)}")
            base, shift = self._instance(name, layer), layer * _LAYER
        append = t.events.append
        last = t._next
        for op, x, y in ops:
            if op == _ALLOC:
                last += 1
                append(("alloc", last, x, 0))
                handles[base + y] = last
            elif op == _FREE_SAME:
                append(("free", handles.pop(base + x)))
            elif op == _FREE_LAYER:
                append(("free", handles.pop(x + shift)))
            elif op == _FREE_AT:
                append(("free", handles.pop(x)))
            elif op == _TRANSIENT:
                last += 1
                append(("alloc", last, x, 0))
                append(("free", last))
            else:                                      # calls out: the trace's handle count goes with it
                t._next = last
                if op == _GRAD:
                    (param, relative), (key_op, key) = x, y
                    p = param if relative is None else self._first_param(layer + relative) + param
                    key = base + key if key_op == _FREE_SAME else key + shift if key_op == _FREE_LAYER else key
                    self.ds.grad_ready(p, self.numels[p], handles.pop(key))
                elif op == _FETCH:
                    if self.on_fetch is not None:
                        self.on_fetch()
                elif op == _FIRST_WORKSPACE:           # forward's first matmul
                    if not self.workspaces:
                        self.workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
                elif op == _WORKSPACE and len(self.workspaces) < 2:
                    self.workspaces.append(t.alloc(CUBLAS_WORKSPACE_BYTES))
                last = t._next
        t._next = last

    def forward(self) -> None:
        self.handles = {}
        self.run("P")
        for i in range(self.layers):
            self.run("F", i)
            if self.beyond and not self.checkpointed:
                self.kept[i] = self.t.alloc(self.beyond)
        self.run("H")

    def backward(self, fetch=None, segment_done=None) -> None:
        """`fetch`: the start of stage 3's backward fetches, run where the stream places them;
        `segment_done`: called once the head's backward and each layer's are played."""
        if fetch is not None and self.fetch_at is None:
            fetch()
        self.on_fetch = fetch
        self.run("Hb")
        for i in reversed(range(self.layers)):
            if segment_done is not None:
                segment_done()
            if self.beyond and self.checkpointed:
                self.kept[i] = self.t.alloc(self.beyond)
            self.run("B", i)
            if i in self.kept:
                self.t.free(self.kept.pop(i))
        if segment_done is not None:
            segment_done()
        self.run("E")
        self.t.free(*self.handles.values())     # none: every tensor of the step is freed by its end
        self.handles = {}


STREAM_VARIABLES = {   # a stream's basis is products of these (`zerocalc.hf.familystream.FAMILY_VARIABLES`)
    "h": lambda a: a.hidden_size, "f": lambda a: a.ffn_hidden_size, "V": lambda a: a.vocab_size,
    "H": lambda a: a.num_heads, "kv": lambda a: a.num_kv_heads * a.head_dim, "d": lambda a: a.head_dim,
    "P": lambda a: a.max_positions,
}


def basis_values(basis, micro_batch: int, seq_len: int, arch) -> tuple[int, ...]:
    """The value of each of a stream's basis products ("B*s*h": micro-batch x sequence x hidden) at
    this setup and architecture; a traced model's basis names only B and s."""
    def value(name):
        if name == "B":
            return micro_batch
        if name == "s":
            return seq_len
        return STREAM_VARIABLES[name](arch)
    out = []
    for product in basis:
        x = 1
        for name in product.split("*"):
            if name != "1":
                x *= value(name)
        out.append(x)
    return tuple(out)


def step_stream(model: ModelSpec, setup: Setup) -> dict | None:
    """The allocation stream of the model's forward and backward under the setup's attention, as its
    description holds it (`profile.traced_under`): traced from its code, or its family's (`zerocalc.family`);
    None for P alone, or where none is held for that attention."""
    return None if model.profile is None else traced_under(model.profile, setup.attention)[1]


def _flat_offsets(numels) -> list[int]:
    """Each parameter's start in the flat group (stages 1/2 flatten the parameters in order)."""
    return [0, *accumulate(numels[:-1])]


def _overlap(start: int, numel: int, shard: int, rank: int) -> int:
    """Elements of the flat group's [start, start + numel) in `rank`'s slice [rank·S, (rank + 1)·S)."""
    return max(0, min((rank + 1) * shard, start + numel) - max(rank * shard, start))


def simulated_ranks(model: ModelSpec, setup: Setup, every: bool = False) -> tuple[int, ...]:
    """The ranks whose sequences decide a job's peaks (the busiest's): rank 0 where every rank's is
    alike (stages 0 and 3, N = 1); at stages 1/2 the rank whose `grads_in_partition` is largest (its
    copy of every gradient that overlaps its slice, whole), and with optimizer offload rank 0 and the
    rank with the largest piece of one gradient in its slice (its fp64 norm copy is the largest
    transient). every: rank 0 as well, for a verdict on a card, where any rank's OOM ends the job (a
    rank's gradients are copied out when its slice's bucket is reduced: rank 0's last, into a fuller
    cache; on an emulated 48 GB card rank 0 of an 8B stage-1 job ran out where the busiest's replay
    ran, data/h200-cards-48-n8.csv)."""
    if setup.stage in (Stage.DISABLED, Stage.PARAMETERS) or setup.dp == 1:
        return (0,)
    numels = model.trainable_numels            # the flat group's: the trained tensors'
    ranks = {max(range(setup.dp), key=lambda r: grads_in_partition(numels, setup, r))}
    if setup.offload_optimizer != "none":
        part = partition(numels, setup)
        offsets = _flat_offsets(numels)
        ranks.add(max(range(setup.dp), key=lambda r: max(_overlap(o, n, part.flat_shard, r)
                                                         for o, n in zip(offsets, numels))))
    if every or setup.offload_optimizer != "none":
        ranks.add(0)
    return tuple(sorted(ranks))


class _Stage:
    """DeepSpeed's init, per-gradient hook, end of backward and step for stages 0-2, with or
    without optimizer offload (DeepSpeedCPUAdam: the fp32 master, the moments and the gradient
    partitions live on the host). With overlap_comm (stages 1/2, `data/snapshots/t6-overlap/`):
    setup_buckets makes two buffers (stage_1_and_2.py:3273, double buffering), stage 1 reduces in
    the hooks as stage 2 does (stage_1_and_2.py:2290), and the bucket's flatten and the partition
    gradients are made on the reduction stream, in its own pool (`average_tensor`). Only the
    parameters that train are the optimizer's (`ModelSpec.trainable`): DeepSpeed flattens,
    partitions and hooks those; a frozen one stays in the module, whole (stage_1_and_2.py's
    `bit16_groups` are the optimizer's param groups; FP16_Optimizer's `fp16_groups` too)."""

    REDUCE_STREAM = 3   # reduction_stream

    def __init__(self, t: _Trace, model: ModelSpec, setup: Setup, rank: int = 0):
        self.t, self.model, self.setup, self.rank = t, model, setup, rank
        self.b = setup.param_bytes
        self.numels = model.trainable_numels       # the optimizer's tensors, by their index among those
        self.slot = {i: k for k, i in enumerate(model.trained_indices)}
        self.part = partition(self.numels, setup)
        self.offload = setup.offload_optimizer != "none"
        self.overlap = setup.overlap and setup.stage in (Stage.OPTIMIZER_STATES, Stage.GRADIENTS)
        self.in_hooks = setup.stage == Stage.GRADIENTS or self.overlap   # gradients into buckets as they come
        self.reduce_stream = self.REDUCE_STREAM if self.overlap else 0
        self.grads, self.bucket, self.bucket_fill, self.partition_grads = {}, None, 0, None
        self.extra_large = None                      # a gradient larger than the bucket, kept until reduced
        self.kept_grads = []                         # stage 1: such gradients outside the rank's slice
        self.bucket_ranks: set[int] = set()
        self.bucket_params: list[int] = []
        self.micro_grads, self.later_micro_step = None, False   # stage 2's per-micro-step copy (GAS > 1)
        self.offsets = _flat_offsets(self.numels)
        self.moments = None

    def init(self, params: list) -> None:
        t, b, s, p = self.t, self.b, self.part.flat_shard, self.part.padded_flat
        params = [h for i, h in enumerate(params) if i in self.slot]   # the frozen ones stay as they are
        if self.setup.stage == Stage.DISABLED:
            # FP16_Optimizer (fused_optimizer.py:94-133): per-parameter copies flattened into one
            # buffer, the module's tensors freed; a clone and its fp32 master; fp32 zero gradients for
            # the dummy step that makes Adam's moments, then freed.
            copies = [t.alloc(b * n) for n in self.numels]
            t.alloc(b * p)                            # the flat bit16 group, kept
            t.free(*reversed(copies))                 # a list's items are released last first
            t.free(*params)
            clone = t.alloc(b * p)
            t.alloc(4 * p)
            t.free(clone)
            zero = t.alloc(4 * p)
            self.moments = (t.alloc(4 * p), t.alloc(4 * p))
            t.free(zero)
            return
        t.alloc(b * p)                                # flatten_dense_tensors_aligned: the flat group, kept
        t.free(*params)                               # the module's tensors become views of it
        if self.offload:
            # the slice's clone goes to the host as the fp32 master; temp_grad_buffer_for_gpu_offload
            # (the largest parameter's numel, stage_1_and_2.py:659) stays
            t.free(t.alloc(b * s))
            t.alloc(b * max(self.numels))
            return
        clone = t.alloc(b * s)                        # the rank's slice cloned, then cast to fp32
        t.alloc(4 * s)                                # fp32 master partition
        t.free(clone)
        zero = t.alloc(4 * s)                         # initialize_optimizer_states: freed again
        t.free(zero)

    def grad_ready(self, index: int, numel: int, g: int | None = None) -> None:
        """Parameter `index`'s gradient (allocated here unless given) reaches DeepSpeed's hook."""
        t, b = self.t, self.b
        g = t.alloc(b * numel) if g is None else g
        index = self.slot[index]
        if self.setup.stage != Stage.DISABLED and self.bucket is None:
            # setup_buckets at the first hook of a backward (ZeRO-1 keeps it to the boundary)
            self.bucket = [t.alloc(self.setup.comm_bytes * self.setup.reduce_bucket_size)
                           for _ in range(2 if self.overlap else 1)]
        if self.in_hooks:
            self._into_bucket(index, numel)
            self._release(g, numel)
        elif index in self.grads:                     # a later micro-step: added into .grad in place
            t.free(g)
        else:
            self.grads[index] = g                     # kept (ZeRO-1: moved at the boundary)

    def _release(self, g: int, numel: int) -> None:
        """A gradient put into the bucket: copied into its buffer and freed, or, larger than the bucket
        with contiguous gradients (`extra_large_param_to_reduce`, stage_1_and_2.py:1443), reduced from
        its own storage and kept until that reduction."""
        if numel > self.setup.reduce_bucket_size:
            self.extra_large = g
        else:
            self.t.free(g)

    def _into_bucket(self, index: int, numel: int) -> None:
        if self.bucket_fill + numel > self.setup.reduce_bucket_size and self.bucket_fill:
            self._reduce()
        self.bucket_fill += numel
        self.bucket_params.append(index)
        start = self.offsets[index]                   # the ranks whose flat slices this gradient touches
        self.bucket_ranks.update(range(start // self.part.flat_shard,
                                       min((start + numel - 1) // self.part.flat_shard, self.setup.dp - 1) + 1))

    def _reduce(self) -> None:
        """average_tensor: the bucket's slices go to their ranks; slices for more than one rank are
        flattened into one tensor first (`allreduce_bucket`; a single slice is reduced in place).
        The rank copies its gradients out at the first reduction that holds any (`copy_grads_in_partition`:
        every parameter overlapping its slice, whole)."""
        if len(self.bucket_ranks) > 1:
            self.t.free(self.t.alloc(self.setup.comm_bytes * self.bucket_fill, self.reduce_stream))
        if self.offload:
            # copy_grads_in_partition with offload: per gradient, its part in this rank's slice is
            # normed in fp64 (set_norm_for_param_grad_in_gpu) and cast to fp32 for the host copy
            for i in self.bucket_params:
                k = _overlap(self.offsets[i], self.numels[i], self.part.flat_shard, self.rank)
                if k:
                    self.t.free(self.t.alloc(8 * k))
                    self.t.free(self.t.alloc(4 * k))
        elif self.rank in self.bucket_ranks:
            # With gradient accumulation (stage 2) the first micro-step's buffer accumulates; each later
            # micro-step copies into a buffer of its own, added in and freed by its epilogue.
            numel = grads_in_partition(self.numels, self.setup, self.rank)
            if self.partition_grads is None:
                self.partition_grads = self.t.alloc(self.b * numel, self.reduce_stream)
            elif self.micro_grads is None and self.setup.stage == Stage.GRADIENTS and self.later_micro_step:
                self.micro_grads = self.t.alloc(self.b * numel)
        if self.extra_large is not None:
            # In the rank's slice it is copied into the partition gradients (its storage freed); outside
            # it stage 2 clears it, stage 1 leaves it in .grad until the epilogue's `_clear_param_grad_only`
            # (stage_1_and_2.py:2262-2272; rank 5 of 8's history, data/snapshots/cards-ranks/).
            if self.setup.stage == Stage.OPTIMIZER_STATES and self.rank not in self.bucket_ranks:
                self.kept_grads.append(self.extra_large)
            else:
                self.t.free(self.extra_large)
            self.extra_large = None
        self.bucket_fill, self.bucket_ranks, self.bucket_params = 0, set(), []

    def end_backward(self, boundary: bool = True) -> None:
        """The end of a micro-step's backward; `boundary`: the last micro-step of the optimizer step.
        Stages 0 and 1 reduce only at the boundary (the engine's `allreduce_gradients`); stage 2
        runs its epilogue after every micro-step."""
        t, b = self.t, self.b
        if self.setup.stage != Stage.GRADIENTS and not boundary:
            return
        if self.setup.stage == Stage.DISABLED:
            # allreduce_bucket flattens each bucket (`comm.stage0_allreduce_bucket_tensors`) in turn (a
            # bucket of one tensor is a view of it), and casts it to communication_data_type where that differs.
            c = self.setup.comm_bytes
            for tensors in stage0_allreduce_bucket_tensors(self.numels):
                bucket = sum(tensors)
                flat = t.alloc(b * bucket) if len(tensors) > 1 else None
                if c != b:
                    t.free(t.alloc(c * bucket))       # the cast, released first (a local of allreduce_bucket)
                if flat is not None:
                    t.free(flat)
            return
        if not self.in_hooks:
            # ZeRO-1 moves the gradients into buckets now, in parameter order (stage_1_and_2.py:971).
            for index in sorted(self.grads):
                self._into_bucket(index, self.numels[index])
                self._release(self.grads.pop(index), self.numels[index])
        self._reduce()
        t.free(*self.kept_grads)
        self.kept_grads = []
        t.free(*reversed(self.bucket))               # _release_ipg_buffers: the second first
        if self.micro_grads is not None:
            t.free(self.micro_grads)
        self.bucket, self.bucket_fill, self.micro_grads = None, 0, None
        self.later_micro_step = not boundary

    def step(self) -> None:
        t, b, s = self.t, self.b, self.part.flat_shard
        if self.setup.stage == Stage.DISABLED:
            # fused_optimizer.py:286-314: an fp32 copy of each gradient, one flat fp32 copy, the
            # copies freed, the bit16 gradients set to None, the flat copy freed.
            copies = [t.alloc(4 * n) for n in self.numels]
            flat = t.alloc(4 * self.part.num_params)
            t.free(*reversed(copies))                 # the list comprehension's items, last first
            t.free(*(self.grads.pop(i) for i in sorted(self.grads)))
            t.free(flat)
            return
        if self.offload:              # the host's step; the norm was taken at the reduction
            return
        # get_grad_norm_direct: an fp64 copy of each of the rank's gradient pieces in turn (the parts
        # of the flat group's parameters in its slice).
        pieces = [k for o, n in zip(self.offsets, self.numels) if (k := _overlap(o, n, s, self.rank))]
        for n in pieces:
            t.free(t.alloc(8 * n))
        flat = t.alloc(b * s)                         # flatten the partition gradients
        cast = t.alloc(4 * s)                         # their fp32 cast
        t.free(flat, self.partition_grads)
        self.partition_grads = None
        if self.moments is None:                      # Adam's moments, made at the first step
            self.moments = (t.alloc(4 * s), t.alloc(4 * s))
        t.free(cast)


GATHER_STREAM = 1     # stage 3's all-gather stream: the coordinator's fetched parameters live in its pool


class _Stage3:
    """DeepSpeed's ZeRO-3, without offload or with the optimizer's, as the H200 histories record it
    (`data/snapshots/t4-warmup/*-s3-*`, `t5-offload/*-s3-*`; DeepSpeed 0.19.8 `runtime/zero/stage3.py`,
    `partition_parameters.py`, `linear.py`). Every parameter is partitioned and gathered, frozen ones
    included; the optimizer's (`ModelSpec.trainable`) are defragmented into one flat buffer and get
    gradient partitions, an fp32 master and moments, and a frozen one keeps its own partition.
    PEFT's adapters under zero.Init stay fp32 (`states.wide_stage3_elements`): their partitions,
    gathers and flat buffer are 4 bytes an element."""

    NORM_CHUNK = 250_000_000   # _constant_buffered_norm2 takes a gradient's norm in chunks of this many elements

    REDUCE_STREAM = 2     # reduce_and_partition_stream: the bucket's flatten, the fp16 overflow check

    def __init__(self, t: _Trace, model: ModelSpec, setup: Setup):
        self.t, self.model, self.setup = t, model, setup
        self.b, self.n = setup.param_bytes, setup.dp
        self.shards = [ceil(x / self.n) for x in model.param_numels]
        wide = wide_stage3_elements(model, setup) != (0, 0)
        self.pb = [4 if wide and model.wide[i] else self.b for i in range(len(self.shards))]   # bytes an element
        self.trained = model.trained_indices
        self.trained_shards = [self.shards[i] for i in self.trained]
        self.groups = sub_groups(self.trained_shards, setup.sub_group_size)
        self.offload = setup.offload_optimizer != "none"
        self.param_offload = setup.offload_param != "none"
        self.bucket_fill, self.bucket_params, self.moments = 0, [], None
        self.bucket_grads = []                  # gradients held in the bucket's list, not its buffer (`_hook`)
        self.gathered, self.calls = {}, {}      # parameter -> its gathered tensor; -> its coalesced call
        self.iterations = 0
        self.cursor = None                      # backward's place in its steps (`_advance`)
        self.cold = self.walk_cold = False      # persistent parameters released, not gathered again (`fetch`)
        trained = set(self.trained)
        self.leaf_of = {p: leaf for leaf in (tuple(p for p in under if p in trained) for under in model.stage3_leaves)
                        for p in leaf}
        self.leaf_grads = {}                    # a leaf's gradients made, waiting for its hook (`grad_ready`)
        self.trained_set = trained
        self.saved = {}                         # released parameters the recomputation saved (`_release`)
        self.views = model.viewed_params(setup.activation_checkpointing)   # and those forward saved

    def fetch(self, backward: bool) -> None:
        """The parameters' all-gathers and releases of one forward, or the start of one backward's (at
        N > 1, or at N = 1 with parameter offload; else a fetched parameter is a view of its partition).
        The first iteration records the trace: each module's parameters are gathered when it runs and
        released after it; later ones prefetch (`stage3_trace.fetches`). Forward's are played as one
        block before the model's forward; backward's module by module beside the backward's own
        allocations (`stage3_trace.backward_plan`, `_advance`), from the head's pre-backward hook on."""
        if self.n == 1 and not self.param_offload:
            return
        record = self.iterations == 0
        if not backward:
            self.walk_cold, self.cold = self.cold and not record, False
        steps = stage3_trace.fetches(self.model, self.setup, record=record, cold=self.walk_cold)
        forward_steps = len(self.model.trace)
        if not backward:
            for actions in steps[:forward_steps]:
                self._play(actions)
            return
        self.cursor = [stage3_trace.backward_plan(self.model, self.setup, record, self.walk_cold), 0, None, [], set(), 0, 0]
        self._advance()

    def _play(self, actions) -> None:
        """One step's coordinator actions (`stage3_trace.fetches`). A call of one parameter gathers it
        whole, padded (its buffer is the parameter's data: `_all_gather_sequential`); a call of several
        gathers into one flat buffer and, at the first wait for any of them, copies each out
        (`AllGatherCoalescedHandle.wait`: torch.cat of its slices); the flat buffer is freed once every
        parameter of the call has been waited for. All on the all-gather stream."""
        t, pb, numel, s = self.t, self.pb, self.model.param_numels, GATHER_STREAM
        for kind, what in actions:
            if kind == "gather" and not self.gathered.keys().isdisjoint(what):
                # a parameter whose release waits for an active backward module is still gathered
                what = tuple(p for p in what if p not in self.gathered)
                if not what:
                    continue
            if kind == "gather" and (len(what) == 1 or self.param_offload):
                # one buffer per parameter: a one-parameter call, or at N = 1 with parameter
                # offload each host partition's copy to the device (_no_gather_coalesced)
                for p in what:
                    self.gathered[p] = t.alloc(pb[p] * self.shards[p] * self.n, stream=s)
            elif kind == "gather":
                # one flat buffer per dtype among the call's parameters (`_all_gather_params`)
                widths = sorted({pb[p] for p in what})
                flats = [t.alloc(w * self.n * sum(self.shards[p] for p in what if pb[p] == w), stream=s)
                         for w in widths]
                call = {"flats": flats, "params": what, "waiting": set(what), "copied": False}
                self.calls.update(dict.fromkeys(what, call))
            elif kind == "wait" and what in self.calls:
                call = self.calls.pop(what)
                if not call["copied"]:
                    for p in call["params"]:
                        self.gathered[p] = t.alloc(pb[p] * numel[p], stream=s)
                    call["copied"] = True
                call["waiting"].discard(what)
                if not call["waiting"]:
                    t.free(*call["flats"])
            elif kind == "release":
                self._release(what)

    def _release(self, p: int, recomputed: bool = False) -> None:
        """Free a gathered parameter. One the recomputation released (`recomputed`) is, for DeepSpeed,
        released, but its memory lives on until its gradient is made: the recomputed forward saved it
        for backward, and checkpointing keeps what the recomputation saves as detached aliases of it,
        which the release's swap of `param.data` does not reach; a later fetch gathers it again
        beside it (the H200 history of Llama-3.1-405B's shape, `data/snapshots/fake-405b/`: each
        layer's gate projection, 1.6 GiB, held twice in backward). One whose gradient is made already
        (the module whose backward started the recomputation) is freed. Forward's release of a parameter
        forward saved a view of (`ModelSpec.viewed_params`) leaves it alive likewise, until its gradient
        is made or, frozen, its module's backward releases the copy gathered again for it."""
        h = self.gathered.pop(p, None)
        if h is None:
            return
        if recomputed and p in self.trained_set and p not in self.cursor[4]:
            self.saved[p] = h
        elif self.cursor is None and p in self.views and p not in self.saved:
            self.saved[p] = h
        else:
            self.t.free(h)
            if self.cursor is not None and p in self.saved and p not in self.trained_set:
                self.t.free(self.saved.pop(p))

    def _advance(self) -> None:
        """Play backward's steps up to the next one that is not done (`stage3_trace.backward_plan`),
        each at its module's pre-backward hook, its releases at its post-backward hook. A module with
        trained parameters is done once their gradients have reached their hooks; one without (frozen
        parameters, a tied embedding's head) before the next module's pre-backward hook. A checkpointed
        layer's recomputation (the recomputed steps after the step whose module's backward starts it)
        runs at the next gradient's hook or the end of the head's or a layer's backward (the stream's
        recomputation opens the layer's segment), before that module's gradients; its releases wait
        for that module's (`release_sub_module` keeps a parameter that an active backward module holds,
        and releases the frozen ones the recomputation fetched with the module that started it), which,
        without trained parameters, is done at the next such point after the recomputation."""
        cursor = self.cursor
        steps, pos, waiting, held, ready, ticks, since = cursor
        while True:
            if waiting is not None:
                if pos < len(steps) and steps[pos][2]:
                    if ticks == since:
                        break
                    while pos < len(steps) and steps[pos][2]:
                        pre, release, _, _ = steps[pos]
                        self._play(pre)
                        held += release
                        pos += 1
                    since = ticks
                waits = steps[waiting][3]
                if not (waits <= ready if waits else ticks > since):
                    break
                for p in steps[waiting][1]:
                    self._release(p)
                for p in held:
                    self._release(p, recomputed=True)
                waiting, held = None, []
            if pos == len(steps):
                break
            pre, release, _, waits = steps[pos]
            self._play(pre)
            pos += 1
            if waits or (waits is not None and pos < len(steps) and steps[pos][2]):
                waiting, since = pos - 1, ticks
            else:
                for p in release:
                    self._release(p)
        cursor[1:4] = pos, waiting, held
        cursor[6] = since

    def backward_tick(self) -> None:
        """The end of the head's or a layer's backward: a step that waits for no gradient is done."""
        if self.cursor is not None:
            self.cursor[5] += 1
            self._advance()

    def _finish_backward(self) -> None:
        """The steps left when backward ends, and `release_and_reset_all`: every gathered parameter freed."""
        if self.cursor is None:
            return
        steps, pos, waiting, held = self.cursor[:4]
        for pre, release, _, _ in steps[pos:]:
            self._play(pre)
            held += release
        for p in (*(steps[waiting][1] if waiting is not None else ()), *held):
            self._release(p)
        self.t.free(*self.gathered.values(), *self.saved.values())
        self.gathered, self.saved, self.cursor = {}, {}, None
        self.cold = self.iterations == 0        # the recording iteration released the persistent ones too
        self.iterations += 1

    def init(self, params: list) -> None:
        t, b, pb, trained, numels = self.t, self.b, self.pb, self.trained, self.model.param_numels
        flat = sum(pb[i] * self.shards[i] for i in trained)    # the optimizer's partitions, defragmented
        if self.setup.zero_init:
            # built partitioned (`_zero_init_build`); PEFT's adapters, made after the model on the host,
            # are converted at initialize (`_convert_to_zero_parameters`: each moved to the device
            # whole and partitioned); _create_fp16_partitions_with_defragmentation frees the
            # optimizer's partitions, empties the cache and makes one flat buffer of them
            params = list(params)
            for i in _made_after(self.model):
                whole = t.alloc(pb[i] * numels[i])
                params[i] = None if self.param_offload else t.alloc(pb[i] * self.shards[i])
                t.free(whole)
            t.free(*(params[i] for i in trained if params[i] is not None))
            if not self.param_offload:
                t.empty_cache()
                t.alloc(flat)
        elif self.param_offload:
            # each module parameter goes to its host partition and is freed; nothing empties the
            # cache, so the module's blocks stay reserved (1.45-1.75x allocated on H200)
            t.free(*params)
        else:
            # zero.Init off: each module parameter is copied into its partition and freed
            # (_partition_param); _create_fp16_partitions_with_defragmentation frees the optimizer's
            # partitions, empties the cache and makes one flat bit16 buffer of them (utils.defragment)
            parts = []
            for i, p in enumerate(params):
                parts.append(t.alloc(pb[i] * self.shards[i]))
                t.free(p)
            t.free(*(parts[i] for i in trained))
            t.empty_cache()
            t.alloc(flat)
        if not self.offload:
            if all(pb[i] == 4 for i in trained):
                # _create_fp32_partitions of an fp32 flat buffer (PEFT's adapters under zero.Init): its
                # `.to(fp32)` is itself, cloned per sub-group (kept)
                for g in self.groups:
                    t.alloc(4 * g)
            else:
                # _create_fp32_partitions: per sub-group an fp32 cast and its clone (kept); the cast is
                # freed once the next sub-group's cast exists (with offload both live on the host)
                cast = None
                for g in self.groups:
                    new = t.alloc(4 * g)
                    if cast is not None:
                        t.free(cast)
                    t.alloc(4 * g)
                    cast = new
                t.free(cast)
            t.free(t.alloc(4 * max(self.groups)))    # initialize_optimizer_states' zero buffer
        t.alloc(b * self.setup.reduce_bucket_size)   # the ipg bucket's flat buffer, kept
        if not self.offload:
            t.alloc(b * sum(self.trained_shards))    # the flat gradient partitions, kept (else on the host)
        # create_reduce_and_remove_grad_hooks gathers (at N = 1: copies) each of the optimizer's
        # parameters once and partitions it again, but for the persistent ones (kept whole on every
        # rank at N > 1)
        persistent = persistent_mask(numels, self.setup)
        for i in trained:
            h = t.alloc(pb[i] * self.shards[i] * self.n)
            if self.param_offload:                   # the host partition's copy, gathered from
                t.free(t.alloc(b * self.shards[i]))
            if not persistent[i] or (self.n == 1 and not self.param_offload):
                t.free(h)
        if self.n > 1:
            # a frozen persistent parameter (norm weights under LoRA) is gathered at its module's first
            # fetch and kept: taken here, a few layers' vectors early
            for i in sorted(set(range(len(numels))) - set(trained)):
                if persistent[i]:
                    t.alloc(pb[i] * self.shards[i] * self.n)

    def grad_ready(self, index: int, numel: int, g: int | None = None) -> None:
        """The hook copies the gradient into the ipg bucket (reducing it first when the gradient
        would overflow it) and frees it. A stage-3 leaf's gradients wait for the leaf's own backward
        hook, which hands them all, in `parameters()` order, once its last one is made
        (`create_reduce_and_remove_grad_hooks`' `reduce_leaf_module_grads`; the H200 history of
        Mixtral-8x7B, `data/snapshots/fake-moe/`: both experts' gradients and both gathered weights
        alive together, 2.6 GiB at rank 0 of 256)."""
        g = self.t.alloc(self.b * numel) if g is None else g
        if index in self.saved:                 # its backward, done, let go of the recomputation's alias
            self.t.free(self.saved.pop(index))
        leaf = self.leaf_of.get(index)
        if self.leaf_grads and leaf not in self.leaf_grads:
            self._leaf_hooks()                  # backward has left the leaf
        if leaf is None:
            self._hook(index, numel, g)
            return
        made = self.leaf_grads.setdefault(leaf, {})
        made[index] = g
        if len(made) == len(leaf):
            self._leaf_hooks()

    def _leaf_hooks(self) -> None:
        """A leaf's backward hook: a parameter of it that made no gradient (an expert no token chose)
        is given zeros the size of the gathered parameter, then each is handed as any other's."""
        for leaf, made in self.leaf_grads.items():
            for p in leaf:
                n = self.model.param_numels[p]
                self._hook(p, n, made[p] if p in made else self.t.alloc(self.pb[p] * n))
        self.leaf_grads = {}

    def _hook(self, index: int, numel: int, g: int) -> None:
        """`reduce_ready_partitions_and_remove_grads` on one gradient (`grad_ready`). A gradient
        larger than the bucket is not copied into it: it stays where autograd made it, in the
        bucket's list, until the next gradient's hook reduces the bucket (`__add_grad_to_ipg_bucket`;
        the H200 history of Llama-3.1-405B's shape at rank 0 of 1,024, `data/snapshots/fake-405b/`:
        two 1.6 GiB MLP gradients alive together)."""
        if self.bucket_fill + numel > self.setup.reduce_bucket_size and self.bucket_fill:
            self._reduce()
        self.bucket_fill += numel
        self.bucket_params.append(index)
        if self.bucket_fill <= self.setup.reduce_bucket_size:
            self.t.free(g)
        else:
            self.bucket_grads.append(g)
        if self.cursor is not None:
            self.cursor[4].add(index)
            self.cursor[5] += 1
            self._advance()

    def _reduce(self) -> None:
        """reduce_scatter_coalesced flattens the bucket's gradients, each padded to a multiple of N,
        on the reduction stream (a bucket of one gradient that needs no padding is reduced as a view of
        it: coalesced_collectives.py:102; the H200 history of Qwen3-0.6B through HF Trainer,
        `data/snapshots/hf-diag/`, whose h²-element buckets hold one weight each); the rank's slices
        are copied into the flat gradient partitions. With optimizer offload, partition_grads then
        takes each slice to the host while the flatten lives: a device copy of it, its norm in fp64
        chunks (_constant_buffered_norm2), an fp32 cast."""
        t, b, r = self.t, self.b, self.REDUCE_STREAM
        one = self.bucket_params[0] if len(self.bucket_params) == 1 else None
        flat = None if one is not None and self.model.param_numels[one] % self.n == 0 else \
            t.alloc(b * sum(self.shards[i] * self.n for i in self.bucket_params), stream=r)
        if self.offload:
            for i in sorted(self.bucket_params):       # __reduce_and_partition_ipg_grads sorts by ds_id
                s = self.shards[i]
                copy = t.alloc(b * s, stream=r)
                for start in range(0, s, self.NORM_CHUNK):
                    t.free(t.alloc(8 * min(self.NORM_CHUNK, s - start), stream=r))
                t.free(t.alloc(4 * s, stream=r))
                t.free(copy)
        if flat is not None:
            t.free(flat)
        self.t.free(*self.bucket_grads)
        self.bucket_fill, self.bucket_params, self.bucket_grads = 0, [], []

    def end_backward(self, boundary: bool = True) -> None:
        if self.leaf_grads:
            self._leaf_hooks()
        self._finish_backward()
        if self.bucket_fill:
            self._reduce()

    def step(self) -> None:
        """fp16's overflow check; get_grad_norm_direct: an fp64 copy of each gradient partition in
        turn; then per sub-group _prepare_fp32_grad_for_sub_group (a bit16 copy of the sub-group's
        gradients, their fp32 cast) and Adam's moments, made at the first step."""
        t, b = self.t, self.b
        self.cold = False             # `_post_step` gathers the persistent parameters again
        if self.offload:              # the host's step; the norms were taken at the reductions
            return
        if self.setup.dtype == "fp16":
            # has_overflow on the reduction stream: isinf and isnan over the flat gradient partitions
            # (an fp16 temporary and a bool per element; H200 histories)
            r, s3 = self.REDUCE_STREAM, sum(self.trained_shards)
            tmp = t.alloc(2 * s3, stream=r)
            inf = t.alloc(s3, stream=r)
            t.free(tmp, inf)
            t.free(t.alloc(s3, stream=r))
        for s in self.trained_shards:
            t.free(t.alloc(8 * s))
        moments = []
        for g in self.groups:
            low = t.alloc(b * g)
            fp32 = t.alloc(4 * g)
            t.free(low)
            if self.moments is None:
                moments += [t.alloc(4 * g), t.alloc(4 * g)]
            t.free(fp32)
        self.moments = self.moments or moments


def generated(model: ModelSpec, setup: Setup) -> bool:
    """Whether `events` generates this configuration: what the histories cover (seed-gpt —
    nn.MultiheadAttention whatever --attention says — and hf-llama with sdpa, bf16/fp16 through
    DeepSpeed's ZeRO or FP16 optimizer, gradients in the training dtype; any number of micro-steps
    (stage 3's checked at N = 16-64 as rank 0 of a fake world, docs/scale.md); optimizer offload with
    one micro-step (at stage 3 in bf16),
    parameter offload beside it at N = 1; overlap_comm at stages 1/2 with one micro-step, without
    offload); frozen parameters and LoRA with the model's own stream (`_adapted`)."""
    arch = model.architecture
    s3, offload = setup.stage == Stage.PARAMETERS, setup.offload_optimizer != "none"
    if model.frozen and not _adapted(model, setup):
        return False
    return (arch is not None and step_stream(model, setup) is not None and setup.seq_len is not None
            and (setup.offload_param == "none" or (s3 and offload and setup.dp == 1))
            and (not offload or (setup.gas == 1 and (not s3 or setup.dtype == "bf16")))
            and setup.mixed_precision                                      # stage 3 always overlaps
            and (s3 or not setup.overlap or (setup.stage != Stage.DISABLED and setup.gas == 1 and not offload))
            and setup.grad_accum_dtype in (None, setup.dtype) and not setup.bf16_optimizer
            and setup.contiguous_gradients)


def _adapted(model: ModelSpec, setup: Setup) -> bool:
    """Whether a model with frozen parameters (LoRA, --freeze) has its own stream for this setup: one
    recorded from PEFT's model with the same trained tensors (`zerocalc.hf.adapted`: "params",
    "trained") in the variant the setup runs (at stage 3 as zero.Init leaves it: fp32 adapters,
    DeepSpeed's linear), without offload (not measured with frozen parameters). A full fine-tune's
    stream would hand gradients of frozen tensors and keep their linears' inputs."""
    stream = step_stream(model, setup)
    s3 = setup.stage == Stage.PARAMETERS
    name = ("checkpointed" if setup.activation_checkpointing else "plain") + ("_zero3" if s3 else "")
    return (stream is not None and stream.get("params") == len(model.param_numels)
            and stream.get("trained") == len(model.trained_indices) and name in stream
            and (not s3 or setup.zero_init) and setup.offload_optimizer == "none" and setup.offload_param == "none")


CUBLAS_WORKSPACE_BYTES = 32 << 20   # per cuBLAS handle and stream, made at its first matmul, kept (H200)


def _to_device_order(model: ModelSpec) -> list[int]:
    """The order in which `model.to(device)` makes the parameters: `Module._apply` moves a module's
    children before its own parameters, so seed-gpt's `nn.MultiheadAttention` makes out_proj's weight
    and bias before its in_proj weight and bias (the H200 histories: 8 MiB, then 24 MiB for the 1.4B
    GPT); elsewhere as `parameters()` lists them."""
    order = list(range(len(model.param_numels)))
    if model.architecture.family == "seed-gpt":
        for first in range(1, 1 + 12 * model.architecture.num_layers, 12):   # _seed_gpt_layer's 12 tensors
            order[first + 2:first + 6] = [first + 4, first + 5, first + 2, first + 3]
    return order


def _zero_init_build(t: _Trace, model: ModelSpec, setup: Setup) -> list:
    """The model built under deepspeed.zero.Init (`partition_parameters.py`) in the training dtype,
    as HF builds it for Trainer (`dtype="auto"`, `torch_dtype=bfloat16`): the tensor constructors it
    wraps make each parameter on the device (`zero_wrapper_for_fp_tensor_constructor`); at the end of
    its module's __init__, `_post_init_method` partitions it (`_partition_param`: the rank's 1/N
    slice, then the whole tensor freed; on the host under parameter offload). One parameter whole at
    a time, never the model (H200 histories, `data/snapshots/fake-zero-init/`): the partitions'
    handles, in parameter order (None where they live on the host). A model made in fp32 and cast
    would make an fp32 copy of each first."""
    b, n = setup.param_bytes, setup.dp
    on_host = setup.offload_param != "none"
    later = set(_made_after(model))
    parts = []
    for i, numel in enumerate(model.param_numels):
        if i in later:                    # made after the model, outside zero.Init (`_Stage3.init`)
            parts.append(None)
            continue
        whole = t.alloc(b * numel)
        parts.append(None if on_host else t.alloc(b * ceil(numel / n)))
        t.free(whole)
    return parts


def _made_after(model: ModelSpec) -> list[int]:
    """The parameters made after the model (`ModelSpec.wide`: PEFT's adapters, by `get_peft_model`)."""
    return [i for i, w in enumerate(model.wide or ()) if w]


def events(model: ModelSpec, setup: Setup, steps: int | None = None, fresh_process: bool = True, rank: int = 0):
    """The allocation events of init and `steps` training steps, or None where not generated.
    Three steps by default: the first makes Adam's moments and the cache's layout, the second runs
    on it, and the third can still grow it: at stage 3 with N > 1 the first prefetching iteration
    (the second) runs on a cache the trace-recording one shaped (the third grew reserved on two of
    eighteen N = 2 rows, 0.6%); the 1.1B Llama at stage 0 as a later job grew from 35.51 to 39.61 GiB
    in the forward after its two warm-up steps (data/h200-t6-process-b-n1.csv). A fourth step grows
    none of the 111 measured configurations. cuBLAS takes a workspace at the first matmul of the main
    thread (forward) and of autograd's thread (backward) and keeps it (32 MiB each: the histories'
    allocations without a free; later jobs of a process start with 64 MiB allocated).
    fresh_process=False: a later job's, made before."""
    if not generated(model, setup):
        return None
    return _job(model, setup, steps, fresh_process, rank)[0]


def _job(model: ModelSpec, setup: Setup, steps: int | None, fresh_process: bool, rank: int):
    """(events, the cuBLAS workspaces' handles) of one generated job: `events` above."""
    for t, workspaces in _pieces(model, setup, steps, fresh_process, rank):
        pass
    return t.events, workspaces


def _pieces(model: ModelSpec, setup: Setup, steps: int | None, fresh_process: bool, rank: int):
    """`_job` made step by step: yields (the trace so far, the workspaces' handles) once init is
    generated and after each training step. Each micro-step plays the model's stream (`_TracedStep`:
    forward, loss, backward) beside DeepSpeed's side (`_Stage`, `_Stage3`)."""
    if steps is None:
        steps = 3
    t = _Trace()
    workspaces = [] if fresh_process else [t.alloc(CUBLAS_WORKSPACE_BYTES), t.alloc(CUBLAS_WORKSPACE_BYTES)]
    s3 = setup.stage == Stage.PARAMETERS
    if s3 and setup.zero_init:
        params = _zero_init_build(t, model, setup)
    else:
        params = [0] * len(model.param_numels)
        for i in _to_device_order(model):
            params[i] = t.alloc(setup.param_bytes * model.param_numels[i])
    for n_bytes in module_buffers_bytes(model, setup):
        # the module buffers, on the device for good (`model.to(device)` moves them after the
        # parameters of the modules holding them; zero.Init makes them there): GPTBigCode's 64 MiB
        # causal mask, the rotary `inv_freq`
        t.alloc(n_bytes)
    ds = _Stage3(t, model, setup) if s3 else _Stage(t, model, setup, rank)
    ds.init(params)
    step = _TracedStep(t, model, setup, ds, workspaces, step_stream(model, setup))
    yield t, workspaces
    for k in range(steps):
        # The micro-steps of one optimizer step: the first, one in the middle (the rest repeat it on
        # the same cache: simulating all five of GAS 5 gave the same reserved peak on 24 Llama and GPT
        # configurations, stages 0-2, N = 1 and 2, with and without checkpointing) and the boundary.
        # Stage 3 carries nothing from one micro-step to the next (its gradients are reduced and added
        # into the partitions as they come): the first and the boundary, and in the first step the
        # second, which gathers the persistent parameters the recording one released (`_Stage3.fetch`).
        middle = (min(1, setup.gas - 1),) if not s3 or k == 0 else ()
        for micro in sorted({0, *middle, setup.gas - 1}):
            if s3:
                ds.fetch(backward=False)
            step.forward()
            step.backward(*((lambda: ds.fetch(backward=True), ds.backward_tick) if s3 else ()))
            ds.end_backward(boundary=micro == setup.gas - 1)
        ds.step()
        yield t, workspaces


class Peaks(NamedTuple):
    allocated_bytes: int     # max_memory_allocated()
    reserved_bytes: int      # max_memory_reserved()
    at_init: bool            # allocated's peak reached before the first step (stage 3 built whole: the model)


def peaks_of(replays) -> Peaks:
    """The replays' largest allocated and reserved peaks; at_init where the largest allocated one was
    reached by the end of init."""
    top = max(replays, key=lambda r: r.peak_allocated_bytes)
    return Peaks(top.peak_allocated_bytes, max(r.peak_reserved_bytes for r in replays),
                 top.init_peak_allocated_bytes == top.peak_allocated_bytes)


def peaks_bytes(model: ModelSpec, setup: Setup, fresh_process: bool = True,
                ranks: tuple[int, ...] | None = None) -> Peaks | None:
    """(`max_memory_allocated()`, `max_memory_reserved()`, at init) of the generated sequence through
    the allocator simulation (the allocator `setup.expandable_segments` says) on the busiest rank
    (`simulated_ranks`, or of `ranks`), None where no sequence is generated. Allocated counts whole
    blocks, as torch does: a request that takes a cached block without splitting it holds all of it."""
    if not generated(model, setup):
        return None
    return peaks_of([_replay_to_steady_state(model, setup, fresh_process, r)
                     for r in ranks or simulated_ranks(model, setup)])


def peak_reserved_bytes(model: ModelSpec, setup: Setup, fresh_process: bool = True) -> int | None:
    """`max_memory_reserved()` of `peaks_bytes`."""
    peaks = peaks_bytes(model, setup, fresh_process)
    return None if peaks is None else peaks[1]


def step_pieces(model: ModelSpec, setup: Setup, fresh_process: bool = True, rank: int = 0,
                steps: int | None = None):
    """`replay_steps`' pieces of one generated job, made step by step: init's events (with 0), then
    each training step's (three unless `steps` says) with the last handle made before it."""
    done, last = 0, 0
    for t, _ in _pieces(model, setup, steps, fresh_process, rank):
        yield t.events[done:], last
        done, last = len(t.events), t.last_handle


@contextmanager
def cycle_collector_paused():
    """Python's cycle collector paused while a job is generated and replayed: the job's tens of
    thousands of event tuples and blocks make no cycles, and its passes over them (and every object
    of a fresh process) cost the simulation time, not memory."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _replay_to_steady_state(model: ModelSpec, setup: Setup, fresh_process: bool, rank: int) -> Replay:
    """`replay(events(...))` of one generated job, stopping at the allocator's steady state
    (`replay_steps`); the steps are generated one at a time, the cycle collector paused."""
    with cycle_collector_paused():
        return replay_steps(step_pieces(model, setup, fresh_process, rank), setup.expandable_segments)


def replay_steps(pieces, expandable_segments: bool = False, capacity_bytes: int | None = None,
                 placement: str = "returned") -> Replay:
    """`replay` of the pieces' events one after another (init, then one piece per training step; each
    piece with the last handle made before it), without running a step that cannot change the
    answer: one whose events are the last step run's (allocation sizes and streams, frees, in order;
    the tensors it makes renamed as that step's, those from before it the same) while that step left
    the allocator as it found it (`allocator.state`: every block, which tensor holds which, the free
    lists, reserved, allocated, no segment made or returned). Such a step starts from the state that
    step started from and does the same: the same reserved and allocated at every event (no new
    peak), the state left as it is, so the step after it is judged against the same step again.
    Exact: the result is `replay`'s of all the events, segments and releases included
    (`tests/test_sequence.py`). In a generated job that is typically the third step, once the second
    left the cache as the first did. With a capacity (`allocator.replay`) the same holds (a step with
    a retry returned segments, so the state after it differs), and the replay stops at an OOM.
    `placement`: `allocator.PLACEMENTS`."""
    a = allocator.start(expandable_segments=expandable_segments, capacity_bytes=capacity_bytes, placement=placement)
    model_step = None    # (state before, events, last handle before) of the last step run
    init_peak = None
    for k, (events, last) in enumerate(pieces):
        if a.oom is not None:
            break
        if k == 0:                              # init
            a.run(events)
            init_peak = a.peak_allocated - a.base_allocated
            continue
        before = a.state()
        if model_step is not None and model_step[0] == before and _same_step(model_step[1], model_step[2], events, last):
            a.skip(len(events))
        else:
            a.run(events)
            model_step = (before, events, last)
    return a.result()._replace(init_peak_allocated_bytes=init_peak)


def _same_step(a: list, a_last: int, b: list, b_last: int) -> bool:
    """Whether step b's events are step a's with the tensors each makes renamed (handles after
    a_last and b_last, in the same order) and the same tensors from before freed."""
    if len(a) != len(b):
        return False
    shift = b_last - a_last
    for x, y in zip(a, b):
        if x[0] != y[0]:
            return False
        if x[0] == "alloc":
            if y[1] != x[1] + shift or y[2] != x[2] or y[3] != x[3]:
                return False
        elif x[0] == "free":
            if y[1] != (x[1] + shift if x[1] > a_last else x[1]):
                return False
        elif x != y:
            return False
    return True


def process_peak_reserved_bytes(jobs) -> int | None:
    """The reserved peak of the last of `jobs` ((model, setup) pairs) run after the others in one
    process, as the validator runs a matrix: after each job its tensors are freed and the cache
    emptied (`validate.worker`), but cuBLAS's workspaces, made by the first job, stay, and so does
    every segment a workspace lies in; the next job starts on those. max_memory_reserved is reset at
    each job's start, so the peak is the last job's alone, counted from what was reserved then.
    None if any job is not generated."""
    return process_peaks_reserved_bytes(jobs)[-1]


def process_peaks_reserved_bytes(jobs, rank: int = 0) -> list[int | None]:
    """`process_peak_reserved_bytes` of every prefix of `jobs` at once: the k-th entry is job k's peak
    run after jobs 0..k-1 (None from the first job that is not generated on), on `rank`. One replay of the whole
    process per allocator setting among the jobs (each job's peak is read with its own setting, the
    whole process replayed under it, as the single-job function does): linear in the process's length
    where asking job by job is quadratic."""
    n = 0
    while n < len(jobs) and generated(*jobs[n]):
        n += 1
    combined, starts, offset, workspaces = [], [], 0, set()
    for k, (model, setup) in enumerate(jobs[:n]):
        ev, ws = _job(model, setup, None, k == 0, rank)
        if k:
            ev = ev[2:]            # events(fresh_process=False) opens with the workspaces: the first job's
        else:
            workspaces = {h + offset for h in ws}
        relabelled = [(e[0], e[1] + offset, *e[2:]) if e[0] != "empty_cache" else e for e in ev]
        offset += max((e[1] for e in ev if e[0] == "alloc"), default=0)
        starts.append(len(combined))
        combined += relabelled
        alive = {}
        for e in relabelled:       # the job's end: every tensor of it freed but the workspaces
            if e[0] == "alloc":
                alive[e[1]] = True
            elif e[0] == "free":
                alive.pop(e[1], None)
        combined += [("free", h) for h in alive if h not in workspaces]
        combined.append(("empty_cache",))
    peaks = [None] * len(jobs)
    for expandable in {setup.expandable_segments for _, setup in jobs[:n]}:
        mine = [k for k in range(n) if jobs[k][1].expandable_segments == expandable]
        changes = replay(combined, expandable_segments=expandable).reserved_changes()
        reserved, c = 0, 0
        for k in range(mine[-1] + 1):   # job k's events are starts[k] up to the next job's start
            end = starts[k + 1] if k + 1 < n else len(combined)
            peak = reserved             # what was reserved when the job started: its peak is at least that
            while c < len(changes) and changes[c][0] < end:
                reserved += changes[c][1]
                peak = max(peak, reserved)
                c += 1
            if k in mine:
                peaks[k] = peak
    return peaks
