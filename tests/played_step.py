"""One micro-step's model side as a fake-tensor recording gives it and as `sequence._TracedStep` plays it,
in the same terms (every allocation's bytes, every free, the gradients handed to the optimizer), for the
tests that compare the two (test_stream, test_family_stream)."""
from zerocalc import sequence


def recorded(raw: list) -> tuple[list, list]:
    """(allocations and frees in order, sorted (handle, parameter) of the gradients) of a
    `memtrace.record_step` recording."""
    events = [("a", e[2]) if e[0] == "a" else ("f", e[1]) for e in raw if e[0] in ("a", "f")]
    return events, sorted((e[2], e[1]) for e in raw if e[0] == "g")


def played(spec, setup, stream: dict | None = None) -> tuple[list, list]:
    """The same of one forward and backward played by `_TracedStep`, the CUDA rules (staging buffers,
    workspaces and the like: operations s, d, w, t) left out, as a CPU recording has none of them."""
    t, grads = sequence._Trace(), []

    class DS:
        def grad_ready(self, p, numel, h):
            grads.append((h, p))
    step = sequence._TracedStep(t, spec, setup, DS(), [1, 2], stream)
    original = sequence._compiled
    sequence._compiled = lambda *a: [e for e in original(*a) if e[0] not in "sdwt"]
    try:
        step.forward()
        step.backward()
    finally:
        sequence._compiled = original
    return [("a", e[2]) if e[0] == "alloc" else ("f", e[1]) for e in t.events], sorted(grads)
