"""Frozen parameters and LoRA in the generated allocation sequence (`zerocalc.sequence`): DeepSpeed's
side with only the trained tensors flattened, hooked and stepped, worked out by hand on tiny models;
when a frozen model's sequence is generated; and the model's side recorded from PEFT's own model
(`zerocalc.hf.adapted`), counted by hand. The H200 rows it answers: tests/test_lora_rows.py."""
import pytest

from zerocalc import adapters, profile, sequence
from zerocalc.hf.adapted import shallow_mask
from zerocalc.model import ModelSpec
from zerocalc.training import OPTIMIZERS, Setup, Stage

from test_sequence import alive_bytes


def setup(stage, dp=1, **kw):
    return Setup(stage=Stage(stage), dp=dp, optimizer=OPTIMIZERS["adamw"], dtype="bf16", seq_len=16, micro_batch=2,
                 attention="sdpa", **kw)


def test_stage_2_flattens_hooks_and_steps_the_trained_tensors_only():
    # Four tensors of 100, 60, 40, 20 elements; the first and third frozen. The flat group is the
    # trained 60 + 20 = 80 (padded to 2N = 4: 80), a rank's slice S = 40; bf16, N = 2, rank 0.
    model = ModelSpec("four", (100, 60, 40, 20), ((0,), (1,), (2,), (3,)), trainable=(False, True, False, True))
    t = sequence._Trace()
    params = [t.alloc(2 * n) for n in model.param_numels]                 # handles 1-4: the module, bf16
    ds = sequence._Stage(t, model, setup(2, dp=2, reduce_bucket_size=1000))
    ds.init(params)
    assert t.events[4:] == [
        ("alloc", 5, 2 * 80, 0),            # the flat group of the trained tensors, kept
        ("free", 2), ("free", 4),           # the trained module tensors become views of it; 1 and 3 stay
        ("alloc", 6, 2 * 40, 0), ("alloc", 7, 4 * 40, 0), ("free", 6),    # the slice cloned, its fp32 master
        ("alloc", 8, 4 * 40, 0), ("free", 8)]                             # initialize_optimizer_states
    n = len(t.events)
    ds.grad_ready(3, 20)     # backward hands the trained gradients only, the last tensor's first
    ds.grad_ready(1, 60)
    ds.end_backward()
    assert t.events[n:] == [
        ("alloc", 9, 2 * 20, 0), ("alloc", 10, 2 * 1000, 0), ("free", 9),   # its gradient, the ipg bucket, copied in
        ("alloc", 11, 2 * 60, 0), ("free", 11),
        ("alloc", 12, 2 * 80, 0), ("free", 12),   # the bucket's 80 elements span both slices: flattened
        ("alloc", 13, 2 * 60, 0),                 # rank 0's partition gradients: the 60-element tensor whole
        ("free", 10)]                             # the bucket released
    n = len(t.events)
    ds.step()
    assert t.events[n:] == [
        ("alloc", 14, 8 * 40, 0), ("free", 14),   # the norm's fp64 copy of the 40 elements in rank 0's slice
        ("alloc", 15, 2 * 40, 0), ("alloc", 16, 4 * 40, 0), ("free", 15), ("free", 13),   # flatten, fp32 cast
        ("alloc", 17, 4 * 40, 0), ("alloc", 18, 4 * 40, 0), ("free", 16)]                # Adam's moments
    # left: the frozen tensors whole (2·100 + 2·40), the flat group, the fp32 master and the two moments
    assert alive_bytes(t.events) == 2 * 100 + 2 * 40 + 2 * 80 + 4 * 40 + 2 * 4 * 40


def test_stage_3_under_zero_init_converts_the_adapters_in_fp32_and_keeps_the_frozen_partitions():
    # A frozen 64-element weight built under zero.Init and two 8-element adapters made after it in fp32
    # (PEFT's, `ModelSpec.wide`); N = 2, bf16, tensors of at most 10 elements persistent (the adapters).
    model = ModelSpec("adapted", (64, 8, 8), ((0, 1, 2),), trainable=(False, True, True), wide=(False, True, True))
    s = setup(3, dp=2, zero_init=True, param_persistence_threshold=10, reduce_bucket_size=1000)
    t = sequence._Trace()
    params = sequence._zero_init_build(t, model, s)
    assert t.events == [("alloc", 1, 2 * 64, 0), ("alloc", 2, 2 * 32, 0), ("free", 1)]   # whole, its half, freed
    assert params == [2, None, None]
    sequence._Stage3(t, model, s).init(params)
    assert t.events[3:] == [
        ("alloc", 3, 4 * 8, 0), ("alloc", 4, 4 * 4, 0), ("free", 3),   # each adapter moved whole, partitioned
        ("alloc", 5, 4 * 8, 0), ("alloc", 6, 4 * 4, 0), ("free", 5),
        ("free", 4), ("free", 6),                # the trained partitions defragmented: freed, the cache
        ("empty_cache",), ("alloc", 7, 4 * 8, 0),   # emptied, one fp32 flat buffer of them
        ("alloc", 8, 4 * 8, 0),                  # its fp32 master: a clone (`.to(fp32)` of fp32 is itself)
        ("alloc", 9, 4 * 8, 0), ("free", 9),     # initialize_optimizer_states' zero buffer
        ("alloc", 10, 2 * 1000, 0),              # the ipg bucket
        ("alloc", 11, 2 * 8, 0),                 # the flat gradient partitions of the trained 2 · 4 elements
        ("alloc", 12, 4 * 8, 0), ("alloc", 13, 4 * 8, 0)]   # the persistent adapters gathered whole, kept
    # the frozen weight keeps its own bf16 partition (handle 2): nothing of it is defragmented
    assert alive_bytes(t.events) == 2 * 32 + 4 * 8 + 4 * 8 + 2 * 1000 + 2 * 8 + 2 * 4 * 8


def test_a_frozen_model_is_generated_only_with_its_own_stream_in_the_variant_it_runs():
    spec = adapters.spec(profile.shipped_profile("llama-3.2-1b"), adapters.Lora(rank=16))
    assert not sequence.generated(spec, setup(2))      # the full model's stream hands frozen gradients
    trained = len(spec.trained_indices)
    own = {"attention": "sdpa", "params": len(spec.param_numels), "trained": trained, "plain": {},
           "checkpointed_zero3": {}}
    adapted = adapters.with_stream(spec, own)
    assert sequence.generated(adapted, setup(2))
    assert not sequence.generated(adapted, setup(2, activation_checkpointing=True))   # no such variant
    assert sequence.generated(adapted, setup(3, activation_checkpointing=True, zero_init=True))
    assert not sequence.generated(adapted, setup(3, activation_checkpointing=True))   # bf16 adapters at stage 3
    assert not sequence.generated(adapted, setup(2, offload_optimizer="cpu"))
    assert not sequence.generated(adapters.with_stream(spec, {**own, "trained": trained - 1}), setup(2))


def test_a_shallow_copy_takes_the_mask_of_the_layers_it_plays():
    # 2 tensors before the layers, 6 layers of 3, 1 after; a 4-layer copy plays layers 0, 1, 4, 5 as its
    # 0-3 (`sequence.played_as`) and the middle layers 2, 3 as its layer 1.
    layer = (False, True, True)
    full = (False, True) + layer * 6 + (False,)
    copy = shallow_mask(full, [[2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13]], 15, 6)
    assert copy == (False, True) + layer * 4 + (False,)
    other = (False, True) + layer * 2 + (False, False, True) + layer * 3 + (False,)   # layer 2 differs from 1
    with pytest.raises(ValueError, match="layer 2 trains other tensors"):
        shallow_mask(other, [[2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13]], 15, 6)


def test_a_shallow_copy_of_layers_of_two_kinds_takes_the_mask_of_each_kind():
    # 1 tensor before the layers, 10 layers alternating a kind of 3 tensors (A) and one of 2 (B): a
    # pattern of period 2; a 6-layer copy (A B A B A B) plays layers 0, 1 as its 0, 1, the middle layers
    # 2-7 as its 2 (A) and 3 (B) by their place in the pattern, 8 and 9 as its 4 and 5
    # (`sequence.played_as`); the copy's parameters: 1 + 3 + 2 + 3 + 2 + 3 + 2 = 16, one after them.
    a, b = (True, False, True), (False, True)
    full = (False,) + (a + b) * 5 + (True,)
    runs = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12, 13], [14, 15]]
    assert shallow_mask(full, runs, 17, 10, 0, 2) == (False,) + (a + b) * 3 + (True,)
    other = (False,) + (a + b) * 3 + (a + (True, True)) + (a + b) + (True,)   # layer 7 (a B) trains more
    with pytest.raises(ValueError, match="layer 7 trains other tensors"):
        shallow_mask(other, runs, 17, 10, 0, 2)


# ---------------------------------------------------------------- PEFT's model on fake tensors

TINY = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}      # head_dim 16: k and v 2 · 16 = 32 wide


def _tiny(lora):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from zerocalc.hf import adapted, trace
    p = trace.trace(TINY, "tiny", activations=False, steps=False)
    spec = adapters.spec(p, lora)
    return spec, adapted.stream(TINY, lora, spec.trainable, ["plain"], "sdpa")


def _layer_allocations(stream, seg="F1") -> list[tuple]:
    """Layer 1's forward allocations, as coefficients of (1, s, B·s, ...) bytes."""
    events = stream["plain"][seg]
    while isinstance(events, str):
        variant, name = events.split(".")
        events = stream[variant][name]
    return [tuple(stream["sizes"][e]) for e in events if isinstance(e, int) and e >= 0]


def test_the_lora_stream_hands_the_adapters_gradients_and_keeps_x_at_a():
    spec, stream = _tiny(adapters.Lora(rank=4, targets=("q_proj", "v_proj")))
    assert (stream["params"], stream["trained"]) == (len(spec.param_numels), 8)   # A and B of q, v in 2 layers
    # lora_A's output: r = 4 bf16 elements a token, 8 B, for q and for v; nothing else of that size
    assert _layer_allocations(stream).count((0, 0, 8)) == 2
    # backward hands over the gradients of the trained tensors only: a layer's four adapters
    backward = stream["plain"]["B1"]
    grads = [e for e in backward if isinstance(e, list) and e[0] == "g"]
    first = stream["first_layer_param"]
    local = [int(g[1].split(":")[1]) for g in grads]
    assert len(grads) == 4 and all(spec.trainable[first + stream["params_per_layer"] + i] for i in local)


def test_dropout_adds_its_output_and_a_bool_mask_per_target():
    _, plain = _tiny(adapters.Lora(rank=4, targets=("q_proj", "v_proj")))
    _, dropped = _tiny(adapters.Lora(rank=4, targets=("q_proj", "v_proj"), dropout=0.1))
    without, with_ = _layer_allocations(plain), _layer_allocations(dropped)
    # q and v each drop their own copy of the 64-wide input: a bf16 output (128 B a token) and CUDA's
    # bool mask (64 B a token), `cudaops`
    assert len(with_) - len(without) == 4
    assert with_.count((0, 0, 128)) - without.count((0, 0, 128)) == 2
    assert with_.count((0, 0, 64)) - without.count((0, 0, 64)) == 2


def test_a_frozen_head_and_embedding_cut_backward_at_the_last_layers_output():
    """Freezing the tied embedding freezes the head: no head gradient marks where the last layer's
    backward begins; the gradient of its output does (`memtrace.record_step`'s "Lb")."""
    pytest.importorskip("torch")
    from zerocalc.hf import adapted, trace
    p = trace.trace({**TINY, "tie_word_embeddings": True}, "tiny", activations=False, steps=False)
    spec = adapters.spec(p, None, ("embed_tokens",))
    stream = adapted.stream({**TINY, "tie_word_embeddings": True}, None, spec.trainable, ["plain"], "sdpa")
    assert stream["trained"] == len(spec.param_numels) - 1
    assert [s for s in stream["plain"] if s.startswith("B")] == ["B1", "B0"]
    assert sequence.events(adapters.with_stream(spec, stream), setup(2)) is not None
