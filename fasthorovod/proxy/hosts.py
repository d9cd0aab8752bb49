"""Where the ranks are: hosts, local ranks, and whether the hierarchical allreduce applies.

The hierarchical allreduce (csrc/shm/host.h, docs/hierarchical.md) needs every host to run the same
number L > 1 of ranks. A host is an address the proxies bind to (FASTHOROVOD_IFACE, the hostname's
address): ranks that bind to the same address run on one machine, or one container, and share its
memory; that is also the unit the network's per-flow cap and link rate apply to. Hosts are numbered
in the order of their lowest rank, and a host's ranks are its local ranks in rank order, so every
rank computes the same layout from the same list of addresses.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

MAX_LOCAL_RANKS = 16  # csrc/shm/host.h kMaxLocalRanks


@dataclasses.dataclass(frozen=True)
class HostLayout:
    hosts: List[List[int]]  # the ranks of each host
    rank: int

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def host_index(self) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.hosts[self.host_index].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host_index])

    def why_flat(self) -> Optional[str]:
        """None when the hierarchical allreduce applies; else why not, in words."""
        sizes = sorted({len(ranks) for ranks in self.hosts})
        if len(sizes) > 1:
            return f"the hosts run different numbers of ranks ({', '.join(map(str, sizes))})"
        if sizes[0] == 1:
            return "every host runs one rank"
        if sizes[0] > MAX_LOCAL_RANKS:
            return f"{sizes[0]} ranks per host is more than the {MAX_LOCAL_RANKS} it supports"
        return None

    def ring_next(self) -> int:
        """The rank after this one in its ring across hosts: the same local rank on the next host."""
        return self.hosts[(self.host_index + 1) % self.num_hosts][self.local_rank]

    def describe(self) -> str:
        return f"{self.num_hosts} host{'s' if self.num_hosts != 1 else ''} x {self.local_size} ranks"


def layout(addresses: Sequence[str], rank: int) -> HostLayout:
    """The layout of ranks whose proxies bind to `addresses` (one per rank), seen from `rank`."""
    hosts: dict = {}
    for r, address in enumerate(addresses):
        hosts.setdefault(address, []).append(r)
    return HostLayout(hosts=list(hosts.values()), rank=rank)
