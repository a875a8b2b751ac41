"""The one place that decides units: memory in GiB (2**30), bandwidth and traffic in GB (1e9),
counts with decimal prefixes (7e9 is "7B").

Parsing is exact (decimal, not float): '1e400' is a number too large, not an OverflowError, and a
count never passes through a float that rounds it."""
import re
from decimal import Decimal, InvalidOperation

GiB = 2**30
GB = 10**9

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE = re.compile(rf"^\s*{_NUMBER}\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_FACTORS = {"B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
            "T": 10**12, "TB": 10**12, "P": 10**15, "PB": 10**15, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
            "TIB": 2**40, "PIB": 2**50, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
# No count or size zerocalc takes comes near 10**30; refusing larger exponents up front keeps
# Decimal('1e999999999') from being expanded into an integer of a billion digits.
_MAX_EXPONENT = 30


def _decimal(digits: str, text: str, what: str) -> Decimal:
    try:
        value = Decimal(digits)
    except InvalidOperation:   # the regexes admit only plain decimals; kept for safety
        raise ValueError(f"cannot read {text!r} as {what}")
    if value and value.adjusted() > _MAX_EXPONENT:
        raise ValueError(f"{text!r} is far too large for {what}")
    return value


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '32GB' -> 32e9, '40e9B' -> 40000000000. Raises ValueError.

    A bare number is bytes only from 1 MiB up: below that it is ambiguous ('80' may mean 80 GB or
    80 GiB, '81920' MiB as nvidia-smi prints it) and is refused with the units to choose from."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 32GB or 40e9B")
    value = _decimal(m.group(1), text, "a memory size") * _FACTORS[(m.group(2) or "B").upper()]
    if not m.group(2) and value < 2**20:
        raise ValueError(f"{text!r} has no unit: write {m.group(1)}GiB (2^30 bytes) or {m.group(1)}GB (1e9 bytes) "
                         f"(a bare number is bytes only from 1 MiB up)")
    if value < 1:
        raise ValueError(f"memory size must be at least one byte, got {text!r}")
    return int(value)


_COUNT = re.compile(rf"^\s*{_NUMBER}\s*([KMBT])?\s*$", re.IGNORECASE)


def parse_count(text: str, what: str = "a parameter count") -> int:
    """'7e9' -> 7000000000, '7B' -> 7000000000, '350M' -> 350000000 (rounded to a whole number).
    Raises ValueError naming `what`."""
    m = _COUNT.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as {what}; write e.g. 7e9, 7B or 350M")
    factor = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}[(m.group(2) or "").upper()]
    value = _decimal(m.group(1), text, what) * factor
    if value < 1:
        raise ValueError(f"{what} must be positive (at least 1), got {text!r}")
    return int(value.to_integral_value())


def gib(nbytes: float) -> float:
    return nbytes / GiB


def gb(nbytes: float) -> float:
    return nbytes / GB
