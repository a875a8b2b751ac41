"""The user's path and arch.py's hand transcriptions: one model description for every answer.

Each command runs in a fresh interpreter under a profiler (`tests/arch_path.py`) that records every
zerocalc/arch.py function called. The goal: no user command runs a hand-written tensor list, call
tree, preset table or config reader (`arch_path.HAND`); the model comes from a shipped profile, a
trace or P alone. Where a path still runs them the case is a strict xfail naming the function that
feeds it, so the day a path is moved it XPASSes and must be flipped here.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arch_path  # noqa: E402

CONFIGS = "tests/data/hub-configs"
CLEAN = [
    "estimate --params 7e9 --dp 8",
    "estimate --params 7e9 --dp 8 --gpu h100",
    "sweep --params 1e9,7e9 --dp 1,8 --stage 0,1,2,3",
]
# command -> what still runs a hand list on its path (the work left: docs/architecture.md, "How a question flows")
STILL = {
    "estimate --params 7e9 --dp 8 --seq-len 4096": "cli._shaped -> model.shaped -> arch.generic (a Llama shape for P)",
    "plan --params 7e9 --gpu h100 --max-gpus 8 --seq-len 4096 --global-batch 64": "model.shaped -> arch.generic",
    "estimate --model seed-gpt --dp 2 --seq-len 1024": "resolve.preset_spec -> arch.PRESETS (no shipped profile)",
    "estimate --model gpt2 --dp 2 --seq-len 1024": "resolve.preset_spec -> arch.PRESETS before profiles/gpt2.json",
    "estimate --model llama-2-7b --dp 8 --seq-len 4096 --gpu h100": "resolve.preset_spec -> arch.PRESETS",
    "estimate --model llama-2-7b --hidden-size 2048 --dp 2 --seq-len 512": "arch.preset_derived",
    "estimate --model llama-3.1-8b --dp 8 --seq-len 4096": "profile.to_model_spec's `transcribed` check",
    "estimate --model qwen2-0.5b --dp 8 --seq-len 4096": "profile.to_model_spec's `transcribed` check",
    f"estimate --hf-config {CONFIGS}/llama-3.1-8b.json --dp 8 --seq-len 4096": "profile.to_model_spec's check",
    f"estimate --hf-config {CONFIGS}/gpt2.json --dp 8 --seq-len 1024": "configmatch -> preset gpt2 -> arch.PRESETS",
    "estimate --vocab-size 32000 --hidden-size 1024 --num-layers 4 --num-heads 8 --dp 2 --seq-len 512":
        "cli._model -> arch.Architecture + model.from_architecture (the shape flags)",
    "plan --model llama-2-7b --gpu h100 --max-gpus 8 --seq-len 4096 --global-batch 64": "arch.PRESETS",
    "models": "resolve.listing counts the presets with arch.num_params",
}


def _hand(command: str) -> list[str]:
    r = arch_path.ran(command.split())
    assert r["exit"] == 0, command
    return sorted(set(r["ran"]) & arch_path.HAND)


@pytest.mark.parametrize("command", CLEAN)
def test_path_runs_no_hand_transcription(command):
    assert _hand(command) == []


@pytest.mark.slow
@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=why))
                                     for c, why in STILL.items()])
def test_path_left_to_move(command):
    assert _hand(command) == []


def test_the_profiler_sees_a_hand_list():
    """The recorder itself: a preset's estimate does run the GPT-2 layer list today (else every test
    above would pass vacuously)."""
    assert "_gpt2_layer" in arch_path.ran("estimate --model gpt2 --dp 2 --seq-len 1024".split())["ran"]
