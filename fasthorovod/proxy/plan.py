"""The data plane's plan: what a job's proxies run with, and why, decided by pure functions.

Start-up (fasthorovod/proxy/startup.py) gathers what every rank knows: its address and CPU count
(a :class:`Peer` each), the user's settings (:class:`~fasthorovod.config.Config`, where unset stays
unset), whether Horovod sees every rank on one host and, where the path probe ran, every hop's
curve. :func:`plan` turns them into a :class:`DataPlanePlan`:

* the **layout**: the hierarchical allreduce (shared memory inside a host, one ring per local rank
  across hosts) when every host runs the same number L > 1 of ranks and FASTHOROVOD_HIERARCHICAL
  allows it, else the flat ring through every rank, with the reason (fasthorovod/proxy/hosts.py);
* the **threshold**: allreduces of at least this many bytes go to the proxies. The user's
  FASTHOROVOD_PROXY_THRESHOLD_BYTES, else 1 MiB, or ``SINGLE_HOST_PROXY_THRESHOLD`` when every rank
  runs on one host (no network, no per-flow cap to get around, and Horovod's ring over loopback
  is as fast below it);
* whether start-up **probes** the path: when the sockets per lane are not set and the ranks span
  hosts (FASTHOROVOD_PROBE=auto), or always (=1), or never (=0);
* the **lanes** (FASTHOROVOD_NUM_LANES, else from the probe's best rate and the fewest CPUs any
  worker has, probe.choose_lanes; 4 where nothing was measured) and the **sockets per lane**
  (FASTHOROVOD_SOCKETS_PER_LANE, else the knee of the probe's curves spread over the lanes,
  probe.choose; 1 where nothing was measured).

Every rank computes the plan from the same exchanged inputs, so every rank gets the same one
(the settings are equal everywhere: the proxies' handshake compares ``Config.wire_hash``). The plan
is computed before the probe (to know whether to measure, and on which ring) and again with its
curves; nothing here starts a process or touches a socket, so the choices are unit-tested on
synthetic peers and curves (tests/unit/test_plan.py).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, FrozenSet, Optional, Sequence

from fasthorovod.config import Config, ConfigError
from fasthorovod.proxy import hosts as host_layout
from fasthorovod.proxy import probe

DEFAULT_LANES = 4
CROSS_HOST_PROXY_THRESHOLD = 1 << 20
# FASTHOROVOD_PROXY_THRESHOLD_BYTES's default when every rank runs on one host (no network, so no
# per-flow cap): from docs/results/allreduce-loopback-rounds-2026-11-30.json, where Horovod's ring
# is as fast as (1-4 MiB) or faster than (1 MiB, 4 proxies) the proxies below 8 MiB.
SINGLE_HOST_PROXY_THRESHOLD = 8 << 20


@dataclasses.dataclass(frozen=True)
class Peer:
    """What a rank tells the others at start-up that the plan depends on."""

    host: str  # the address its proxies bind to
    cpus: int  # the CPUs it may run on


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """How the path probe went: runs (2 when the hops' knees disagreed and it measured again; 0 when
    an earlier start-up's curves were reused), the flow counts measured the second time, seconds."""

    runs: int
    seconds: float = 0.0
    run_seconds: Sequence[float] = ()
    rechecked_flows: Optional[Sequence[int]] = None
    reused_hosts: Optional[int] = None  # reused: how many hosts the earlier probe measured
    # the hosts whose hops the plan's curves (flow_choice.hops) measured: a later start-up of this
    # process among them reuses the curves (startup.run)
    hosts: FrozenSet[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class DataPlanePlan:
    """What one rank's data plane runs with, and why each choice was made."""

    rank: int
    size: int
    num_hosts: int  # distinct addresses among the ranks
    lanes: int
    lanes_because: str
    sockets_per_lane: int
    sockets_because: str
    threshold_bytes: int
    threshold_because: str
    probes: bool  # whether start-up measures the path (the curves, once measured, are in flow_choice)
    layout: Optional[host_layout.HostLayout]  # the hierarchical allreduce's; None: the flat ring
    flat_because: Optional[str]  # why the flat ring, when ranks share hosts
    hierarchical_required: bool  # FASTHOROVOD_HIERARCHICAL=1: an error where it cannot run
    flow_choice: Optional[probe.FlowChoice] = None
    probe_run: Optional[ProbeRun] = None
    startup_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def flows(self) -> int:
        return self.lanes * self.sockets_per_lane

    def ring_next(self) -> int:
        """The rank this rank's lanes connect to: the next in the flat ring, or the same local rank
        on the next host."""
        return self.layout.ring_next() if self.layout is not None else (self.rank + 1) % self.size

    def flat(self, because: str) -> "DataPlanePlan":
        """This plan with the flat ring instead of the hierarchical layout (start-up found that the
        ranks of a host cannot share memory), saying why."""
        return dataclasses.replace(self, layout=None, flat_because=because)

    def describe(self) -> dict:
        """The plan as plain data (``hvd.proxy_group().describe()``, the benchmarks' records)."""
        info = {"lanes": self.lanes, "lanes_because": self.lanes_because,
                "sockets_per_lane": self.sockets_per_lane, "flows": self.flows,
                "sockets_source": self.sockets_because,
                "threshold_bytes": self.threshold_bytes, "threshold_because": self.threshold_because,
                "hierarchical": None if self.layout is None else {
                    "hosts": self.layout.num_hosts, "ranks_per_host": self.layout.local_size,
                    "host_index": self.layout.host_index, "local_rank": self.layout.local_rank},
                "flat_because": self.flat_because,
                "startup_seconds": dict(self.startup_seconds)}
        if self.flow_choice is not None:
            run = self.probe_run or ProbeRun(runs=1)
            info["probe"] = {"knee_flows": self.flow_choice.knee_flows, "seconds": run.seconds,
                             "runs": run.runs, "run_seconds": list(run.run_seconds), "reused": run.runs == 0,
                             "rechecked_flows": None if run.rechecked_flows is None else list(run.rechecked_flows),
                             "curve_bytes_per_second": dict(self.flow_choice.curve),
                             "hops_bytes_per_second": [dict(h) for h in self.flow_choice.hops]}
        return info

    def summary(self) -> str:
        """The line rank 0 prints when the probe chose (``[fasthorovod] data plane: ...``)."""
        run = self.probe_run or ProbeRun(runs=1)
        if run.runs == 0:
            measured = (f"as measured at an earlier start-up of this job among {run.reused_hosts} hosts, "
                        f"these {self.num_hosts} among them")
        else:
            measured = f"measured in {run.seconds:.1f} s{', twice: the hops disagreed' if run.runs == 2 else ''}"
        what = self.flow_choice.describe() if self.flow_choice is not None else self.sockets_because
        return (f"data plane: {self.lanes} lanes x {self.sockets_per_lane} sockets ({what}; {self.lanes_because}; "
                f"{measured}; FASTHOROVOD_NUM_LANES and FASTHOROVOD_SOCKETS_PER_LANE override)")


def plan(settings: Config, peers: Sequence[Peer], rank: int, single_host: bool,
         hops: Optional[Sequence[Dict[int, float]]] = None) -> DataPlanePlan:
    """The plan for `rank` of ``len(peers)`` ranks from the user's `settings`, every rank's
    :class:`Peer`, whether Horovod sees them on one host, and, once the probe has run, every hop's
    curve (`hops`, one per receiving rank or host). Raises ConfigError where the settings ask for
    what these peers cannot run (FASTHOROVOD_HIERARCHICAL=1 with uneven hosts)."""
    size = len(peers)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not among {size} peers")
    layout, flat_because = _layout(settings, peers, rank)
    if settings.proxy_threshold_bytes is not None:
        threshold, threshold_because = settings.proxy_threshold_bytes, "FASTHOROVOD_PROXY_THRESHOLD_BYTES"
    elif single_host:
        threshold, threshold_because = SINGLE_HOST_PROXY_THRESHOLD, "one host: Horovod's ring is as fast below it"
    else:
        threshold, threshold_because = CROSS_HOST_PROXY_THRESHOLD, "default"
    probing = probes(settings, single_host)
    lanes, lanes_because = _lanes(settings, peers, layout, hops)
    if settings.sockets_per_lane is not None:
        choice, sockets, sockets_because = None, settings.sockets_per_lane, "FASTHOROVOD_SOCKETS_PER_LANE"
    elif probing and hops is not None:
        choice = probe.choose(hops, lanes, rehash=settings.rehash)
        sockets, sockets_because = choice.sockets_per_lane, "probe"
    else:
        choice, sockets = None, 1
        sockets_because = ("default (one host: no probe)" if single_host and settings.probe == "auto"
                           else "default (FASTHOROVOD_PROBE=0)" if settings.probe == "0"
                           else "default (not measured yet)")
    return DataPlanePlan(rank=rank, size=size, num_hosts=len({peer.host for peer in peers}),
                         lanes=lanes, lanes_because=lanes_because,
                         sockets_per_lane=sockets, sockets_because=sockets_because,
                         threshold_bytes=threshold, threshold_because=threshold_because, probes=probing,
                         layout=layout, flat_because=flat_because,
                         hierarchical_required=settings.hierarchical == "1", flow_choice=choice)


def _layout(settings: Config, peers: Sequence[Peer], rank: int):
    """The hierarchical layout, or None and why not (when the ranks share hosts). Decided from the
    exchanged addresses alone, so alike on every rank."""
    mode = settings.hierarchical
    layout = host_layout.layout([peer.host for peer in peers], rank)
    why = layout.why_flat()
    if why is not None and mode == "1":
        raise ConfigError(f"FASTHOROVOD_HIERARCHICAL=1, but {why} (ranks per host: "
                          f"{[len(ranks) for ranks in layout.hosts]}); unset it to run the flat ring")
    if why is not None or mode == "0":
        shared = layout.num_hosts < len(peers)  # ranks share hosts: say why they still run one flat ring
        return None, (("FASTHOROVOD_HIERARCHICAL=0" if mode == "0" else why) if shared else None)
    return layout, None


def _lanes(settings: Config, peers: Sequence[Peer], layout: Optional[host_layout.HostLayout],
           hops: Optional[Sequence[Dict[int, float]]]):
    """The lanes and why: the user's, else from the probe's best rate and the fewest CPUs per rank
    of any host (probe.choose_lanes), else the default."""
    if settings.num_lanes is not None:
        return settings.num_lanes, "lanes from FASTHOROVOD_NUM_LANES"
    if hops is None:
        return DEFAULT_LANES, "default lanes"
    rate = max(probe.ring_curve(hops).values())
    ranks_on = collections.Counter(peer.host for peer in peers)
    cpus = min(peer.cpus / ranks_on[peer.host] for peer in peers)
    rings = layout.local_size if layout is not None else 1
    needed = probe.lanes_needed(rate, rings)
    per_ring = f" over {rings} rings" if rings > 1 else ""
    because = (f"lanes: {probe.mbit(rate)} Mbit/s{per_ring} needs {needed} lane{'' if needed == 1 else 's'} "
               f"of {probe.mbit(probe.LANE_BYTES_PER_SECOND)} Mbit/s; at least {probe.MIN_LANES}, "
               f"above that at most {cpus:g} CPUs per worker")
    return probe.choose_lanes(rate, cpus, rings), because


def probes(settings: Config, single_host: bool) -> bool:
    """Whether start-up measures the path: the sockets per lane are not set, and the ranks span
    hosts (FASTHOROVOD_PROBE=auto) or the user asks for it (=1). The settings are equal on every
    rank, and so is the topology, so every rank decides alike."""
    return (settings.sockets_per_lane is None and settings.num_lanes != 0
            and (settings.probe == "1" or (settings.probe == "auto" and not single_host)))


def enabled(settings: Config, size: int) -> bool:
    """Whether a job of `size` ranks runs proxies at all (FASTHOROVOD_NUM_LANES=0 turns them off;
    one rank has nothing to send)."""
    return settings.num_lanes != 0 and size > 1
