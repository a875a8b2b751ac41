"""The one place that decides units: memory in GiB (2**30), bandwidth and traffic in GB (1e9),
counts with decimal prefixes (7e9 is "7B")."""
import re

GiB = 2**30
GB = 10**9

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
            "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '32GB' -> 32e9, '1.5e9' -> 1500000000. Raises ValueError."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 32GB or 40e9")
    value = float(m.group(1)) * _FACTORS[(m.group(2) or "").upper()]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBT])?\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """'7e9' -> 7000000000, '7B' -> 7000000000, '350M' -> 350000000. Raises ValueError."""
    m = _COUNT.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a parameter count; write e.g. 7e9, 7B or 350M")
    value = float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[(m.group(2) or "").upper()]
    if value < 1:
        raise ValueError(f"the parameter count must be positive, got {text!r}")
    return int(round(value))


def gib(nbytes: float) -> float:
    return nbytes / GiB


def gb(nbytes: float) -> float:
    return nbytes / GB
