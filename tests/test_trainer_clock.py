"""validate.hf_trainer.TrainerClock: what each call the Trainer makes costs per step, a call made inside
another timed call counted once (its caller's), off between steps."""
import pytest

pytest.importorskip("torch")
from validate.hf_trainer import TrainerClock  # noqa: E402


class Engine:
    def __init__(self):
        self.calls = []

    def step(self):
        self.calls.append("step")
        self.zero_grad()          # as DeepSpeedEngine.step does

    def zero_grad(self):
        self.calls.append("zero_grad")


def test_nested_calls_count_once_and_steps_are_kept_apart():
    clock, engine = TrainerClock(cuda=False), Engine()
    clock.wrap(engine, "step", "step")
    clock.wrap(engine, "zero_grad", "zero_grad")
    engine.step()                                  # before any step: not timed, still runs
    clock.start(sync=True)
    engine.step()
    engine.zero_grad()
    clock.add("between", 0.5)
    clock.start(sync=False)
    engine.step()
    clock.stop()
    engine.zero_grad()                             # after stop: not timed
    assert engine.calls == ["step", "zero_grad"] * 2 + ["zero_grad", "step", "zero_grad", "zero_grad"]
    assert len(clock.phased) == 1 and len(clock.timed) == 1
    # the phased step: one step call (its zero_grad inside it, not again) and one zero_grad of its own
    assert set(clock.phased[0]) == {"step", "zero_grad", "between"} and clock.phased[0]["between"] == 0.5
    assert set(clock.timed[0]) == {"step"}
    by = TrainerClock.by_label(clock.phased + clock.timed)
    assert by["between"] == [0.5, None]            # the last step has no time after it
    assert by["zero_grad"][1] == 0.0 and by["step"][1] >= 0.0
