"""validate.worker with a fault: on rank 1 the model's forward raises, after the engine is built (its
parameters broadcast), so rank 0 goes on into the step's gradient all-reduce and blocks there, waiting
for rank 1. For the fault test of a rank that raises in a real 2-rank gloo launch."""
import os
import sys

import torch

from validate import worker


def _raising(build):
    def build_model(*args, **kwargs):
        model = build(*args, **kwargs)
        if os.environ.get("RANK") == "1":
            def forward(*a, **k):
                raise RuntimeError("injected fault in rank 1's forward")
            model.forward = forward
        return model
    return build_model


if __name__ == "__main__":
    worker.build_model = _raising(worker.build_model)
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    try:
        worker.main(args[0], args[1])
    except Exception:
        import traceback
        worker.lifeline.record_crash(args[1], int(os.environ.get("RANK", 0)), traceback.format_exc())
        raise
