"""The 'what' input: a model known by its parameter count or by its architecture."""
from dataclasses import dataclass

from zerocalc import arch as _arch


@dataclass(frozen=True)
class ModelSpec:
    name: str
    param_numels: tuple[int, ...]                # `module.parameters()` order
    module_numels: tuple[tuple[int, ...], ...]   # leaf modules in forward order (the ZeRO-3 trace)
    buffer_numels: tuple[int, ...] = ()
    architecture: _arch.Architecture | None = None

    @property
    def num_params(self) -> int:
        return sum(self.param_numels)


def from_params(num_params: int) -> ModelSpec:
    if num_params < 1:
        raise ValueError(f"params must be a positive number of parameters, got {num_params}")
    modules = _arch.uniform_modules(int(num_params))
    return ModelSpec(f"{num_params:.3g} params", tuple(n for m in modules for n in m), modules)


def from_architecture(a: _arch.Architecture, name: str | None = None) -> ModelSpec:
    _arch.validate_architecture(a)
    return ModelSpec(name or a.family, _arch.param_numels(a), _arch.module_numels(a), _arch.buffer_numels(a), a)
