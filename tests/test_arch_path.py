"""The user's path and arch.py's hand transcriptions: one model description for every answer.

Each command runs in a fresh interpreter under a profiler (`tests/arch_path.py`) that records every
zerocalc/arch.py function called. The goal: no user command runs a hand-written tensor list, call
tree, preset table or config reader (`arch_path.HAND`); the model comes from a shipped profile, a
trace, a family's traced profile at its sizes (`zerocalc.family`) or P alone.
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
# the paths that ran a hand list until the families were traced (a fresh interpreter each: slow)
MOVED = [
    "estimate --params 7e9 --dp 8 --seq-len 4096",                                   # P's shape: family.generic
    "plan --params 7e9 --gpu h100 --max-gpus 8 --seq-len 4096 --global-batch 64",
    "estimate --model seed-gpt --dp 2 --seq-len 1024",                               # profiles/seed-gpt.json
    "estimate --model gpt2 --dp 2 --seq-len 1024",
    "estimate --model llama-2-7b --dp 8 --seq-len 4096 --gpu h100",
    "estimate --model llama-2-7b --hidden-size 2048 --dp 2 --seq-len 512",           # the family at new sizes
    "estimate --model llama-3.1-8b --dp 8 --seq-len 4096",
    "estimate --model qwen2-0.5b --dp 8 --seq-len 4096",
    f"estimate --hf-config {CONFIGS}/llama-3.1-8b.json --dp 8 --seq-len 4096",
    f"estimate --hf-config {CONFIGS}/gpt2.json --dp 8 --seq-len 1024",
    "estimate --vocab-size 32000 --hidden-size 1024 --num-layers 4 --num-heads 8 --dp 2 --seq-len 512",
    "plan --model llama-2-7b --gpu h100 --max-gpus 8 --seq-len 4096 --global-batch 64",
    "sweep --model llama-2-7b --dp 1,8 --stage 0,1,2,3",
    "sweep --model seed-gpt --dp 1,8 --stage 0,1,2,3",
    "models",
]


def _hand(command: str) -> list[str]:
    r = arch_path.ran(command.split())
    assert r["exit"] == 0, command
    return sorted(set(r["ran"]) & arch_path.HAND)


@pytest.mark.parametrize("command", CLEAN + [pytest.param(c, marks=pytest.mark.slow) for c in MOVED])
def test_path_runs_no_hand_transcription(command):
    assert _hand(command) == []


def test_the_profiler_sees_a_hand_list():
    """The recorder itself: a call of arch.py's GPT-2 tensor list is seen (else every test above would
    pass vacuously)."""
    ran = arch_path.ran(["--python", "from zerocalc import arch; arch.param_numels(arch.PRESETS['gpt2'])"])["ran"]
    assert "_gpt2_layer" in ran and "param_numels" in ran
