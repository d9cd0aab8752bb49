"""The per-flow shaper: ``tc`` commands that cap a device at a link rate and each TCP flow at less.

Clouds cap the bandwidth of one TCP flow well below the NIC's rate. The fair-queueing qdiscs that
could express that directly (``fq maxrate``, ``sfq``, the ``flow`` classifier) are not available on
the machines we run on, so the cap is built from ``htb`` and ``u32``, which are:

- an ``htb`` root class at the LINK rate; every other class is its child, so the device never sends
  faster than the link;
- one leaf class per flow bucket (256 by default), each with ``ceil`` = PER_FLOW rate. Their
  guaranteed ``rate`` is LINK/(buckets + 1), so the guarantees of all leaves plus the default class
  add up to the link and every rate above that is borrowed from the root (htb only lets a class
  exceed its own rate by borrowing, so the root's ceiling holds however many flows are active);
- a two-level ``u32`` hash that picks the bucket from a TCP packet's port pair: the first level
  hashes B bits of the source port into 2^B tables, the second level B bits of the destination
  port into 2^B buckets each (B = 4 by default: 16 x 16 = 256 buckets; the cloud spec's
  ``buckets=`` option sets 4^B, :class:`FlowHash`). By default bits 1..B are used, not 0..B-1:
  Linux hands out even ephemeral ports to ``connect()`` and odd ones to ``bind(0)``, so bit 0 is
  nearly constant and using it would leave three quarters of the buckets empty (the spec's
  ``hashbit=0`` does just that, as a badly chosen hash on a real network would);
- the ``htb default`` class (at up to the link rate) for everything else: ARP, ICMP, UDP, IPv6 and
  IPv4 packets with options (the hash reads the ports at a fixed 20-byte IP header offset).

The same port pair always lands in the same bucket, so a flow is capped at PER_FLOW. Two flows
whose ports hash alike share one bucket's cap, which is what per-flow hashing on real networks does
to unlucky flows too. The reverse direction of a connection (ACKs) is hashed on the swapped ports.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_CLASS = "1:1"
DEFAULT_CLASS = "1:2"
FIRST_LEAF_MINOR = 0x100  # leaf classes are 1:100 onwards
FIRST_PORT_TABLE = 0x3  # u32 hash tables: 2: hashes source ports, 3: onwards destination ports
QUANTUM_BYTES = 60000  # equal DRR quanta so flows borrowing link bandwidth share it fairly
MAX_BITS_PER_PORT = 5  # 4^5 = 1024 buckets: u32 tables and htb class ids stay well inside their limits


@dataclass(frozen=True)
class FlowHash:
    """Which bits of a TCP flow's port pair pick its bucket: ``bits_per_port`` bits of each port
    from bit ``low_bit`` up, so ``4 ** bits_per_port`` buckets."""

    bits_per_port: int = 4
    low_bit: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.bits_per_port <= MAX_BITS_PER_PORT:
            raise ValueError(f"bits per port must be 1..{MAX_BITS_PER_PORT} (4 to {4 ** MAX_BITS_PER_PORT} buckets), "
                             f"got {self.bits_per_port}")
        if not 0 <= self.low_bit <= 16 - self.bits_per_port:
            raise ValueError(f"the lowest hashed port bit must be 0..{16 - self.bits_per_port} "
                             f"with {self.bits_per_port} bits per port, got {self.low_bit}")

    @classmethod
    def with_buckets(cls, buckets: int, low_bit: int = 1) -> "FlowHash":
        """The hash with ``buckets`` buckets (a power of 4: 4, 16, 64, 256, 1024)."""
        bits = {4 ** b: b for b in range(1, MAX_BITS_PER_PORT + 1)}.get(buckets)
        if bits is None:
            raise ValueError(f"buckets must be a power of 4 from 4 to {4 ** MAX_BITS_PER_PORT} "
                             f"(2^B x 2^B for B bits of each port), got {buckets}")
        return cls(bits, low_bit)

    @property
    def size(self) -> int:
        """Buckets per port: 2 ** bits_per_port."""
        return 1 << self.bits_per_port

    @property
    def buckets(self) -> int:
        return self.size * self.size

    @property
    def dest_mask(self) -> int:
        """The hashed bits of the destination port in the 32-bit word at TCP offset 0."""
        return (self.size - 1) << self.low_bit

    @property
    def source_mask(self) -> int:
        return self.dest_mask << 16

    def bucket(self, source_port: int, dest_port: int) -> tuple[int, int]:
        """(source port bucket, destination port bucket) of a TCP flow, as the ``u32`` hash computes
        them: the 32-bit word at TCP offset 0 (source port, destination port) masked, then shifted
        right by the mask's lowest set bit."""
        word = source_port << 16 | dest_port
        return (word & self.source_mask) >> (self.low_bit + 16), (word & self.dest_mask) >> self.low_bit

    def classid(self, source_bucket: int, dest_bucket: int) -> str:
        """The htb class of the flow bucket chosen by (source port bucket, destination port bucket)."""
        return f"1:{FIRST_LEAF_MINOR + source_bucket * self.size + dest_bucket:x}"


DEFAULT_HASH = FlowHash()


def flow_bucket(source_port: int, dest_port: int, flow_hash: FlowHash = DEFAULT_HASH) -> tuple[int, int]:
    """(source port bucket, destination port bucket) of a TCP flow under `flow_hash`."""
    return flow_hash.bucket(source_port, dest_port)


def leaf_classid(source_bucket: int, dest_bucket: int, flow_hash: FlowHash = DEFAULT_HASH) -> str:
    """The htb class of the flow bucket chosen by (source port bucket, destination port bucket)."""
    return flow_hash.classid(source_bucket, dest_bucket)


def _bits(rate: float) -> str:
    return f"{int(rate)}bit"


def shaping_commands(device: str, link_bits_per_s: float, per_flow_bits_per_s: float,
                     flow_hash: FlowHash = DEFAULT_HASH) -> list[str]:
    """``tc -batch`` lines that cap the egress of ``device`` at ``link_bits_per_s`` and each TCP flow
    through it at ``per_flow_bits_per_s`` (one host's rates: ``CloudSpec.host_rates``), flows
    hashed into buckets by `flow_hash`."""
    link = _bits(link_bits_per_s)
    per_flow = _bits(per_flow_bits_per_s)
    size = flow_hash.size
    guaranteed = _bits(max(link_bits_per_s // (flow_hash.buckets + 1), 8))
    lines = [
        f"qdisc add dev {device} root handle 1: htb default {DEFAULT_CLASS.split(':')[1]}",
        f"class add dev {device} parent 1: classid {ROOT_CLASS} htb rate {link} ceil {link} quantum {QUANTUM_BYTES}",
        f"class add dev {device} parent {ROOT_CLASS} classid {DEFAULT_CLASS} htb"
        f" rate {guaranteed} ceil {link} quantum {QUANTUM_BYTES}",
    ]
    for source_bucket in range(size):
        for dest_bucket in range(size):
            lines.append(
                f"class add dev {device} parent {ROOT_CLASS} classid {flow_hash.classid(source_bucket, dest_bucket)}"
                f" htb rate {guaranteed} ceil {per_flow} quantum {QUANTUM_BYTES}"
            )
    filter_prefix = f"filter add dev {device} parent 1: prio 1 protocol ip"
    lines.append(f"{filter_prefix} handle 2: u32 divisor {size}")
    for source_bucket in range(size):
        lines.append(f"{filter_prefix} handle {FIRST_PORT_TABLE + source_bucket:x}: u32 divisor {size}")
    # Level 1 (the default table 800:): TCP with a 20-byte IP header -> table 2:, by source port.
    lines.append(
        f"{filter_prefix} u32 ht 800:: match ip protocol 6 0xff match u8 0x05 0x0f at 0"
        f" hashkey mask 0x{flow_hash.source_mask:08x} at 20 link 2:"
    )
    for source_bucket in range(size):
        # Level 2: bucket i of table 2: -> table 3+i:, by destination port.
        lines.append(
            f"{filter_prefix} u32 ht 2:{source_bucket:x}: match u32 0 0"
            f" hashkey mask 0x{flow_hash.dest_mask:08x} at 20 link {FIRST_PORT_TABLE + source_bucket:x}:"
        )
        for dest_bucket in range(size):
            lines.append(
                f"{filter_prefix} u32 ht {FIRST_PORT_TABLE + source_bucket:x}:{dest_bucket:x}: match u32 0 0"
                f" flowid {flow_hash.classid(source_bucket, dest_bucket)}"
            )
    return lines
