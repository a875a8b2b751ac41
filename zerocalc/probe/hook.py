"""The probe on a DeepSpeed engine: `attach(engine, step=3, out=...)` wraps the engine's forward,
backward and step (instance attributes shadowing the methods) and counts optimizer steps by the
engine's own `global_steps`. Optimizer step `step` is measured as the validator's worker measures its
comm-logged step: a synchronize at each phase boundary (peaks and times per phase), the comms
logger on, the resident state and the module's calls recorded, the host's resident set read at its
end; step `step + 1` is timed whole, synchronized at both ends only. Then every rank hands its
measurement to rank 0 (one all_gather_object), which asks zerocalc, prints the table and appends the
row (`zerocalc.probe.row`), and the engine gets its own methods back. Before `step` a wrapper costs a
Python call and a comparison; off (step None, ZEROCALC_PROBE=0) nothing is wrapped. Any failure is
one line on stderr and the job goes on; every rank still reaches the one gather."""
import json
import os
import sys
import time

from zerocalc.probe import measure

WRAPPED = ("forward", "backward", "step")


def enabled(step) -> bool:
    """Whether a probe asked for at `step` runs: not for step None, nor with ZEROCALC_PROBE=0."""
    off = os.environ.get("ZEROCALC_PROBE", "1").strip().lower() in ("0", "off", "false", "no")
    return step is not None and not off


def attach(engine, step: int | None = 3, out: str | None = None, **setup):
    """Measure optimizer steps `step` and `step + 1` of this engine's job and compare them with zerocalc
    (the module docstring). `out`: a results CSV the row is appended to (`python -m validate report`
    reads it); `setup`: Setup fields zerocalc cannot read from the job (activation_checkpointing of a
    model of your own, zero_init, ...). Call it on every rank, after `deepspeed.initialize`. Returns the
    Probe (`probe.close()` after the loop reports a job that ended before step + 1), or None when off."""
    if not enabled(step):
        return None
    return Probe(engine, int(step), out, setup=setup)


class Probe:
    """One probe on one engine; `path` is "loop" (the user's own loop drives the steps through the
    wrapped calls) or "trainer" (`ZeroCalcCallback` drives them from the Trainer's step events)."""

    def __init__(self, engine, step: int, out: str | None = None, path: str = "loop", setup: dict | None = None):
        self.engine, self.step, self.out, self.path = engine, max(1, step), out, path
        self.overrides = dict(setup or {})
        self.open_index, self.reached, self.failed, self.done = None, None, None, False
        self.local = {}                 # this rank's measurement
        self._saved_logger = self.spec_recorder = None
        self._own = {}
        self._guard(self._install, "attaching")

    # ---- the engine's calls -------------------------------------------------------------------
    def _install(self):
        for name in WRAPPED:
            inner = getattr(self.engine, name)
            self._own[name] = (vars(self.engine).get(name), self._wrapper(name, inner))
            setattr(self.engine, name, self._own[name][1])

    def _wrapper(self, name, inner):
        def call(*args, **kwargs):
            if self.done:
                return inner(*args, **kwargs)
            steps = self.engine.global_steps
            self._guard(self._before, name, name, args, kwargs)
            out = inner(*args, **kwargs)
            self._guard(self._after, name, name, steps)
            return out
        call.__wrapped__ = inner
        return call

    def _uninstall(self):
        for name, (previous, ours) in self._own.items():
            if vars(self.engine).get(name) is not ours:
                continue          # wrapped again by someone else: ours stays, passing calls through
            if previous is None:
                delattr(self.engine, name)
            else:
                setattr(self.engine, name, previous)
        self._own = {}

    def _before(self, name, args, kwargs):
        if name == "forward" and self.path == "loop" and self.open_index is None:
            self._begin_step()
        if self.open_index == self.step and not self.failed:
            if name == "forward" and "batch" not in self.local:
                self.local["batch"] = _batch_shape(args, kwargs)
            self.recorder.mark()

    def _after(self, name, before):
        if self.open_index == self.step and not self.failed:
            self.recorder.phase(name)
        if name == "step" and self.path == "loop" and self.engine.global_steps != before:
            self._end_step()

    # ---- steps ----------------------------------------------------------------------------------
    def begin_step(self):
        """An optimizer step begins (the loop's first forward of it, or Trainer's on_step_begin)."""
        self._guard(self._begin_step, "counting steps")

    def end_step(self):
        """An optimizer step ended (the loop's step at a gradient-accumulation boundary, or Trainer's
        on_step_end). After the timed step every rank reports (`finish`)."""
        self._guard(self._end_step, "counting steps")

    def _begin_step(self):
        if self.done:
            return
        self.open_index = self.engine.global_steps + 1
        if self.reached is None:        # attached after `step`: the first step seen is measured
            self.step = max(self.step, self.open_index)
        self.reached = self.open_index
        if self.failed:
            return
        if self.open_index == self.step:
            self._guard(self._start_measured, "starting its measurement")
        elif self.open_index == self.step + 1:
            measure.synchronize(self.cuda)
            self._t0 = time.perf_counter()

    def _end_step(self):
        index, self.open_index = self.open_index, None
        if self.done or index is None:
            return
        if index == self.step:
            self._guard(self._end_measured, "reading what the step held and sent")
        elif index == self.step + 1:
            if not self.failed:
                measure.synchronize(self.cuda)
                self.local["step_s"] = time.perf_counter() - self._t0
            self.finish()

    @property
    def cuda(self) -> bool:
        return self.engine.device.type == "cuda" if hasattr(self.engine, "device") else False

    def _start_measured(self):
        from deepspeed.comm.comm import comms_logger

        from zerocalc.probe.record import SpecRecorder
        cuda = self.cuda
        if cuda:   # the job's peaks before this step: init and the steps before it
            import torch
            self.local["before"] = {"peak_allocated": torch.cuda.max_memory_allocated(),
                                    "peak_reserved": torch.cuda.max_memory_reserved()}
        self.recorder = measure.MemoryRecorder(cuda)
        self.recorder.start()
        self.spec_recorder = SpecRecorder(self.engine.module)
        measure.tolerate_unknown_comm_ops()
        self._saved_logger = {k: getattr(comms_logger, k) for k in ("enabled", "prof_all", "debug", "verbose")}
        self._saved_logger["comms_dict"] = comms_logger.comms_dict
        comms_logger.comms_dict = {}
        comms_logger.enabled, comms_logger.prof_all, comms_logger.debug, comms_logger.verbose = True, True, True, False

    def _cleanup(self):
        """The comms logger as it was, the module's recording hooks gone."""
        if self.spec_recorder is not None:
            self.spec_recorder.remove()
        self._restore_logger()

    def _restore_logger(self):
        if self._saved_logger is None:
            return
        from deepspeed.comm.comm import comms_logger
        saved, self._saved_logger = self._saved_logger, None
        comms_logger.comms_dict = saved.pop("comms_dict")
        for k, v in saved.items():
            setattr(comms_logger, k, v)

    def _end_measured(self):
        from deepspeed.comm.comm import comms_logger
        summary = comms_logger.log_all(print_log=False, return_dict=True)
        self._cleanup()
        params = list(self.engine.module.parameters())
        self.local.update(comm=measure.comm_summary(summary), state=measure.resident_state(self.engine),
                          record=self.spec_recorder.spec(), memory=self.recorder.summary(),
                          host={**measure.status_bytes("VmHWM", "VmRSS"),
                                **measure.meminfo_bytes("MemAvailable", "MemTotal")},
                          param_tensors=len(params), sharded_param_tensors=sum(hasattr(p, "ds_tensor") for p in params),
                          hostname=os.uname().nodename, device=str(self.engine.device))
        if self.local.get("before") and self.local["memory"]:
            self.local["memory"]["before"] = self.local.pop("before")

    # ---- the end --------------------------------------------------------------------------------
    def close(self):
        """After the loop: report a job that stopped after the measured step but before the timed one;
        one that never reached the measured step says so. Call it on every rank (it gathers)."""
        if self.done:
            return
        if self.reached is None or self.reached < self.step:   # the same on every rank: no gather
            self._guard(self._cleanup, "detaching")
            self._warn(f"the job ended before optimizer step {self.step}: nothing measured", only_rank0=True)
            self._detach()
            return
        self.finish()

    def finish(self):
        """Every rank's measurement to rank 0 (one all_gather_object of a JSON string, reached by every
        rank whatever failed before), then rank 0 reports; the engine gets its methods back."""
        self.done = True
        self._guard(self._cleanup, "detaching")
        payload = json.dumps({"error": self.failed} if self.failed else self.local, default=str)
        ranks = self._gather(payload)
        if ranks is not None and _rank() == 0:
            self._guard(self._report, "comparing with zerocalc", ranks)
        self._detach()

    def _gather(self, payload: str):
        try:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return [json.loads(payload)]
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, payload)
            return [json.loads(p) for p in out]
        except Exception as err:  # noqa: BLE001  -- the probe never stops the job
            self._warn(f"gathering the ranks' measurements failed ({type(err).__name__}: {err})")
            return None

    def _report(self, ranks):
        from zerocalc.probe import row
        bad = [(i, r["error"]) for i, r in enumerate(ranks) if r.get("error")]
        if bad:
            raise RuntimeError(f"rank {bad[0][0]} failed: {bad[0][1]}; no row written")
        text, written = row.report(self, ranks)
        print(text, flush=True)
        if written:
            print(f"zerocalc.probe: row appended to {written} (python -m validate report {written})", flush=True)

    def _detach(self):
        self.done = True
        self._guard(self._uninstall, "detaching")

    # ---- failures -------------------------------------------------------------------------------
    def _guard(self, fn, what, *args):
        """fn(*args); a failure is one line on stderr, the probe stops measuring on this rank (it still
        takes part in the gather) and the job goes on."""
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001  -- the probe never stops the job
            if self.failed is None:
                self.failed = f"{what}: {type(err).__name__}: {err}"[:500]
                self._warn(f"{self.failed}; training goes on without the probe")
            try:
                self._cleanup()
            except Exception:  # noqa: BLE001
                pass
            return None

    @staticmethod
    def _warn(text: str, only_rank0: bool = False):
        rank = _rank()
        if not only_rank0 or rank == 0:
            print(f"zerocalc.probe (rank {rank}): {text}".replace("\n", " "), file=sys.stderr, flush=True)


def _rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return int(os.environ.get("RANK", 0))


def _batch_shape(args, kwargs):
    """(micro-batch, sequence length) of a forward's inputs: input_ids, else the first 2-D tensor."""
    import torch
    candidates = [kwargs.get("input_ids")] + list(args) + list(kwargs.values())
    for x in candidates:
        if isinstance(x, dict):
            x = x.get("input_ids", next((v for v in x.values() if isinstance(v, torch.Tensor)), None))
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return [int(x.shape[0]), int(x.shape[1])]
    return None
