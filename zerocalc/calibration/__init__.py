"""Calibrated constants: the few numbers the closed form cannot know, fitted on measured GPU runs by
`python -m validate fit` and shipped as JSON (`h200.json` by default).

A calibration file given by path is checked against the shipped one before use: it must be a JSON
object holding each section the model reads, every value of the shipped file's kind (a finite
number where a number is read); a `time` section fitted before a constant existed takes that constant
from the shipped file. `zerocalc calibrate` writes such files from a user's own rows."""
import math
import os

from zerocalc.inputs import InputError, load_json_object

_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "h200"
# The sections `estimate`, `timing` and `activations` read.
REQUIRED = ("activations", "allocator", "device", "time")
# Time constants a calibration may hold that the shipped one does not, and the shares among them (at most 1).
OPTIONAL_TIME = ("host_launch_s", "inter_node_link_efficiency")
OPTIONAL_SHARES = ("inter_node_link_efficiency",)
_cache = {}


def path(name: str) -> str:
    return name if name.endswith(".json") else os.path.join(_DIR, f"{name}.json")


def _check(value, shipped, where: str, source: str) -> None:
    """`value` of the same kind as the shipped `shipped` at `where` (recursively; keys the shipped
    file lacks are not read and pass)."""
    if isinstance(shipped, dict):
        if not isinstance(value, dict):
            raise InputError(f"calibration {source}: {where} must be an object {{...}}, got {type(value).__name__}")
        for k, v in value.items():
            if k in shipped:
                _check(v, shipped[k], f"{where}.{k}", source)
    elif isinstance(shipped, (int, float)) and not isinstance(shipped, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"calibration {source}: {where} = {value!r}: must be a finite number")
    elif isinstance(shipped, str) and not isinstance(value, str):
        raise InputError(f"calibration {source}: {where} = {value!r}: must be a string")
    elif isinstance(shipped, list) and not isinstance(value, list):
        raise InputError(f"calibration {source}: {where} must be a list, got {type(value).__name__}")


def load(name: str = DEFAULT) -> dict:
    """The calibration `name` (shipped) or at a path ending in .json. Raises ValueError naming the
    file and the key for a file the model cannot use."""
    p = path(name)
    if p not in _cache:
        if p != path(DEFAULT) and not name.endswith(".json") and not os.path.exists(p):
            shipped = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))
            raise InputError(f"no shipped calibration {name!r} (shipped: {', '.join(shipped)}); "
                             "give a .json file written by `python -m validate fit`")
        cal = load_json_object(p, "calibration")
        if p != path(DEFAULT):
            ref = default()
            for section in REQUIRED:
                if section not in cal:
                    raise InputError(f"calibration {name}: no \"{section}\" section (a file written by "
                                     "`python -m validate fit` has one)")
            _check(cal, ref, "calibration", name)
            for key in OPTIONAL_TIME:
                value = cal["time"].get(key)
                if key in cal["time"] and (isinstance(value, bool) or not isinstance(value, (int, float))
                                           or not math.isfinite(value)
                                           or not 0 < value <= (1 if key in OPTIONAL_SHARES else math.inf)):
                    raise InputError(f"calibration {name}: time.{key} = {value!r}: must be a number above 0"
                                     + (" and at most 1" if key in OPTIONAL_SHARES else ""))
            # A file fitted before a time constant existed (e.g. the offload host rates) takes that
            # constant from the shipped calibration.
            cal["time"] = {**ref["time"], **cal["time"]}
            missing = [f for f in ref["activations"] if f not in cal["activations"]]
            if missing:
                cal["activations"] = {**ref["activations"], **cal["activations"]}
        _cache[p] = cal
    return _cache[p]


def default() -> dict:
    return load(DEFAULT)
