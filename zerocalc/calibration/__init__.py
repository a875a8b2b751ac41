"""Calibrated constants: the few numbers the closed form cannot know, fitted on measured GPU runs by
`python -m validate fit` and shipped as JSON (`h200.json` by default)."""
import json
import os

_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "h200"
_cache = {}


def path(name: str) -> str:
    return name if name.endswith(".json") else os.path.join(_DIR, f"{name}.json")


def load(name: str = DEFAULT) -> dict:
    p = path(name)
    if p not in _cache:
        try:
            with open(p) as f:
                cal = json.load(f)
        except OSError as err:
            raise ValueError(f"cannot read calibration {name!r}: {err.strerror}")
        except json.JSONDecodeError as err:
            raise ValueError(f"calibration {name!r} is not valid JSON: {err.msg}")
        if p != path(DEFAULT) and isinstance(cal.get("time"), dict):
            # A file fitted before a time constant existed (e.g. the offload host rates) takes that
            # constant from the shipped calibration.
            cal["time"] = {**default()["time"], **cal["time"]}
        _cache[p] = cal
    return _cache[p]


def default() -> dict:
    return load(DEFAULT)
