"""The oracle: a family model's ModelSpec from zerocalc/arch.py's hand-written tensor lists and call
trees (what `zerocalc.model.from_architecture` built before the families were traced into
`zerocalc/family_profiles.json`), for the tests that hold the traced description to it."""
from zerocalc import arch as A
from zerocalc.model import ModelSpec


def hand_spec(a: A.Architecture, name: str | None = None) -> ModelSpec:
    A.validate_architecture(a)
    return ModelSpec(name or a.family, A.param_numels(a), A.trace(a), A.buffer_numels(a), a,
                     A.backward_trace(a), A.backward_trace(a, checkpointing=True), A.recomputed(a))


def same_model(spec: ModelSpec, want: ModelSpec) -> bool:
    """Equal tensors, buffers, dimensions and stage-3 traces (forward, backward, checkpointed backward
    and which of its steps are recomputations)."""
    fields = ("param_numels", "buffer_numels", "architecture", "trace", "backward_trace", "checkpointed_backward_trace",
              "checkpointed_recomputed")
    return all(getattr(spec, f) == getattr(want, f) for f in fields)
