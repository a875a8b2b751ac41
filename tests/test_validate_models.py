"""zerocalc's tensor lists equal what torch registers, tensor by tensor, for every family."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from validate.models import build_model  # noqa: E402
from zerocalc import arch as A  # noqa: E402

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
