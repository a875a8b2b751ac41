"""Activations kept for backward, from the architecture and batch shape. Filled in by the peak-memory
work; None when the architecture or sequence length is unknown."""
from dataclasses import dataclass

from zerocalc.model import ModelSpec
from zerocalc.training import Setup


@dataclass(frozen=True)
class Activations:
    forward_peak_bytes: int
    backward_peak_bytes: int


NONE = Activations(0, 0)


def breakdown(model: ModelSpec, setup: Setup) -> Activations | None:
    if model.architecture is None or setup.seq_len is None:
        return None
    return None
