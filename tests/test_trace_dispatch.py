"""The fake-tensor trace against real execution: for one small model of each family, the recorders
zerocalc uses on fake tensors (`zerocalc.hf.memtrace.record`: every storage's birth with its bytes,
module and operator, its death, the module exits; `layers_kept_bytes`: what the decoder layers keep
for backward) run unchanged on the same model built for real on the CPU, with random weights and random
tokens, through forward, loss and backward. A third dispatch mode logs every operator dispatched
(views and in-place ones too, which allocate nothing). Equal, event for event, for every family.

The differences, each asserted exactly. The fake path replaces transformers' packed-sequence check
(`masking_utils.find_packed_sequence_indices`: data-dependent, it cannot be decided on fake tensors)
by its answer for a batch of whole sequences, "not packed" (`memtrace.unpacked_batch`). The real run
here keeps transformers' own check, run as a module of its own so the recorder names what it
allocates: it answers "not packed", and its temporaries (a few [B, s] integer tensors) all die inside
it; without them the streams are equal. The fake run's operators add `prim.device` (a fake tensor's
device, asked of the fake mode); and where a model writes into a view of a tensor (DeepSeek-V2's key),
autograd handles the fake tensor (a tensor subclass) by its view function, a plain one by `as_strided`
or without dispatching: views either way (`view_replays`, `views_as_strided`).

Mixture of experts: transformers' default experts implementation (`grouped_mm`) sorts the T·k
token-expert pairs by expert and runs one grouped matmul over them, so no tensor's size depends on the
routing; the streams are equal with random routing and with every token routed to the same experts.
The per-expert loop (`experts_implementation="eager"`) is data-dependent and cannot be traced.

Also equal: `memtrace.record_step`, the allocation stream the allocator simulation plays (gradients
handed to the optimizer, layer bounds, the markers the CUDA rules read), without and with activation
checkpointing (`use_reentrant=False`, as the validator and HF Trainer set it); and, from the first layer on, a real step given an all-ones attention mask (a tokenizer's, for
unpadded sequences) against the fake one without.

Tiny configs (hidden 64, 2 layers, vocabulary 128, B 2, s 16): about a second of CPU a family; three
families (one MoE) run by default, the rest are marked slow. Evidence: docs/hf-validation.md,
"The fake-tensor trace against real execution".
"""
import contextlib
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zerocalc.hf import memtrace, trace  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {   # model_type: a published config.json the project ships or validates
    "llama": "zerocalc/hf/configs/llama-3.2-1b.json",
    "gpt2": "zerocalc/hf/configs/gpt2.json",
    "qwen2": "validate/hf_configs/qwen2.5-0.5b.json",
    "qwen3": "validate/hf_configs/qwen3-0.6b.json",
    "gemma2": "validate/hf_configs/gemma-2-2b.json",
    "gemma3_text": "validate/hf_configs/gemma-3-1b.json",
    "phi3": "validate/hf_configs/phi-3-mini-4k.json",
    "gpt_neox": "validate/hf_configs/pythia-410m.json",
    "olmo2": "validate/hf_configs/olmo-2-1b.json",
    "mixtral": "validate/hf_configs/mixtral-8x7b.json",
    "qwen2_moe": "validate/hf_configs/qwen1.5-moe-a2.7b.json",
    "qwen3_moe": "zerocalc/hf/configs/qwen3-30b-a3b.json",
    "deepseek_v2": "zerocalc/hf/configs/deepseek-v2-lite.json",
    "stablelm": "validate/hf_configs/stablelm-2-1.6b.json",
}
FAST = ["qwen2", "gemma2", "mixtral"]
SLOW = [k for k in CONFIGS if k not in FAST]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2"]
VIEW_REPLAYS = ["deepseek_v2"]    # writes into views of a new tensor (`view_replays`, `views_as_strided`)
B, S, V = 2, 16, 128


def tiny(model_type: str) -> dict:
    """The published config at toy size: 2 layers, hidden 64, 4 heads of 16 (2 KV heads where the
    model groups them), FFN 96, 4 experts of 32 (top 2), vocabulary 128 (DeepSeek-V2: KV latent 16,
    heads of 16 + 8 rotary, one shared expert, layer 0 dense); every other key as published
    (activation, norms, biases, partial rotary, soft-capping, tied embeddings, rope scaling). Gemma-3's
    two layers are one sliding (window 8, shorter than the 16 tokens: its mask is built) and one full."""
    with open(os.path.join(ROOT, CONFIGS[model_type])) as f:
        d = json.load(f)
    if model_type == "gpt2":
        d.update(n_embd=64, n_head=4, n_inner=96, n_layer=2, n_positions=64, n_ctx=64)
    else:
        grouped = d.get("num_key_value_heads", d["num_attention_heads"]) < d["num_attention_heads"]
        d.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2 if grouped else 4,
                 intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)
    for key, value in (("head_dim", 16), ("query_pre_attn_scalar", 16), ("moe_intermediate_size", 32),
                       ("shared_expert_intermediate_size", 48), ("num_local_experts", 4), ("num_experts", 4),
                       ("num_experts_per_tok", 2), ("original_max_position_embeddings", 64),
                       ("n_routed_experts", 4), ("n_shared_experts", 1), ("kv_lora_rank", 16),
                       ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8), ("v_head_dim", 16)):
        if key in d:
            d[key] = value
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if d.get(key) is not None:
            d[key] = token
    if isinstance(d.get("rope_scaling"), dict) and "original_max_position_embeddings" in d["rope_scaling"]:
        d["rope_scaling"] = {**d["rope_scaling"], "original_max_position_embeddings": 32}   # Llama 3's: below 64
    if model_type == "gemma3_text":
        d.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    d["vocab_size"] = V
    return d


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator dispatched, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class PackedCheck(torch.nn.Module):
    """transformers' own packed-sequence check, as a module: the recorder's global module hooks name
    what it allocates ("?": a module outside the model) and mark its end; the operators it dispatches
    are noted apart (`spans` of the op log)."""

    def __init__(self, original, log):
        super().__init__()
        self.original, self.log, self.answers, self.spans = original, log, [], []

    def forward(self, position_ids):
        start = len(self.log.ops)
        out = self.original(position_ids)
        self.spans.append((start, len(self.log.ops)))
        self.answers.append(out)
        return out


@contextlib.contextmanager
def transformers_own_check(check):
    """In place of `memtrace.unpacked_batch`: transformers decides for itself whether the batch is packed."""
    from transformers import masking_utils
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = check
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _entered(stack, *modes):
    @contextlib.contextmanager
    def entered():
        for m in modes:
            stack.enter_context(m)
        yield
    return entered()


def fake_run(d: dict, batch=B, seq=S, prepare=None):
    """`memtrace.record` as zerocalc runs it: the model on fake tensors, zero tokens. Events as at the
    end of backward (what is alive then, the gradients, dies later with the model)."""
    model, mode = trace.build(trace.hf_config(d))
    if prepare:
        prepare(model)
    with mode:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    log = OpLog()
    with contextlib.ExitStack() as stack:   # the op log between the recorder and the fake tensors
        events = list(memtrace.record(model, _entered(stack, mode, log), ids))
    return events, log.ops


def real_model(d: dict, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(trace.hf_config(d), dtype=torch.bfloat16)
    model.train()
    return model


# transformers' packed-sequence check on position ids [B, s] (int64), by hand: first = p[:, :1] - 1
# (a view, then [B, 1]); diff = torch.diff(p, prepend=first) (the [B, s + 1] concatenation, two views of
# it, their [B, s] difference); (diff != 1) [B, s] bool; its cumsum [B, s] int64; [:, -1] a view; == 0
# [B] bool; .all() one bool; read on the host.
CHECK_OPS = ["aten.slice.Tensor", "aten.sub.Tensor", "aten.cat.default", "aten.slice.Tensor", "aten.slice.Tensor",
             "aten.sub.Tensor", "aten.ne.Scalar", "aten.cumsum.default", "aten.select.int", "aten.eq.Scalar",
             "aten.all.default", "aten._local_scalar_dense.default"]


def check_bytes(batch, seq):
    return [8 * batch, 8 * batch * (seq + 1), 8 * batch * seq, batch * seq, 8 * batch * seq, batch, 1]


def real_run(model, ids, monkeypatch):
    """The same recorder on real CPU tensors, transformers' packed-sequence check its own: (events,
    operators, the check), the check's events and operators taken out after asserting that they are
    the check's by hand and that all it allocated died inside it."""
    from transformers import masking_utils
    log = OpLog()
    check = PackedCheck(masking_utils.find_packed_sequence_indices, log)
    with monkeypatch.context() as m:
        m.setattr(memtrace, "unpacked_batch", lambda: transformers_own_check(check))
        events = list(memtrace.record(model, log, ids))
    ends = [i for i, e in enumerate(events) if e[:2] == ("exit", "?")]
    assert len(ends) == len(check.spans) > 0
    inside = [e for e in events if e[0] == "alloc" and e[3] == "?"]
    assert [e[2] for e in inside] == check_bytes(*ids.shape) * len(ends)
    handles = {e[1] for e in inside}
    for end in ends:
        born = {e[1] for e in events[:end] if e[0] == "alloc" and e[1] in handles}
        assert born <= {e[1] for e in events[:end] if e[0] == "free"}, "the check left a tensor alive"
    events = [e for e in events if not (e[0] in ("alloc", "free") and e[1] in handles) and e[:2] != ("exit", "?")]
    ops, last = [], 0
    for start, end in check.spans:
        assert log.ops[start:end] == CHECK_OPS
        ops += log.ops[last:start]
        last = end
    ops += log.ops[last:]
    return renumbered(events), ops, check


def renumbered(events):
    """Handles in order of birth (the check's births taken out)."""
    order, out = {}, []
    for e in events:
        if e[0] == "alloc":
            order[e[1]] = len(order) + 1
        out.append((e[0], order[e[1]]) + e[2:] if e[0] in ("alloc", "free") else e)
    return out


FAKE_ONLY = "prim.device.default"   # a fake tensor's device, asked of the fake mode; no computation
VIEWS = {"aten.slice.Tensor", "aten.select.int", "aten.view.default"}


def view_replays(ops):
    """The operators less autograd's replays of a view after an in-place write into it (view, write,
    the same view again). A fake tensor is a tensor subclass: autograd rebuilds the written view's
    history by calling the view function again, where for a plain tensor it dispatches nothing. No
    storage, no computation. (A real "view, write, same view" dropped here would make the sequences
    differ: the test would fail, not pass wrongly.)"""
    return [op for k, op in enumerate(ops)
            if not (k >= 2 and op in VIEWS and op == ops[k - 2] and ops[k - 1].split(".")[1].endswith("_"))]


def views_as_strided(fake_ops, real_ops):
    """Where the operator sequences differ, position by position: each must be the fake run's view
    function against the real run's `as_strided` (the backward of a write into a view, CopySlices, takes
    the gradient's view by the view function for a tensor subclass and by `as_strided` for a plain
    tensor; no storage either way). Their count."""
    assert len(fake_ops) == len(real_ops)
    differ = [(f, r) for f, r in zip(fake_ops, real_ops) if f != r]
    assert all(f in VIEWS and r == "aten.as_strided.default" for f, r in differ), differ
    return len(differ)


def _compare(model_type, monkeypatch, ids=None, model=None, prepare=None):
    d = tiny(model_type)
    fake, fake_ops = fake_run(d, prepare=prepare)
    if prepare:
        model = model or real_model(d)
        prepare(model)
    torch.manual_seed(1)
    ids = torch.randint(3, V, (B, S)) if ids is None else ids
    real, real_ops, check = real_run(model or real_model(d), ids, monkeypatch)
    assert check.answers and all(a is None for a in check.answers)     # transformers: not packed
    fake_ops = [op for op in fake_ops if op != FAKE_ONLY]
    if model_type in VIEW_REPLAYS:
        # DeepSeek-V2's attention writes k_nope and k_rot into two views of a new key tensor (two
        # copy_ a layer, two layers): four replays in forward, four CopySlices views in backward
        replays = view_replays(fake_ops)
        assert len(fake_ops) - len(replays) == 4 and views_as_strided(replays, real_ops) == 4
    else:
        assert fake_ops == real_ops
    assert fake == real
    return fake


def _kept(model_type, monkeypatch):
    """`memtrace.layer_activations` (the layers' kept bytes at 32 and 64 tokens, and the head's) on
    fake tensors and on the real model; the real forward's tokens are memtrace's zeros, so an MoE
    routes every token to the same experts."""
    d = tiny(model_type)
    fake = memtrace.layer_activations(*trace.build(trace.hf_config(d)))
    from transformers import masking_utils
    check = PackedCheck(masking_utils.find_packed_sequence_indices, OpLog())
    with monkeypatch.context() as m:
        m.setattr(memtrace, "unpacked_batch", lambda: transformers_own_check(check))
        real = memtrace.layer_activations(real_model(d), contextlib.nullcontext())
    assert check.answers and all(a is None for a in check.answers)
    assert fake == real
    assert fake["bytes_per_token"] > 0
    return fake


@pytest.mark.parametrize("model_type", FAST)
def test_the_fake_trace_is_what_a_real_step_does(model_type, monkeypatch):
    """Every operator dispatched, every storage's birth (bytes, module, operator, phase), death and
    their order, and each module's exit, through forward, loss and backward: the fake-tensor trace
    equals a real step on CPU tensors with random weights and tokens."""
    events = _compare(model_type, monkeypatch)
    births = [e for e in events if e[0] == "alloc"]
    assert {e[4] for e in births} == {"forward", "loss", "backward"}
    assert any(e[3].startswith("model.layers.1.") for e in births)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_the_fake_trace_is_what_a_real_step_does_for_every_family(model_type, monkeypatch):
    _compare(model_type, monkeypatch)


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral"])
def test_the_layers_kept_bytes_are_a_real_forwards(model_type, monkeypatch):
    _kept(model_type, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [k for k in CONFIGS if k not in ("qwen2", "mixtral")])
def test_the_layers_kept_bytes_are_a_real_forwards_for_every_family(model_type, monkeypatch):
    _kept(model_type, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [k for k in MOE if k != "mixtral"])
def test_an_moe_trace_does_not_depend_on_the_routing_for_every_family(model_type, monkeypatch):
    _compare(model_type, monkeypatch, torch.full((B, S), 5))


def test_an_moe_trace_does_not_depend_on_the_routing(monkeypatch):
    """Every token the same: the router sends all of them to the same two of the four experts (two
    experts get T·k = 64 token-expert pairs, two none), and the real step's stream still equals the
    fake one, as with random tokens: `grouped_mm` runs the T·k sorted pairs as one matrix, whatever
    the routing. Balanced or skewed, an MoE layer's tensors are the same."""
    d = tiny("mixtral")
    model = real_model(d)
    ids = torch.full((B, S), 5)
    _compare("mixtral", monkeypatch, ids, model)
    routed = []      # the first layer's choice of experts, read after the recorded step (kept, it would change it)
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    hook.remove()
    experts = routed[0].flatten().tolist()
    assert len(experts) == B * S * 2 and len(set(experts)) == 2


def test_the_per_expert_loop_cannot_be_traced():
    """transformers' `experts_implementation="eager"` loops over the experts that received tokens
    (`nonzero` of the routing): its tensors' sizes are the routing's, which fake tensors do not have.
    zerocalc traces the default, `grouped_mm`; the eager loop stops the trace."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
    cfg = trace.hf_config(tiny("mixtral"))
    model, mode = trace.build(cfg)
    assert model.config._experts_implementation == "grouped_mm"
    model.set_experts_implementation("eager")
    with mode:
        ids = torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(DynamicOutputShapeException):
        memtrace.record(model, mode, ids)


@pytest.mark.filterwarnings("ignore::FutureWarning")     # gradient_checkpointing_enable's new name
def test_with_activation_checkpointing_too(monkeypatch):
    """Checkpointed layers as the validator and HF Trainer set them (`use_reentrant=False`): the layers'
    inputs kept in forward, each layer recomputed in backward; the same on fake and real tensors."""
    def checkpointed(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    events = _compare("qwen2", monkeypatch, prepare=checkpointed)
    recomputed = [e for e in events if e[0] == "alloc" and e[4] == "backward" and e[3].startswith("model.layers.")]
    assert recomputed


def _from_the_first_layer(events, first):
    """What is alive when the first decoder layer starts (bytes, in birth order) and the events from
    there on, handles renamed: the live ones "kept 0, 1, ...", the later ones by birth."""
    start = next(i for i, e in enumerate(events) if e[0] == "alloc" and e[3].startswith(first))
    alive = {}
    for e in events[:start]:
        if e[0] == "alloc":
            alive[e[1]] = e[2]
        elif e[0] == "free":
            alive.pop(e[1], None)
    name = {h: f"kept {i}" for i, h in enumerate(alive)}
    out = []
    for e in events[start:]:
        if e[0] == "alloc":
            name[e[1]] = len(name) - len(alive)
        out.append((e[0], name[e[1]]) + e[2:] if e[0] in ("alloc", "free") else e)
    return list(alive.values()), out


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_an_all_ones_attention_mask_changes_nothing_the_layers_see(model_type, monkeypatch):
    """A tokenizer gives an unpadded batch an all-ones attention_mask; zerocalc traces without one.
    With the mask, transformers checks it (SDPA: then runs causal, as without) or combines it into the
    eager attention's mask (Gemma-2): temporaries, all dead before the first layer starts. From there
    on the real step with the mask equals the fake one without: the same tensors alive, the same events."""
    d = tiny(model_type)
    fake, _ = fake_run(d)
    model = real_model(d)
    torch.manual_seed(1)
    ids = torch.randint(3, V, (B, S))
    mask = torch.ones_like(ids)              # an input, like the tokens: not an event
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda **kw: forward(attention_mask=mask, **kw))
    monkeypatch.setattr(memtrace, "unpacked_batch", contextlib.nullcontext)    # transformers' own check
    real = list(memtrace.record(model, contextlib.nullcontext(), ids))
    assert real != fake                      # the mask's own tensors
    assert _from_the_first_layer(real, "model.layers.0.") == _from_the_first_layer(fake, "model.layers.0.")


class QuietCheck(PackedCheck):
    """transformers' own packed-sequence check, its operators out of the recorder's sight (what they
    allocate, all freed inside it, is asserted by `real_run`); its answers collected."""

    def forward(self, position_ids):
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            out = self.original(position_ids)
        self.answers.append(out)
        return out


def _steps(model_type, monkeypatch, variants=(False, True)):
    """`memtrace.record_step` (the allocation stream the allocator simulation plays: births, deaths,
    gradients handed to the optimizer, layer bounds, the CUDA-rule markers) on fake tensors and on the
    real model, without and with activation checkpointing; the real step's tokens are memtrace's zeros
    (an MoE routes every token to the same experts)."""
    from transformers import masking_utils
    d = tiny(model_type)
    for checkpointing in variants:
        model, mode = trace.build(trace.hf_config(d))
        fake = list(memtrace.record_step(model, mode, B, S, checkpointing))
        check = QuietCheck(masking_utils.find_packed_sequence_indices, OpLog())
        with monkeypatch.context() as m:
            m.setattr(memtrace, "unpacked_batch", lambda: transformers_own_check(check))
            real = list(memtrace.record_step(real_model(d), contextlib.nullcontext(), B, S, checkpointing))
        assert check.answers and all(a is None for a in check.answers)
        assert fake == real
        kinds = {e[0] for e in fake}
        assert {"a", "f", "g", "L", "Lend", "mm"} <= kinds


@pytest.mark.filterwarnings("ignore::FutureWarning")     # gradient_checkpointing_enable's new name
@pytest.mark.parametrize("model_type", FAST)
def test_the_step_stream_is_a_real_steps(model_type, monkeypatch):
    _steps(model_type, monkeypatch)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("model_type", SLOW)
def test_the_checkpointed_step_stream_is_a_real_steps_for_every_family(model_type, monkeypatch):
    """Checkpointed only: the plain step is `record`'s forward and backward, compared above."""
    _steps(model_type, monkeypatch, variants=(True,))
