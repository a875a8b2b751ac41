"""The stage-3 coordinator's per-step gathers, waits and releases (`stage3_trace.fetches`), from which
the allocation sequence makes the all-gather stream's tensors."""
from dataclasses import replace

from zerocalc import stage3_trace
from zerocalc.arch import Architecture
from zerocalc.model import from_architecture
from zerocalc.training import OPTIMIZERS, Setup, Stage

TINY = Architecture("hf-llama", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=128, tie_embeddings=False)


def setup(**kw):
    # no parameter is persistent (TINY's tensors are all below the default threshold of 1e5)
    return Setup(stage=Stage.PARAMETERS, dp=2, optimizer=OPTIMIZERS["adamw"], dtype="bf16", seq_len=16,
                 micro_batch=2, param_persistence_threshold=0, **kw)


def test_the_first_iteration_gathers_each_module_as_it_runs_and_releases_it_after():
    model = from_architecture(TINY)
    trace = list(model.trace) + list(model.backward(False))
    steps = stage3_trace.fetches(model, setup(), record=True)
    assert len(steps) == len(trace)
    for mod, actions in zip(trace, steps):
        params = tuple(sorted(set(mod)))
        expected = [("gather", params)] + [("wait", p) for p in dict.fromkeys(mod)] + [("release", p) for p in params]
        assert list(actions) == (expected if params else [])


def test_later_iterations_wait_once_for_each_gathered_parameter_before_releasing_it():
    model = from_architecture(TINY)
    for kw in ({}, {"prefetch_bucket_size": 0}, {"prefetch_bucket_size": 10_000}, {"max_reuse_distance": 0}):
        gathered, waited = set(), set()
        for actions in stage3_trace.fetches(model, setup(**kw), record=False):
            for kind, what in actions:
                if kind == "gather":
                    assert not gathered & set(what)         # never gathered twice while held
                    gathered |= set(what)
                elif kind == "wait":
                    assert what in gathered and what not in waited
                    waited.add(what)
                else:
                    assert what in waited                   # a module ran on it before its release
                    gathered.discard(what)
                    waited.discard(what)
        assert gathered == waited                           # what backward kept is released at its end


def test_prefetching_the_whole_model_gathers_it_once_and_releases_nothing_until_backward_ends():
    # a prefetch bucket larger than the model: the first step's prefetch fetches every parameter in
    # one call (the module docstring's 2Ψ, not 3Ψ) and the reuse rule keeps them through backward
    model = from_architecture(TINY)
    steps = stage3_trace.fetches(model, setup(prefetch_bucket_size=10**9), record=False)
    gathers = [what for actions in steps for kind, what in actions if kind == "gather"]
    assert gathers == [tuple(range(len(model.param_numels)))]


def test_a_recomputation_releases_the_frozen_weights_it_fetched():
    # One checkpointed layer of a frozen base (tensors 1 and 2, 20 and 30 elements) and a trained
    # adapter (tensor 0, 10 elements), called base, base2, adapter in forward. Backward's hooks: the
    # adapter's (the first module with parameters walking backward), the layer's forward again
    # (recomputed), then base2's and base's. No prefetch, a reuse distance larger than the model, nothing
    # persistent: the reuse rule alone keeps everything gathered from forward to backward.
    from zerocalc.model import ModelSpec
    model = ModelSpec("layer", (10, 20, 30), ((1,), (2,), (0,)),
                      checkpointed_backward_trace=((0,), (1,), (2,), (0,), (2,), (1,)),
                      checkpointed_recomputed=(False, True, True, True, False, False),
                      trainable=(True, False, False))
    s = setup(prefetch_bucket_size=0, activation_checkpointing=True)
    gathers = [[what for kind, what in actions if kind == "gather"] for actions in stage3_trace.fetches(model, s, False)]
    # forward gathers each tensor at its module; then the adapter's backward module, which started the
    # recomputation, is released once it ends and frees the frozen tensors the recomputation fetched
    # (DeepSpeed's ds_recompute_parameters), so base2's and base's backward hooks gather them again
    assert gathers == [[(1,)], [(2,)], [(0,)], [], [], [], [], [(2,)], [(1,)]]
    # at N = 2: forward 5 + 10 + 15 = 30 shard elements, backward 15 + 10 = 25
    it = stage3_trace.simulate(model, s)
    assert (it.forward_gather_elements, it.backward_gather_elements) == (30, 25)
    # every tensor trained: a recomputation frees nothing, backward gathers nothing
    trained = stage3_trace.simulate(replace(model, trainable=None), s)
    assert trained.backward_gather_elements == 0
