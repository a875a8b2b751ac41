"""The 'what' input: a model known by its parameter count alone, or described by a profile (a
shipped one, a traced config.json, or a family's at any size: `zerocalc.profile`, `zerocalc.family`)."""
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from zerocalc import arch as _arch
from zerocalc import family
from zerocalc import profile as _profile
from zerocalc.profile import Profile


@dataclass(frozen=True)
class ModelSpec:
    name: str
    param_numels: tuple[int, ...]                # `module.parameters()` order
    trace: tuple[tuple[int, ...], ...]           # modules in forward-hook order, as indices into param_numels
    buffer_numels: tuple[int, ...] = ()
    architecture: _arch.Architecture | None = None
    backward_trace: tuple[tuple[int, ...], ...] | None = None              # None: forward's, reversed
    checkpointed_backward_trace: tuple[tuple[int, ...], ...] | None = None  # None: as without checkpointing
    checkpointed_recomputed: tuple[bool, ...] | None = None   # per step of checkpointed_backward_trace: a
                                                              # recomputation's forward call (None: none)
    profile: Profile | None = field(default=None, repr=False)   # the description it was made from (None:
                                                               # P alone): modules, allocation stream, step counts
    trainable: tuple[bool, ...] | None = None   # per parameter tensor, `requires_grad`; None: every one trains
                                                # (LoRA and frozen parameters: `zerocalc.adapters`)
    wide: tuple[bool, ...] | None = None        # per tensor: made in fp32 after the model (PEFT's adapters,
                                                # `autocast_adapter_dtype`): a model built under zero.Init
                                                # keeps them fp32 at stage 3 (`zerocalc.states`)
    leaf_scans: tuple | None = None   # where a module is a stage-3 leaf (an MoE block): per step of forward,
                                      # backward and checkpointed backward, what the reuse rule reads
                                      # (`arch.leaf_scans`); None: each step's trace entry
    buffer_bytes: tuple[tuple[int, int], ...] | None = None   # per buffer: bytes per element as built and
                                                # under zero.Init (0: the training dtype), from a traced
                                                # profile (`profile.buffer_element_bytes`); None: the rule
                                                # of `states.buffer_element_bytes`

    def backward(self, checkpointing: bool) -> tuple[tuple[int, ...], ...]:
        """Backward's modules in hook order (recomputed layers included when checkpointing)."""
        plain = self.backward_trace if self.backward_trace is not None else self.trace[::-1]
        return (self.checkpointed_backward_trace or plain) if checkpointing else plain

    def leaf_scan(self, checkpointing: bool) -> tuple | None:
        """Per step of forward then `backward(checkpointing)`: (own parameters, every parameter under
        it, whether it is a stage-3 leaf), what DeepSpeed's reuse rule reads (`stage3_trace`); None
        where no module is a leaf."""
        if self.leaf_scans is None:
            return None
        forward, plain, checkpointed = self.leaf_scans
        return forward + (checkpointed if checkpointing and self.checkpointed_backward_trace else plain)

    def recomputed(self, checkpointing: bool) -> tuple[bool, ...]:
        """Per step of `backward(checkpointing)`: whether it is a checkpointed layer's forward run again
        (its parameters fetched as forward's, inside backward)."""
        steps = len(self.backward(checkpointing))
        if checkpointing and self.checkpointed_backward_trace and self.checkpointed_recomputed:
            return self.checkpointed_recomputed
        return (False,) * steps

    def viewed_params(self, checkpointing: bool) -> frozenset[int]:
        """The parameters of which forward saves a view for backward (`profile.Module.views`: a fused
        experts module's 3-d weights), outside the layers checkpointing recomputes, whose forward saves
        nothing. At stage 3 the gathered copy of each outlives DeepSpeed's release until its backward
        (the H100 history of Qwen1.5-MoE-A2.7B at rank 0 of 8: every layer's experts held, 22 GiB;
        data/README.md)."""
        return self._viewed[bool(checkpointing)]

    def gradient_order(self, checkpointing: bool) -> tuple[int, ...]:
        """The trained tensors (indices into param_numels) in the order backward finishes their
        gradients: each at its last step of `backward(checkpointing)` that is not a recomputation (a
        tensor used twice, a tied embedding, at its first use in forward), within a step in `parameters()`
        order. The order of stage 3's reduce-scatters on every committed row (tests/test_comm_calls.py)."""
        return self._gradient_orders[bool(checkpointing)]

    # The model is frozen, so what is derived from it is computed once and kept on it (functools'
    # cached_property writes the instance's __dict__, which the frozen dataclass's fields, equality
    # and `replace` never see). `plan` asks for these hundreds of times per model.
    @cached_property
    def num_params(self) -> int:
        return sum(self.param_numels)

    @cached_property
    def _viewed(self) -> tuple[frozenset[int], frozenset[int]]:
        modules = self.profile.modules if self.profile is not None else ()
        layers = tuple(m.name + "." for m in modules if m.layer)
        plain = frozenset(i for m in modules if m.views for i in m.params)
        checkpointed = frozenset(i for m in modules if m.views and not m.name.startswith(layers) for i in m.params)
        return plain, checkpointed

    @cached_property
    def trainable_numels(self) -> tuple[int, ...]:
        """The trained tensors in `parameters()` order: what DeepSpeed hands its optimizer wrapper (the
        optimizer's param groups, `requires_grad` ones only: `_get_trainable_parameter_groups` in
        `runtime/zero/stage3.py`, the filter in `stage_1_and_2.py`), so what gets gradients, fp32 masters
        and moments, and what the gradient collectives carry."""
        if self.trainable is None:
            return self.param_numels
        return tuple(n for n, t in zip(self.param_numels, self.trainable) if t)

    @cached_property
    def _gradient_orders(self) -> dict[bool, tuple[int, ...]]:
        orders = {}
        for checkpointing in (False, True):
            done = {}
            steps = zip(self.backward(checkpointing), self.recomputed(checkpointing))
            for step, (module, recomputed) in enumerate(steps):
                if not recomputed:
                    for i in module:
                        done[i] = step
            orders[checkpointing] = tuple(sorted(filter(self._trains, done), key=lambda i: (done[i], i)))
        return orders

    def buckets_filled(self, checkpointing: bool, bucket_elements: int) -> int:
        """How many buckets the trained tensors fill in `gradient_order(checkpointing)`: each tensor added
        to the bucket, which is emptied first where the tensor would take it past `bucket_elements` (a
        tensor larger than that fills one alone). Kept per model (`comm.bucket_calls`; `plan` asks for
        it hundreds of times)."""
        key = (bool(checkpointing), bucket_elements)
        if key not in self._buckets_filled:
            calls, filled = 0, 0
            for i in self.gradient_order(checkpointing):
                numel = self.param_numels[i]
                if filled and filled + numel > bucket_elements:
                    calls, filled = calls + 1, 0
                filled += numel
            self._buckets_filled[key] = calls + (1 if filled else 0)
        return self._buckets_filled[key]

    @cached_property
    def _buckets_filled(self) -> dict[tuple[bool, int], int]:
        return {}

    @cached_property
    def trained_indices(self) -> tuple[int, ...]:
        """The indices of the trained tensors (`trainable_numels`' tensors) among all."""
        return tuple(i for i in range(len(self.param_numels)) if self._trains(i))

    @cached_property
    def stage3_leaves(self) -> tuple[tuple[int, ...], ...]:
        """The parameters under each stage-3 leaf module (an MoE block, `set_z3_leaf_modules`), in
        `parameters()` order: DeepSpeed reduces their gradients together, at the leaf's backward hook."""
        if self.leaf_scans is None:
            return ()
        return tuple(dict.fromkeys(under for _, under, leaf in self.leaf_scans[0] if leaf))

    @cached_property
    def num_trainable(self) -> int:
        return sum(self.trainable_numels)

    @property
    def num_frozen(self) -> int:
        return self.num_params - self.num_trainable

    @property
    def frozen(self) -> bool:
        """Whether some parameter does not train."""
        return self.trainable is not None and not all(self.trainable)

    def _trains(self, i: int) -> bool:
        return self.trainable is None or self.trainable[i]

    def wide_numels(self) -> tuple[int, ...]:
        """Each tensor's elements where it is `wide`, else 0."""
        if self.wide is None:
            return (0,) * len(self.param_numels)
        return tuple(n if w else 0 for n, w in zip(self.param_numels, self.wide))

    @cached_property
    def largest_trainable_numel(self) -> int:
        return max(self.trainable_numels)

    @cached_property
    def head_trainable_numel(self) -> int:
        """The trained part of `head_numel`: the first gradient backward makes (0 when the head is frozen)."""
        return sum(self.param_numels[i] for i in self.trace[-1] if self._trains(i))

    @cached_property
    def largest_module_trainable_numel(self) -> int:
        return max(sum(self.param_numels[i] for i in m if self._trains(i)) for m in self.trace)

    @cached_property
    def head_numel(self) -> int:
        """Parameters of the last module in forward, whose gradient backward makes first."""
        return sum(self.param_numels[i] for i in self.trace[-1])

    @cached_property
    def layer_numel(self) -> int:
        """Parameters of one transformer layer (the first): what activation checkpointing runs again."""
        p = self.profile
        return sum(p.param_numels[i] for i in p.subtree_params(next(i for i, m in enumerate(p.modules) if m.layer)))

    @cached_property
    def largest_param_numel(self) -> int:
        return max(self.param_numels)

    @cached_property
    def largest_module_numel(self) -> int:
        return max(sum(self.param_numels[i] for i in m) for m in self.trace)

    @cached_property
    def _fields_hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))

    def __hash__(self) -> int:
        """The fields' hash, as the dataclass's own, computed once: the model keys the stage-3 walk's and
        the partition's caches, and rehashing its tensor lists on every lookup cost more than the lookup."""
        return self._fields_hash


def from_params(num_params: int) -> ModelSpec:
    if num_params < 1:
        raise ValueError(f"params must be a positive number of parameters, got {num_params}")
    params = _arch.uniform_params(int(num_params))
    return ModelSpec("P-only model", params, ((),) + tuple((i,) for i in range(len(params))))


def from_profile(p: Profile, name: str | None = None, z3_leaf_moe: bool = True, wrapper: bool = True) -> ModelSpec:
    """The ModelSpec of a profile: its tensors, buffers and hook traces (`profile.traces`: wrapper,
    z3_leaf_moe), holding the profile, or where the profile is one of the validator's families at its
    sizes, that family's measured stream and activations in its place (`family.described`)."""
    p = family.described(p)
    kept = _profile.kept_buffers(p)
    forward, backward, checkpointed, recomputed, scans = _profile.traces(p, z3_leaf_moe, wrapper)
    return ModelSpec(name or p.name, p.param_numels, forward, tuple(b.numel for b in kept), _profile.architecture(p),
                     backward, checkpointed, recomputed, profile=p, leaf_scans=scans,
                     buffer_bytes=tuple(_profile.buffer_element_bytes(b) for b in kept))


def from_architecture(a: _arch.Architecture, name: str | None = None) -> ModelSpec:
    """The validator's family model of these sizes (`zerocalc.family`), trained as the validator trains it."""
    return from_profile(family.profile(a, name or a.family), name or a.family)


def shaped(num_params: int) -> ModelSpec:
    """A model of exactly `num_params` that has a shape (activations, step time): `family.generic`'s
    Llama, whose token embedding also takes the fewer than 3·L·h elements it falls short by. States
    and communication are then those of exactly P, as `from_params` gives them, up to per-tensor
    padding; an embedding is read by index, so the extra elements cost no FLOPs."""
    spec = from_architecture(family.generic(int(num_params)), "P-only model")
    embed, *rest = spec.param_numels
    return replace(spec, param_numels=(embed + int(num_params) - spec.num_params, *rest))
