"""The per-flow shaper: ``tc`` commands that cap a device at a link rate and each TCP flow at less.

Clouds cap the bandwidth of one TCP flow well below the NIC's rate. The fair-queueing qdiscs that
could express that directly (``fq maxrate``, ``sfq``, the ``flow`` classifier) are not available on
the machines we run on, so the cap is built from ``htb`` and ``u32``, which are:

- an ``htb`` root class at the LINK rate; every other class is its child, so the device never sends
  faster than the link;
- 256 leaf classes, one per flow bucket, each with ``ceil`` = PER_FLOW rate. Their guaranteed
  ``rate`` is LINK/257, so the guarantees of all leaves plus the default class add up to the link
  and every rate above that is borrowed from the root (htb only lets a class exceed its own rate
  by borrowing, so the root's ceiling holds however many flows are active);
- a two-level ``u32`` hash that picks the bucket from a TCP packet's port pair: the first level
  hashes 4 bits of the source port into 16 tables, the second level 4 bits of the destination port
  into 16 buckets each. Bits 1-4 are used, not bits 0-3: Linux hands out even ephemeral ports to
  ``connect()`` and odd ones to ``bind(0)``, so bit 0 is nearly constant and using it would leave
  three quarters of the buckets empty;
- the ``htb default`` class (at up to the link rate) for everything else: ARP, ICMP, UDP, IPv6 and
  IPv4 packets with options (the hash reads the ports at a fixed 20-byte IP header offset).

The same port pair always lands in the same bucket, so a flow is capped at PER_FLOW. Two flows
whose ports hash alike share one bucket's cap, which is what per-flow hashing on real networks does
to unlucky flows too. The reverse direction of a connection (ACKs) is hashed on the swapped ports.
"""

from __future__ import annotations

BUCKET_BITS = 4  # per port: 16 x 16 = 256 leaf classes
HASH_SIZE = 1 << BUCKET_BITS
SOURCE_PORT_MASK = 0x001E0000  # bits 1-4 of the source port in the 32-bit word at TCP offset 0
DEST_PORT_MASK = 0x0000001E  # bits 1-4 of the destination port
ROOT_CLASS = "1:1"
DEFAULT_CLASS = "1:2"
FIRST_LEAF_MINOR = 0x100  # leaf classes are 1:100 ... 1:1ff
FIRST_PORT_TABLE = 0x3  # u32 hash tables: 2: hashes source ports, 3: ... 12: destination ports
QUANTUM_BYTES = 60000  # equal DRR quanta so flows borrowing link bandwidth share it fairly


def _bits(rate: float) -> str:
    return f"{int(rate)}bit"


def flow_bucket(source_port: int, dest_port: int) -> tuple[int, int]:
    """(source port bucket, destination port bucket) of a TCP flow, as the ``u32`` hash computes them:
    the 32-bit word at TCP offset 0 (source port, destination port) masked, then shifted right by
    the mask's lowest set bit."""
    word = source_port << 16 | dest_port

    def hashed(mask: int) -> int:
        return (word & mask) >> ((mask & -mask).bit_length() - 1)

    return hashed(SOURCE_PORT_MASK), hashed(DEST_PORT_MASK)


def leaf_classid(source_bucket: int, dest_bucket: int) -> str:
    """The htb class of the flow bucket chosen by (source port bucket, destination port bucket)."""
    return f"1:{FIRST_LEAF_MINOR + source_bucket * HASH_SIZE + dest_bucket:x}"


def shaping_commands(device: str, link_bits_per_s: float, per_flow_bits_per_s: float) -> list[str]:
    """``tc -batch`` lines that cap the egress of ``device`` at ``link_bits_per_s`` and each TCP flow
    through it at ``per_flow_bits_per_s`` (one host's rates: ``CloudSpec.host_rates``)."""
    link = _bits(link_bits_per_s)
    per_flow = _bits(per_flow_bits_per_s)
    guaranteed = _bits(max(link_bits_per_s // (HASH_SIZE * HASH_SIZE + 1), 8))
    lines = [
        f"qdisc add dev {device} root handle 1: htb default {DEFAULT_CLASS.split(':')[1]}",
        f"class add dev {device} parent 1: classid {ROOT_CLASS} htb rate {link} ceil {link} quantum {QUANTUM_BYTES}",
        f"class add dev {device} parent {ROOT_CLASS} classid {DEFAULT_CLASS} htb"
        f" rate {guaranteed} ceil {link} quantum {QUANTUM_BYTES}",
    ]
    for source_bucket in range(HASH_SIZE):
        for dest_bucket in range(HASH_SIZE):
            lines.append(
                f"class add dev {device} parent {ROOT_CLASS} classid {leaf_classid(source_bucket, dest_bucket)}"
                f" htb rate {guaranteed} ceil {per_flow} quantum {QUANTUM_BYTES}"
            )
    filter_prefix = f"filter add dev {device} parent 1: prio 1 protocol ip"
    lines.append(f"{filter_prefix} handle 2: u32 divisor {HASH_SIZE}")
    for source_bucket in range(HASH_SIZE):
        lines.append(f"{filter_prefix} handle {FIRST_PORT_TABLE + source_bucket:x}: u32 divisor {HASH_SIZE}")
    # Level 1 (the default table 800:): TCP with a 20-byte IP header -> table 2:, by source port.
    lines.append(
        f"{filter_prefix} u32 ht 800:: match ip protocol 6 0xff match u8 0x05 0x0f at 0"
        f" hashkey mask 0x{SOURCE_PORT_MASK:08x} at 20 link 2:"
    )
    for source_bucket in range(HASH_SIZE):
        # Level 2: bucket i of table 2: -> table 3+i:, by destination port.
        lines.append(
            f"{filter_prefix} u32 ht 2:{source_bucket:x}: match u32 0 0"
            f" hashkey mask 0x{DEST_PORT_MASK:08x} at 20 link {FIRST_PORT_TABLE + source_bucket:x}:"
        )
        for dest_bucket in range(HASH_SIZE):
            lines.append(
                f"{filter_prefix} u32 ht {FIRST_PORT_TABLE + source_bucket:x}:{dest_bucket:x}: match u32 0 0"
                f" flowid {leaf_classid(source_bucket, dest_bucket)}"
            )
    return lines
