"""The stage-3 coordinator's per-step gathers, waits and releases (`stage3_trace.fetches`), from which
the allocation sequence makes the all-gather stream's tensors."""
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
