"""The probe in a Hugging Face Trainer job: `ZeroCalcCallback(step=3, out="rows.csv")` in the Trainer's
callbacks. At `on_train_begin` it finds the DeepSpeed engine Trainer built around its model and
attaches a probe (`zerocalc.probe.hook.Probe`, path "trainer"); optimizer steps are Trainer's, from
`on_step_begin` to `on_step_end` (so a timed step includes its loop: clipping, scheduler, zero_grad),
the phases the engine's forward, backward and step within them; `on_train_end` reports a job that
stopped after the measured step. transformers is imported when the class is first asked for."""
from functools import lru_cache

from zerocalc.probe.hook import Probe, enabled


def find_engine(model):
    """The DeepSpeed engine whose module is `model` (Trainer hands callbacks its model, not the
    engine): found among the live objects, once, at the start of training."""
    import gc
    import warnings

    from deepspeed.runtime.engine import DeepSpeedEngine
    with warnings.catch_warnings():    # isinstance on some live objects warns (torch's deprecated aliases)
        warnings.simplefilter("ignore")
        engines = [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine) and o.module is model]
    if not engines:
        raise ValueError("no DeepSpeed engine trains the Trainer's model (is the Trainer given a ds_config?)")
    return engines[-1]


@lru_cache(maxsize=None)
def callback_class():
    from transformers import TrainerCallback

    class ZeroCalcCallback(TrainerCallback):
        """Measure optimizer steps `step` and `step + 1` of a Trainer job run by DeepSpeed and compare them
        with zerocalc (`zerocalc.probe.attach`); `out`: a results CSV for the row; `setup`: Setup fields
        zerocalc cannot read from the job. Off for step None or with ZEROCALC_PROBE=0."""

        def __init__(self, step: int | None = 3, out: str | None = None, **setup):
            self.step, self.out, self.setup, self.probe = step, out, setup, None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if not enabled(self.step):
                return
            try:
                engine = find_engine(model)
            except Exception as err:  # noqa: BLE001  -- the probe never stops the job
                Probe._warn(f"not attached: {type(err).__name__}: {err}")
                return
            self.probe = Probe(engine, int(self.step), self.out, path="trainer", setup=self.setup)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.probe is not None:
                self.probe.begin_step()

        def on_step_end(self, args, state, control, **kwargs):
            if self.probe is not None:
                self.probe.end_step()
                if self.probe.done:
                    self.probe = None

        def on_train_end(self, args, state, control, **kwargs):
            if self.probe is not None:
                self.probe.close()
                self.probe = None

    return ZeroCalcCallback
