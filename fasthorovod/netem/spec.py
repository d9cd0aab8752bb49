"""The emulated cloud's specification: ``HOSTS:LINK_RATE:PER_FLOW_RATE``.

``4:1gbit:200mbit`` means four hosts, each with a 1 Gbit/s link (egress and ingress), on which a
single TCP flow gets at most 200 Mbit/s. Rates are written as ``tc`` writes them: a number with an
optional ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit`` suffix (decimal multiples, case does not
matter); a plain number is bit/s. ``tc``'s byte units (``kbps``, ``mbps`` ...) are refused because
they are easy to misread as bits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_HOSTS = 254  # host addresses are .1 ... .254 of one /24

_RATE_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_rate(text: str) -> float:
    """Parse a tc-style rate (``200mbit``, ``1Gbit``, ``1.5gbit``, ``64000``) into bit/s."""
    match = _RATE_RE.match(text.lower())
    if match is None:
        raise ValueError(f"rate {text!r} is not a number with an optional unit (e.g. 200mbit)")
    number, unit = match.groups()
    if unit not in _RATE_UNITS:
        hint = " (tc's *bps units are bytes/s; write bit/s: kbit, mbit, gbit)" if unit.endswith("bps") else ""
        raise ValueError(f"rate {text!r} has unknown unit {unit!r}{hint}; use bit, kbit, mbit, gbit or tbit")
    bits_per_s = float(number) * _RATE_UNITS[unit]
    if bits_per_s <= 0:
        raise ValueError(f"rate {text!r} must be greater than zero")
    return bits_per_s


def format_rate(bits_per_s: float) -> str:
    """The shortest exact tc-style spelling of a rate: 2e8 -> ``200mbit``, 1.5e9 -> ``1500mbit``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scaled = bits_per_s / _RATE_UNITS[unit]
        if scaled >= 1 and scaled == int(scaled):
            return f"{int(scaled)}{unit}"
    return f"{bits_per_s:g}bit"


@dataclass(frozen=True)
class CloudSpec:
    """What the emulated network looks like; validated on construction."""

    hosts: int
    link_bits_per_s: float
    per_flow_bits_per_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be >= 1 and <= {MAX_HOSTS}, got {self.hosts}")
        if not (math.isfinite(self.link_bits_per_s) and self.link_bits_per_s > 0):
            raise ValueError(f"link rate must be a positive number of bit/s, got {self.link_bits_per_s}")
        if not (math.isfinite(self.per_flow_bits_per_s) and self.per_flow_bits_per_s > 0):
            raise ValueError(f"per-flow rate must be a positive number of bit/s, got {self.per_flow_bits_per_s}")
        if self.per_flow_bits_per_s > self.link_bits_per_s:
            raise ValueError(
                f"per-flow rate {format_rate(self.per_flow_bits_per_s)} exceeds "
                f"link rate {format_rate(self.link_bits_per_s)}"
            )

    def __str__(self) -> str:
        return f"{self.hosts}:{format_rate(self.link_bits_per_s)}:{format_rate(self.per_flow_bits_per_s)}"


def parse_spec(text: str) -> CloudSpec:
    """Parse ``HOSTS:LINK_RATE:PER_FLOW_RATE``, e.g. ``parse_spec("4:1gbit:200mbit")``.

    Raises ValueError naming the part that is wrong.
    """
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"spec {text!r} must be HOSTS:LINK_RATE:PER_FLOW_RATE, e.g. 4:1gbit:200mbit")
    hosts_text, link_text, per_flow_text = parts
    try:
        hosts = int(hosts_text.strip())
    except ValueError:
        raise ValueError(f"hosts {hosts_text!r} in spec {text!r} is not an integer") from None
    try:
        link = parse_rate(link_text)
    except ValueError as err:
        raise ValueError(f"link rate: {err}") from None
    try:
        per_flow = parse_rate(per_flow_text)
    except ValueError as err:
        raise ValueError(f"per-flow rate: {err}") from None
    if per_flow > link:
        raise ValueError(f"per-flow rate {per_flow_text.strip()} exceeds link rate {link_text.strip()}")
    return CloudSpec(hosts=hosts, link_bits_per_s=link, per_flow_bits_per_s=per_flow)
