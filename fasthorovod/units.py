"""Sizes and rates as people write them: the one parser for every flag, knob and tool that takes them.

Byte counts (:func:`parse_bytes`), case ignored:

* a bare number is bytes, as is ``B``: ``4096``, ``4096B``;
* binary (IEC) units are powers of 1024: ``KiB``, ``MiB``, ``GiB``, ``TiB``;
* decimal (SI) units are powers of 1000: ``kB`` (or ``KB``), ``MB``, ``GB``, ``TB``;
* a bare ``K``, ``M``, ``G`` or ``T`` is refused: it is read as 1024^n by some tools and as 1000^n
  by others, so the error asks for ``KiB`` or ``kB``;
* a fraction is accepted where the result is a whole number of bytes (``1.5MiB``, not ``1.3B``).

Rates (:func:`parse_rate`) are bit/s, written as ``tc`` writes them: a number with an optional
``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit`` suffix (powers of 1000, case ignored); a bare
number is bit/s. ``tc``'s byte rates (``kbps``, ``mbps`` ...) are refused because they are easy
to misread as bits.

Both raise :class:`ValueError` naming the text and the accepted forms; :func:`bytes_argument` and
:func:`rate_argument` are the same parsers for ``argparse`` (which shows only the message of an
``ArgumentTypeError``). The module imports nothing from the package: the benchmarks load it by
its path (benchmarks/_common.py).
"""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}

BYTES_FORMS = "a number of bytes with an optional unit: B, KiB, MiB, GiB, TiB (1024^n) or kB, MB, GB, TB (1000^n), e.g. 4096, 64KiB, 16MiB"
RATE_FORMS = "a number of bit/s with an optional unit: bit, kbit, mbit, gbit or tbit (1000^n), e.g. 200mbit, 1gbit"

_NUMBER_AND_UNIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")
_AMBIGUOUS = {"k": ("KiB", "kB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB")}


def parse_bytes(text: str) -> int:
    """``'4096'``, ``'64KiB'``, ``'1MB'``, ``'1.5MiB'`` -> a number of bytes (see the module's rule)."""
    if not isinstance(text, str):
        raise ValueError(f"byte count {text!r} is not text; write {BYTES_FORMS}")
    match = _NUMBER_AND_UNIT.fullmatch(text.lower())
    if match is None:
        raise ValueError(f"byte count {text!r} is not {BYTES_FORMS}")
    number, unit = match.groups()
    if unit in _AMBIGUOUS:
        binary, decimal = _AMBIGUOUS[unit]
        raise ValueError(f"byte count {text!r} is ambiguous: write {number}{binary} "
                         f"(x{BYTE_UNITS[binary.lower()]}) or {number}{decimal} (x{BYTE_UNITS[decimal.lower()]})")
    if unit not in BYTE_UNITS:
        hint = " (rates are not byte counts)" if unit in RATE_UNITS or unit.endswith(("bit", "bps")) else ""
        raise ValueError(f"byte count {text!r} has unknown unit {unit!r}{hint}; write {BYTES_FORMS}")
    value = Fraction(number) * BYTE_UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"byte count {text!r} is not a whole number of bytes ({float(value):g})")
    return int(value)


def format_bytes(nbytes: int) -> str:
    """The shortest exact binary spelling, which :func:`parse_bytes` reads back: 65536 -> ``64KiB``,
    1000 -> ``1000B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def parse_rate(text: str) -> float:
    """A tc-style rate (``200mbit``, ``1Gbit``, ``1.5gbit``, ``64000``) -> bit/s, greater than zero."""
    if not isinstance(text, str):
        raise ValueError(f"rate {text!r} is not text; write {RATE_FORMS}")
    match = _NUMBER_AND_UNIT.fullmatch(text.lower())
    if match is None:
        raise ValueError(f"rate {text!r} is not {RATE_FORMS}")
    number, unit = match.groups()
    if unit not in RATE_UNITS:
        hint = " (tc's *bps units are bytes/s; write bit/s: kbit, mbit, gbit)" if unit.endswith("bps") else ""
        raise ValueError(f"rate {text!r} has unknown unit {unit!r}{hint}; write {RATE_FORMS}")
    bits_per_s = float(number) * RATE_UNITS[unit]
    if bits_per_s <= 0:
        raise ValueError(f"rate {text!r} must be greater than zero")
    return bits_per_s


def format_rate(bits_per_s: float) -> str:
    """The shortest exact tc-style spelling of a rate: 2e8 -> ``200mbit``, 1.5e9 -> ``1500mbit``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scaled = bits_per_s / RATE_UNITS[unit]
        if scaled >= 1 and scaled == int(scaled):
            return f"{int(scaled)}{unit}"
    return f"{bits_per_s:g}bit"


def _argument(parse):
    def argument(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    argument.__name__ = parse.__name__
    argument.__doc__ = f"{parse.__name__} for argparse: a bad value raises ArgumentTypeError with its message."
    return argument


bytes_argument = _argument(parse_bytes)
rate_argument = _argument(parse_rate)
