"""zerocalc's tensor lists equal what torch registers, tensor by tensor, for every family."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from zerocalc.hf.families import build_model  # noqa: E402
from zerocalc import arch as A  # noqa: E402

pytestmark = pytest.mark.slow   # builds the models with torch and transformers (the quick loop: -m 'not slow')

CASES = [
    A.Architecture("seed-gpt", 1001, 33, 2, 3, 3, 101, False),
    A.Architecture("seed-gpt", 1001, 32, 2, 4, 4, 128, True),
    A.Architecture("hf-gpt2", 1001, 36, 2, 4, 4, 144, True, 64),
    A.Architecture("hf-gpt2", 1001, 36, 2, 4, 4, 144, False, 64),
    A.Architecture("hf-llama", 1001, 32, 2, 4, 2, 88, False, 64),
    A.Architecture("hf-llama", 1001, 32, 2, 4, 4, 88, True, 64),
]


@pytest.mark.parametrize("arch", CASES, ids=lambda a: f"{a.family}-tie{a.tie_embeddings}")
def test_param_numels_match_torch(arch):
    model = build_model(arch.as_dict(), attention="eager")
    assert tuple(p.numel() for p in model.parameters()) == A.param_numels(arch)
    assert tuple(b.numel() for b in model.buffers()) == A.buffer_numels(arch)


@pytest.mark.parametrize("arch", CASES, ids=lambda a: f"{a.family}-tie{a.tie_embeddings}")
def test_trace_covers_every_parameter(arch):
    used = {i for m in A.trace(arch) for i in m}
    assert used == set(range(len(A.param_numels(arch))))


def test_presets_have_their_published_sizes():
    assert A.num_params(A.PRESETS["llama-2-7b"]) == 6_738_415_616
    assert A.num_params(A.PRESETS["llama-2-13b"]) == 13_015_864_320
    assert A.num_params(A.PRESETS["llama-3-8b"]) == 8_030_261_248
    assert A.num_params(A.PRESETS["mistral-7b"]) == 7_241_732_096
    assert A.num_params(A.PRESETS["gpt2"]) == 124_439_808


@pytest.mark.parametrize("family", ["seed-gpt", "hf-llama"])
def test_recomputation_stops_before_each_layers_down_projection(family):
    """What zerocalc.timing counts for checkpointing, measured on torch (CPU): non-reentrant
    checkpointing (the validator's, zerocalc/hf/families.py) rebuilds each layer's matmuls but the last,
    the MLP's down projection (early stop), and not the head. Matmul FLOPs of backward with
    checkpointing less without = the recomputation, worked by hand from the layer's matrices; and a
    forward's FLOPs leave out the embedding, which is read by index (`timing.lookup_params`)."""
    from torch.utils.flop_counter import FlopCounterMode
    from zerocalc import timing
    from zerocalc.model import from_architecture
    from zerocalc.training import Setup, Stage
    h, f, kv_heads, layers, batch, seq = 256, 688, 2, 2, 2, 32
    a = A.Architecture(family, 1001, h, layers, 4, 4 if family == "seed-gpt" else kv_heads, f, False, 64)
    kv = a.num_kv_heads * a.head_dim
    # the matrices recomputed per layer: seed-gpt in_proj (3h²), out_proj (h²), fc1 (h·f), not fc2;
    # Llama q, o (h²), k, v (kv·h), gate, up (f·h), not down
    rebuilt = 4 * h * h + h * f if family == "seed-gpt" else 2 * h * h + 2 * kv * h + 2 * f * h
    tokens = batch * seq
    by_hand = 2 * layers * rebuilt * tokens + 4 * layers * h * seq * tokens   # + scores and values (eager)
    # forward: every layer matrix, the scores and values, and the head (1001·h); the embedding is a lookup
    forward = 2 * layers * (rebuilt + h * f) * tokens + 4 * layers * h * seq * tokens + 2 * 1001 * h * tokens
    flops = {}
    for ck in (False, True):
        torch.manual_seed(0)
        model = build_model(a.as_dict(), checkpointing=ck, attention="eager").train()
        with FlopCounterMode(display=False) as counter:
            loss = model(torch.randint(0, 1001, (batch, seq))).float().sum()
        flops["forward"] = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[ck] = counter.get_total_flops()
    assert flops["forward"] == forward
    assert flops[True] - flops[False] == by_hand
    # zerocalc also counts the layers' vectors (biases, norms) as 2 FLOPs per element per token: within 1%
    fwd, bwd = timing.flops_per_micro_step(from_architecture(a), Setup(stage=Stage.DISABLED, dp=1, micro_batch=batch,
                                                                       seq_len=seq, activation_checkpointing=True))
    assert fwd == pytest.approx(forward, rel=0.01)
    assert bwd - 2 * fwd == pytest.approx(by_hand, rel=0.01)


# Operators that only make a view or read metadata: no kernel, and not counted (zerocalc.hf.optrace.VIEW_OPS)
VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
            "aten.detach.default", "aten.expand.default", "aten.split.Tensor", "aten.slice.Tensor",
            "aten.unsqueeze.default", "aten.reshape.default", "aten.permute.default", "aten.select.int",
            "aten.squeeze.dim", "aten.as_strided.default", "aten.alias.default", "aten.split_with_sizes.default",
            "aten.unbind.int", "aten.empty.memory_format", "aten.lift_fresh.default", "aten._reshape_alias.default"}


@pytest.mark.parametrize("family,attention", [("seed-gpt", "eager"), ("hf-llama", "sdpa"), ("hf-llama", "eager"),
                                              ("hf-gpt2", "sdpa"), ("hf-gpt2", "eager")])
def test_dispatched_operators_per_layer_are_what_torch_dispatches(family, attention):
    """The host-side operator counts of the time model (traced on fake tensors into family_steps.json,
    `zerocalc.hf.optrace`), counted again on real tensors: the operators a forward and a backward (from
    the logits) dispatch with one layer and with two; the difference is a layer's, the rest is outside
    the layers. Checkpointed backward includes the recomputation."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from zerocalc.timing import family_steps

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += str(func) not in VIEW_OPS
            return func(*args, **(kwargs or {}))

    def count(layers, checkpointing):
        a = A.Architecture(family, 128, 64, layers, 4, 4 if family == "seed-gpt" else 2, 160, False, 64)
        model = build_model(a.as_dict(), checkpointing=checkpointing, attention=attention).train().to(torch.bfloat16)
        forward, backward, tokens = Count(), Count(), torch.randint(0, 128, (2, 16))
        with forward:
            logits = model(tokens)
        grad = torch.ones_like(logits)
        with backward:
            logits.backward(grad)
        return forward.n, backward.n

    (f1, b1), (f2, b2) = count(1, False), count(2, False)
    c1, c2 = count(1, True)[1], count(2, True)[1]
    traced = family_steps()[f"{family}/{attention}"]
    f, b, ck = (traced[p]["ops"] for p in ("forward", "backward", "backward_checkpointed"))
    assert (f2 - f1, b2 - b1, c2 - c1, 2 * f1 - f2, 2 * b1 - b2) == (f[1], b[1], ck[1], f[0] - f[1], b[0] - b[1])
    assert 2 * c1 - c2 == 2 * b1 - b2          # checkpointing changes nothing outside the layers
