"""Check zerocalc on your own job: a probe that measures one optimizer step of a running DeepSpeed job
the way the validator measures its own, asks zerocalc about the same job, prints both on rank 0 and
appends a row `python -m validate report` reads (docs/your-cluster.md).

- a DeepSpeed engine loop: `probe = zerocalc.probe.attach(engine, step=3, out="rows.csv")` after
  `deepspeed.initialize` on every rank (`probe.close()` after the loop for a job shorter than step + 1);
- Hugging Face Trainer: `Trainer(..., callbacks=[zerocalc.probe.ZeroCalcCallback(step=3, out="rows.csv")])`.

Importing it imports neither torch nor DeepSpeed; they are imported when a probe is attached."""
from zerocalc.probe.hook import Probe, attach, enabled  # noqa: F401


def __getattr__(name):
    """`ZeroCalcCallback` is made on first use: it subclasses transformers' TrainerCallback."""
    if name == "ZeroCalcCallback":
        from zerocalc.probe.trainer import callback_class
        return callback_class()
    raise AttributeError(f"module 'zerocalc.probe' has no attribute {name!r}")
