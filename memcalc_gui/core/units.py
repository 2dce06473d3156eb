"""Parsing and formatting of sizes and counts.

Sizes are integer bytes everywhere; units exist only at the edges. GiB/MiB are binary (2**30, 2**20)
and always labelled so; GB/MB are decimal.
"""

from __future__ import annotations

import math
import re

from .errors import InputError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SIZE_RE = re.compile(rf"^\s*({_NUMBER})\s*([a-zA-Z]*)\s*$")
#: Largest size or count accepted anywhere (1 EiB; 10^18 parameters): far beyond any device or model, and
#: small enough that every byte count stays an exact integer well inside float range.
MAX_SIZE_BYTES = 2**60
MAX_COUNT = 10**18
#: Longest text a number field is read from (a pasted megabyte is not a number).
MAX_NUMBER_CHARS = 64


def _bounded(field: str, value: float, limit: int, what: str) -> int:
    if not math.isfinite(value) or value > limit:
        raise InputError(field, f"must be at most {what}")
    return round(value)


def _text(text: object, field: str) -> str:
    s = str(text)
    if len(s) > MAX_NUMBER_CHARS:
        raise InputError(field, f"is {len(s):,} characters long; expected a number")
    return s


def _finite_positive(field: str, value: float, *, allow_zero: bool = False) -> float:
    if math.isnan(value) or math.isinf(value):
        raise InputError(field, f"must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(field, f"must be {'non-negative' if allow_zero else 'positive'}, got {value:g}")
    return value


def parse_size(text: str | float | int, field: str = "size", *, allow_zero: bool = False) -> int:
    """Parse ``80GiB``, ``80GB``, ``24e9``, ``512 MiB`` into integer bytes."""
    if isinstance(text, bool):
        raise InputError(field, "must be a size such as 80GiB, 80GB or 24e9")
    if isinstance(text, (int, float)):
        if isinstance(text, int) and text > MAX_SIZE_BYTES:
            raise InputError(field, "must be at most 1 EiB (2^60 bytes)")
        return _bounded(field, _finite_positive(field, float(text), allow_zero=allow_zero), MAX_SIZE_BYTES,
                        "1 EiB (2^60 bytes)")
    m = _SIZE_RE.match(_text(text, field))
    if not m:
        raise InputError(field, f"cannot read {text!r} as a size (try 80GiB, 80GB or 24e9)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _SIZE_UNITS:
        raise InputError(field, f"unknown unit {m.group(2)!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = _finite_positive(field, float(number), allow_zero=allow_zero) * _SIZE_UNITS[unit]
    return _bounded(field, value, MAX_SIZE_BYTES, "1 EiB (2^60 bytes)")


def parse_count(text: str | float | int, field: str = "params") -> int:
    """Parse a parameter count: ``1.5B``, ``1.5e9``, ``350M``, ``7b``, ``124000000``."""
    if isinstance(text, bool):
        raise InputError(field, "must be a count such as 1.5B, 350M or 1.5e9")
    if isinstance(text, (int, float)):
        if isinstance(text, int) and text > MAX_COUNT:
            raise InputError(field, "must be at most 10^18")
        value = _finite_positive(field, float(text))
    else:
        m = _SIZE_RE.match(_text(text, field))
        suffix = m.group(2).lower() if m else ""
        if not m or suffix not in _COUNT_SUFFIXES:
            raise InputError(field, f"cannot read {text!r} as a count (try 1.5B, 350M or 1.5e9)")
        value = _finite_positive(field, float(m.group(1))) * _COUNT_SUFFIXES[suffix]
    count = _bounded(field, value, MAX_COUNT, "10^18")
    if count < 1:
        raise InputError(field, f"must be at least 1, got {text!r}")
    return count


#: Token counts people write with a binary suffix: 4k = 4,096, 128K = 131,072, 1M = 1,048,576.
_TOKEN_SUFFIXES = {"k": 2**10, "m": 2**20}


def parse_positive_int(text: str | int | float, field: str, limit: int | None = None, *,
                       tokens: bool = False) -> int:
    """Parse a strictly positive integer (batch, sequence length, accumulation steps), at most ``limit``.

    ``tokens``: also accept ``4k``/``128K``/``1M`` as 4,096/131,072/1,048,576 (how context lengths are named).
    """
    if isinstance(text, bool):
        raise InputError(field, "must be a positive integer")
    if isinstance(text, int):
        value = text
    else:
        raw = _text(text, field).strip()
        factor = 1
        if tokens and raw[-1:].lower() in _TOKEN_SUFFIXES:
            factor, raw = _TOKEN_SUFFIXES[raw[-1:].lower()], raw[:-1].strip()
        try:
            f = float(raw) * factor
        except ValueError:
            raise InputError(field, f"must be a positive integer, got {text!r}") from None
        if math.isnan(f) or math.isinf(f) or f != int(f):
            raise InputError(field, f"must be a positive integer, got {text!r}")
        value = int(f)
    if value < 1:
        raise InputError(field, f"must be a positive integer, got {text!r}")
    if limit is not None and value > limit:
        raise InputError(field, f"must be at most {limit:,}, got {str(text).strip()}")
    return value


def gib(nbytes: int | float) -> float:
    """Bytes → binary gibibytes (2**30)."""
    return nbytes / 2**30


#: Binary units, largest first (a hostile ledger can reach past EiB: sizes are not bounded, inputs are).
BINARY_UNITS: tuple[tuple[str, int], ...] = (
    ("YiB", 2**80), ("ZiB", 2**70), ("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30),
    ("MiB", 2**20), ("KiB", 2**10),
)
_UNIT_FACTORS = dict(BINARY_UNITS)


def format_bytes(nbytes: int | float, *, digits: int = 2, unit: str | None = None) -> str:
    """Human-readable binary size: ``1.50 GiB``, ``512.00 MiB``, ``4.00 KiB``, ``12 B``; ``unit`` fixes the unit
    (a screen of sizes shares one, see :func:`screen_unit`)."""
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    if unit is not None:
        return f"{sign}{n / _UNIT_FACTORS[unit]:.{digits}f} {unit}"
    for name, factor in BINARY_UNITS:
        if n >= factor:
            return f"{sign}{n / factor:.{digits}f} {name}"
    return f"{sign}{int(n)} B"


def screen_unit(largest_bytes: int | float) -> str:
    """The one unit a set of sizes is shown in (a ledger, a chart axis): GiB, or the larger binary unit the
    largest of them reads in, so "243681.76 GiB" never stands beside "237.97 TiB"."""
    n = abs(largest_bytes)
    for name, factor in BINARY_UNITS:
        if factor > 2**30 and n >= factor:
            return name
    return "GiB"


def result_unit(peak_bytes: int, capacity_bytes: int | None) -> str:
    """The one unit a result's screen shows its sizes in (the verdict, the ledger, the chart, what to change).

    With a capacity, the capacity's (GiB for every GPU), so that what decides the fit — a headroom of 328 MiB beside
    an 80 GiB card, a 20 GiB fix of a 1.6 TiB step on a 24 GiB card — reads in it; a larger unit only where the peak
    would read 100,000 or more in it (an absurd setup's EiB: no 17-digit numbers). Without one, the peak's
    (:func:`screen_unit`)."""
    if not capacity_bytes:
        return screen_unit(peak_bytes)
    floor = _UNIT_FACTORS[screen_unit(capacity_bytes)]
    for name, factor in reversed(BINARY_UNITS):
        if factor >= floor and abs(peak_bytes) < 100_000 * factor:
            return name
    return BINARY_UNITS[0][0]


def format_in(nbytes: int | float, unit: str) -> str:
    """``nbytes`` in a screen's shared ``unit``, two decimals and thousands separated: ``0.32 GiB``, ``1,577.00 GiB``;
    a size that is not zero but rounds to it reads ``<0.01 GiB``, so "over by 0.00 GiB" is never said."""
    value = nbytes / _UNIT_FACTORS[unit]
    if nbytes and abs(value) < 0.005:
        return f"{'-' if nbytes < 0 else ''}<0.01 {unit}"
    return f"{value:,.2f} {unit}"


def in_unit(nbytes: int | float, unit: str) -> float:
    """``nbytes`` in ``unit`` (one of :data:`BINARY_UNITS`' names)."""
    return nbytes / _UNIT_FACTORS[unit]


def format_count(n: int) -> str:
    """Parameter counts: ``1.54B``, ``124.4M``."""
    for suffix, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= factor:
            return f"{n / factor:.{3 if factor >= 10**9 else 1}f}{suffix}".replace(".000B", "B")
    return str(n)


def ordinal(n: int) -> str:
    """``2nd``, ``3rd``, ``11th``, ``21st``: a count in words people read."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
