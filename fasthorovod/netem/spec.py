"""The emulated cloud's specification: ``HOSTS:LINK_RATE:PER_FLOW_RATE[,hostI=[LINK_RATE:]PER_FLOW_RATE]...``

``4:1gbit:200mbit`` means four hosts, each with a 1 Gbit/s link (egress and ingress), on which a
single TCP flow gets at most 200 Mbit/s. Rates are written as ``tc`` writes them: a number with an
optional ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit`` suffix (decimal multiples, case does not
matter); a plain number is bit/s. ``tc``'s byte units (``kbps``, ``mbps`` ...) are refused because
they are easy to misread as bits. The parser is :func:`fasthorovod.units.parse_rate`.

An uneven cloud, where some hosts sit on a worse network path (another rack, another availability
zone), adds per-host overrides after commas: ``5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit``
is five hosts like ``5:1gbit:200mbit`` except that host1's flows get at most 100 Mbit/s (its link
stays 1 Gbit/s) and host3 has a 500 Mbit/s link with 150 Mbit/s per flow. ``hostI`` is the I-th
host, counted from 0: the one whose namespace ends in ``-hI`` (``EmulatedCloud.hosts[I]``). One
rate overrides the host's per-flow cap only; two rates override its link and its per-flow cap. A
host's rates cap both what it sends and what it receives, so a flow between two hosts gets the
smaller of their per-flow caps (``CloudSpec.path_rates``; the shaping that does it is in ``cloud``).

Two options, after commas too, say how flows are hashed onto the per-flow caps (``shaping``):
``buckets=N`` (default 256; a power of 4 from 4 to 1024) is how many per-flow buckets each host's
shaper has, and ``hashbit=K`` (default 1) the lowest bit of each port the hash reads. Flows whose
ports hash alike share one bucket's cap, as unlucky flows do on real networks (ECMP paths, a
shaper's buckets): ``4:1gbit:200mbit,buckets=16`` is a cloud where collisions are frequent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from fasthorovod.units import format_rate, parse_rate

from .shaping import DEFAULT_HASH, FlowHash

MAX_HOSTS = 254  # host addresses are .1 ... .254 of one /24

_HOST_NAME_RE = re.compile(r"^\s*host(0|[1-9]\d*)\s*$", re.IGNORECASE)
GRAMMAR = ("HOSTS:LINK_RATE:PER_FLOW_RATE[,hostI=PER_FLOW_RATE | ,hostI=LINK_RATE:PER_FLOW_RATE]..."
           "[,buckets=N][,hashbit=K]")
EXAMPLE = "5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit"


class HostRates(NamedTuple):
    """The rates of host ``index`` where they differ from the cloud's (an override)."""

    index: int
    link_bits_per_s: float
    per_flow_bits_per_s: float


def _check_rates(who: str, link: float, per_flow: float) -> None:
    """Raise ValueError, naming ``who`` ("" for the cloud, "host1 " for a host), unless the rates work."""
    if not (math.isfinite(link) and link > 0):
        raise ValueError(f"{who}link rate must be a positive number of bit/s, got {link}")
    if not (math.isfinite(per_flow) and per_flow > 0):
        raise ValueError(f"{who}per-flow rate must be a positive number of bit/s, got {per_flow}")
    if per_flow > link:
        raise ValueError(f"{who}per-flow rate {format_rate(per_flow)} exceeds {who}link rate {format_rate(link)}")


@dataclass(frozen=True)
class CloudSpec:
    """What the emulated network looks like; validated on construction.

    ``overrides`` holds ``(index, link_bits_per_s, per_flow_bits_per_s)`` for the hosts whose rates
    differ from ``link_bits_per_s`` and ``per_flow_bits_per_s``; any iterable of such triples is
    accepted and stored as a tuple of ``HostRates`` sorted by index.
    """

    hosts: int
    link_bits_per_s: float
    per_flow_bits_per_s: float
    overrides: tuple[HostRates, ...] = field(default=())
    flow_hash: FlowHash = DEFAULT_HASH  # how each host's shaper hashes flows onto per-flow buckets

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be >= 1 and <= {MAX_HOSTS}, got {self.hosts}")
        _check_rates("", self.link_bits_per_s, self.per_flow_bits_per_s)
        overrides = tuple(sorted((HostRates(*override) for override in self.overrides), key=lambda o: o.index))
        for previous, override in zip((None, *overrides), overrides):
            if not (isinstance(override.index, int) and 0 <= override.index < self.hosts):
                raise ValueError(f"no host{override.index}: the hosts are {self._host_range()}")
            if previous is not None and previous.index == override.index:
                raise ValueError(f"host{override.index} has two overrides")
            _check_rates(f"host{override.index} ", override.link_bits_per_s, override.per_flow_bits_per_s)
        object.__setattr__(self, "overrides", overrides)

    def _host_range(self) -> str:
        return "host0" if self.hosts == 1 else f"host0..host{self.hosts - 1}"

    def host_rates(self, index: int) -> tuple[float, float]:
        """``(link_bits_per_s, per_flow_bits_per_s)`` of host ``index`` (0-based), overrides applied."""
        if not 0 <= index < self.hosts:
            raise IndexError(f"no host{index}: the hosts are {self._host_range()}")
        for override in self.overrides:
            if override.index == index:
                return override.link_bits_per_s, override.per_flow_bits_per_s
        return self.link_bits_per_s, self.per_flow_bits_per_s

    def path_rates(self, sender: int, receiver: int) -> tuple[float, float]:
        """``(link, per_flow)`` caps of traffic from host ``sender`` to host ``receiver``: the sender's
        egress and the receiver's ingress are both shaped, each at its own host's rates."""
        sender_link, sender_per_flow = self.host_rates(sender)
        receiver_link, receiver_per_flow = self.host_rates(receiver)
        return min(sender_link, receiver_link), min(sender_per_flow, receiver_per_flow)

    @property
    def uneven(self) -> bool:
        """Whether any host's rates differ from the others'."""
        default = (self.link_bits_per_s, self.per_flow_bits_per_s)
        return any(self.host_rates(index) != default for index in range(self.hosts))

    def __str__(self) -> str:
        parts = [f"{self.hosts}:{format_rate(self.link_bits_per_s)}:{format_rate(self.per_flow_bits_per_s)}"]
        for index, link, per_flow in self.overrides:
            link_part = "" if link == self.link_bits_per_s else f"{format_rate(link)}:"  # one rate: per-flow only
            parts.append(f"host{index}={link_part}{format_rate(per_flow)}")
        if self.flow_hash.buckets != DEFAULT_HASH.buckets:
            parts.append(f"buckets={self.flow_hash.buckets}")
        if self.flow_hash.low_bit != DEFAULT_HASH.low_bit:
            parts.append(f"hashbit={self.flow_hash.low_bit}")
        return ",".join(parts)


def _parse_override(part: str, spec_text: str, hosts: int, link: float) -> HostRates:
    """One ``hostI=[LINK_RATE:]PER_FLOW_RATE`` of spec ``spec_text``; ``link`` is the cloud's link rate."""
    where = f"host override {part.strip()!r} in spec {spec_text!r}"
    name, equals, rates_text = part.partition("=")
    if not equals:
        raise ValueError(f"{where} must be hostI=PER_FLOW_RATE or hostI=LINK_RATE:PER_FLOW_RATE, e.g. host1=100mbit")
    match = _HOST_NAME_RE.match(name)
    if match is None:
        hint = f" (did you mean host{name.strip()[1:]}?)" if re.fullmatch(r"\s*h\d+\s*", name) else ""
        raise ValueError(f"{where}: {name.strip()!r} is not a host name hostI (I = 0..{hosts - 1}){hint}")
    index = int(match.group(1))
    if index >= hosts:
        hosts_are = "the only host is host0" if hosts == 1 else f"the {hosts} hosts are host0..host{hosts - 1}"
        raise ValueError(f"{where}: there is no host{index}, {hosts_are}")
    rate_texts = rates_text.split(":")
    if len(rate_texts) > 2:
        raise ValueError(f"{where} has {len(rate_texts)} rates; give PER_FLOW_RATE or LINK_RATE:PER_FLOW_RATE")
    host_link = link
    if len(rate_texts) == 2:
        try:
            host_link = parse_rate(rate_texts[0])
        except ValueError as err:
            raise ValueError(f"{where}: host{index} link rate: {err}") from None
    try:
        host_per_flow = parse_rate(rate_texts[-1])
    except ValueError as err:
        raise ValueError(f"{where}: host{index} per-flow rate: {err}") from None
    if host_per_flow > host_link:
        raise ValueError(
            f"{where}: host{index} per-flow rate {rate_texts[-1].strip()} exceeds host{index} link rate "
            f"{rate_texts[0].strip() if len(rate_texts) == 2 else format_rate(host_link)}"
        )
    return HostRates(index, host_link, host_per_flow)


def parse_spec(text: str) -> CloudSpec:
    """Parse ``HOSTS:LINK_RATE:PER_FLOW_RATE[,hostI=[LINK_RATE:]PER_FLOW_RATE]...``, e.g.
    ``parse_spec("4:1gbit:200mbit")`` or ``parse_spec("3:1gbit:200mbit,host1=50mbit")``.

    Raises ValueError naming the part that is wrong.
    """
    base_text, *override_texts = text.split(",")
    parts = base_text.split(":")
    if len(parts) != 3:
        raise ValueError(
            f"spec {text!r} must be HOSTS:LINK_RATE:PER_FLOW_RATE, optionally followed by per-host overrides "
            f"(,hostI=PER_FLOW_RATE or ,hostI=LINK_RATE:PER_FLOW_RATE), e.g. 4:1gbit:200mbit or {EXAMPLE}"
        )
    hosts_text, link_text, per_flow_text = parts
    try:
        hosts = int(hosts_text.strip())
    except ValueError:
        raise ValueError(f"hosts {hosts_text!r} in spec {text!r} is not an integer") from None
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be >= 1 and <= {MAX_HOSTS}, got {hosts}")
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
    overrides: dict[int, tuple[str, HostRates]] = {}
    options: dict[str, int] = {}
    for part in override_texts:
        if not part.strip():
            raise ValueError(f"spec {text!r} has an empty part between commas (or a trailing comma)")
        key, _, value = part.partition("=")
        if key.strip().lower() in _OPTIONS:
            key = key.strip().lower()
            if key in options:
                raise ValueError(f"spec {text!r} sets {key}= twice")
            try:
                options[key] = int(value.strip())
            except ValueError:
                raise ValueError(f"{key}= in spec {text!r} takes an integer, got {value.strip()!r}") from None
            continue
        override = _parse_override(part, text, hosts, link)
        if override.index in overrides:
            raise ValueError(
                f"host override {part.strip()!r} in spec {text!r}: host{override.index} is already set by "
                f"{overrides[override.index][0]!r}; give each host at most one override"
            )
        overrides[override.index] = (part.strip(), override)
    try:
        flow_hash = FlowHash.with_buckets(options.get("buckets", DEFAULT_HASH.buckets),
                                          options.get("hashbit", DEFAULT_HASH.low_bit))
    except ValueError as err:
        raise ValueError(f"spec {text!r}: {err}") from None
    return CloudSpec(
        hosts=hosts,
        link_bits_per_s=link,
        per_flow_bits_per_s=per_flow,
        overrides=tuple(override for _, override in overrides.values()),
        flow_hash=flow_hash,
    )


_OPTIONS = ("buckets", "hashbit")
