"""The allreduce model: ring time, flows, caps and CPU, for Horovod and FastHorovod.

Notation (docs/scale.md has the derivation):

* a job has H hosts with P ranks each, n = H·P ranks; a message of M bytes;
* a ring allreduce of n ranks takes 2(n−1) steps and every rank sends (and receives) its share of
  2(n−1)/n · M bytes, so the time is ``2(n−1)·α + 2(n−1)/n · M / R``: α the per-step latency (half
  a round trip plus software per step), R the rate of the ring's slowest hop. The bus bandwidth
  2(n−1)/n · M / T is then R for a big message;
* flows: a host's NIC carries ``B`` bytes/s, one TCP flow at most ``C`` (the cloud's per-flow cap);
  TCP gets a fraction ``goodput`` of either (headers, framing). FastHorovod runs k lanes (proxies)
  of S sockets each, so a host's lanes carry ``goodput · min(B, C · k · D(S))`` where D(S) is the
  number of distinct per-flow caps the S sockets of a lane land in (S on a cloud that caps each
  5-tuple; fewer on the emulated cloud, whose shaper hashes flows into 16 buckets per server port:
  ``D(S) = b(1 − (1 − 1/b)^S)``). Lanes are rebalanced to their rates, so the sum is what counts;
* CPU: a proxy pays ``kappa`` CPU-seconds per wire byte it sends (the send, the matching receive,
  half a byte of adds: docs/placement.md), is busy at most ``eta`` of the time, and pays
  ``kappa·(1 + gamma·(m − 1))`` when m busy threads share a core (placement.py's fitted model).
  Each byte through the host's network stack costs ``kappa_net`` more (zero on a real NIC with
  offloads, where loopback's kappa already holds the copies; large on the emulated cloud, whose
  bridge, veth pairs and htb shapers run on the same two cores as everything else);
* a flat ring with P ranks per host keeps every rank's proxies as busy as the NIC's: the host's
  proxies do P times the NIC's work. A hierarchical allreduce (reduce-scatter inside the host over
  shared memory, P inter-host rings of M/P, allgather inside the host) does the NIC's work once;
* Horovod (Gloo) sends a rank's whole ring over one TCP flow per neighbour, from one thread that
  also reduces: ``R = min(hvd_eff · goodput · C, goodput · B, 1 / kappa_gloo)``.

Every function here is pure and cheap: the CLI, the projection and the tests call them directly.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Dict, Mapping, Optional

# Defaults for the CPU pieces: the placement model fitted on this machine (docs/placement.md, run 2,
# docs/results/placement-run2-2026-12-01.json); unit costs from the same run.
PLACEMENT_KAPPA = 4.41e-10
PLACEMENT_ETA = 0.919
PLACEMENT_GAMMA = 0.0945
COPY_COST = 1.10e-10       # memcpy, s/B
REDUCE_COST = 7.9e-11      # float32 add into a shard, s/B
SOCKET_COST = 2.39e-10     # loopback TCP send + receive, s/B (the probe's raw flows)
# One core of Gloo moved ~1.07 GB/s through an allreduce on 40 GbE (facebookincubator/gloo#248).
GLOO_KAPPA = 1.0 / 1.07e9


@dataclasses.dataclass
class Params:
    """The model's physical parameters (what `calibrate` fits; defaults are priors, see docs/scale.md)."""

    kappa: float = PLACEMENT_KAPPA
    """proxy CPU-seconds per wire byte sent, alone on a core"""
    eta: float = PLACEMENT_ETA
    """largest fraction of the time a proxy is busy (it waits on its ring neighbours otherwise)"""
    gamma: float = PLACEMENT_GAMMA
    """extra per-byte cost per additional busy thread on a core"""
    kappa_net: float = 0.0
    """extra CPU-seconds per byte through the host's network stack beyond loopback's"""
    copy_cost: float = COPY_COST
    reduce_cost: float = REDUCE_COST
    socket_cost: float = SOCKET_COST
    goodput: float = 0.95
    """TCP goodput as a fraction of a configured rate (per-flow cap or link)"""
    alpha_fh: float = 2.0e-4
    """FastHorovod: software latency per ring step, s"""
    t0_fh: float = 2.0e-3
    """FastHorovod: fixed cost per collective (submit, negotiation, doorbells, completion), s"""
    alpha_hvd: float = 2.0e-4
    t0_hvd: float = 2.0e-3
    hvd_eff: float = 0.95
    """Horovod's fraction of one flow's goodput (its single thread alternates send, receive, add)"""
    kappa_gloo: float = GLOO_KAPPA
    """Horovod/Gloo CPU-seconds per wire byte (one thread sends, receives and reduces)"""
    meta: Dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping) -> "Params":
        if "params" in d:  # a calibration file
            d = d["params"]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path: str) -> "Params":
        with open(path) as f:
            return cls.from_json(json.load(f))


@dataclasses.dataclass
class Cluster:
    """A cluster: hosts × ranks per host, the NIC, the per-flow cap, the round trip, the cores.

    ``shared_cores``: all hosts run on one machine with this many cores (the emulated cloud); None
    on a real cluster, where each host has ``cores`` of its own. ``background_cores``: cores other
    jobs hold. ``compute_cores``: cores each rank's training keeps busy while it communicates.
    ``flow_buckets``: per-flow caps are hashed into this many buckets per server port (the
    emulated cloud: 16); None: every flow has its own cap. ``stage_rate``: bytes/s of the copy
    into and out of the proxies' shared memory (a GPU's D2H/H2D; None: CPU tensors, 1/copy_cost)."""

    hosts: int
    ranks_per_host: int = 1
    nic_bps: float = 1e9
    flow_bps: float = 2e8
    rtt_s: float = 0.0
    cores: float = 2.0
    shared_cores: Optional[float] = None
    background_cores: float = 0.0
    compute_cores: float = 0.0
    flow_buckets: Optional[int] = None
    stage_rate: Optional[float] = None

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def nic_Bps(self) -> float:
        return self.nic_bps / 8.0

    @property
    def flow_Bps(self) -> float:
        return self.flow_bps / 8.0

    @classmethod
    def emulated(cls, spec: str, ranks_per_host: int = 1, cores: float = 2.0,
                 background_cores: float = 0.0) -> "Cluster":
        """The emulated cloud of ``fasthorovodrun --emulate-cloud HOSTS:LINK:PER_FLOW`` on this
        machine: every host on the same cores, veth round trips (tens of µs), 16 flow buckets."""
        from fasthorovod.netem.spec import parse_spec

        s = parse_spec(spec)
        if s.uneven:
            raise ValueError(f"{spec}: the model takes even clouds only")
        return cls(hosts=s.hosts, ranks_per_host=ranks_per_host, nic_bps=s.link_bits_per_s,
                   flow_bps=s.per_flow_bits_per_s, rtt_s=5e-5, cores=cores, shared_cores=cores,
                   background_cores=background_cores, flow_buckets=16)


@dataclasses.dataclass(frozen=True)
class Plane:
    """FastHorovod's data-plane setting: k lanes (proxies per rank), S sockets per lane."""

    k: int = 4
    S: int = 1
    hierarchical: bool = False
    threshold: int = 1 << 20


# -- closed-form pieces ----------------------------------------------------------------------------


def ring_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring allreduce of n ranks: 2(n−1)/n · M."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth, bytes/s: 2(n−1)/n · M / T (nccl-tests' definition)."""
    return ring_bytes(nbytes, n) / seconds if seconds > 0 else math.inf


def ring_time(nbytes: float, n: int, rate: float, alpha: float) -> float:
    """2(n−1)·α + 2(n−1)/n · M / rate: a ring allreduce of n ranks on a ring whose slowest hop
    carries `rate` bytes/s, each of its 2(n−1) steps paying the latency α."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + ring_bytes(nbytes, n) / rate


def distinct_buckets(flows: int, buckets: Optional[int]) -> float:
    """Expected number of distinct per-flow caps `flows` flows hash into (b(1−(1−1/b)^f));
    `flows` when every flow has its own cap (buckets None)."""
    if buckets is None or flows <= 0:
        return float(max(flows, 0))
    return buckets * (1.0 - (1.0 - 1.0 / buckets) ** flows)


def network_rate(cluster: Cluster, k: int, S: int, p: Params) -> float:
    """Bytes/s a host's k lanes of S sockets can send over its NIC (rebalanced lanes: the sum)."""
    flows = k * distinct_buckets(S, cluster.flow_buckets)
    return p.goodput * min(cluster.nic_Bps, cluster.flow_Bps * flows)


def crowded_kappa(p: Params, threads: float, cores: float) -> float:
    """kappa·(1 + gamma·(m − 1)), m = busy threads per core (≥ 1)."""
    m = max(1.0, threads / cores) if cores > 0 else 1.0
    return p.kappa * (1.0 + p.gamma * (m - 1.0))


def _cpu_domain(cluster: Cluster):
    """(cores available, hosts sharing them): one host's, or the whole emulated cloud's."""
    if cluster.shared_cores is not None:
        cores, hosts = cluster.shared_cores, cluster.hosts
    else:
        cores, hosts = cluster.cores, 1
    avail = cores - cluster.background_cores - cluster.compute_cores * cluster.ranks_per_host * hosts
    return max(0.05 * cores, avail), hosts


def proxy_cpu_rate(cluster: Cluster, plane: Plane, p: Params) -> float:
    """The NIC bytes/s per host the proxies' CPU allows.

    Flat ring: every one of the P·k proxies of a host sends at the ring's pace r, k of those
    streams cross the NIC; hierarchical: P·k inter-host lanes, all of them cross the NIC. With
    T proxies per CPU domain (a host, or all hosts of the emulated cloud) on c free cores:
    r = min(eta / kappa_m, c / (T·kappa_m + N·kappa_net)), N the NIC streams in the domain."""
    cores, hosts = _cpu_domain(cluster)
    P = cluster.ranks_per_host
    threads = hosts * P * plane.k
    nic_streams = hosts * (P * plane.k if plane.hierarchical else plane.k)
    kap = crowded_kappa(p, threads, cores)
    r = min(p.eta / kap, cores / (threads * kap + nic_streams * p.kappa_net))
    return r * nic_streams / hosts


def fasthorovod_rate(cluster: Cluster, plane: Plane, p: Params) -> Dict[str, float]:
    """NIC bytes/s per host: the network's limit, the CPU's, and the smaller."""
    net = network_rate(cluster, plane.k * (cluster.ranks_per_host if plane.hierarchical else 1), plane.S, p)
    cpu = proxy_cpu_rate(cluster, plane, p)
    return {"network": net, "cpu": cpu, "rate": min(net, cpu), "bound": "cpu" if cpu < net else "network"}


def stage_seconds(nbytes: float, cluster: Cluster, p: Params) -> float:
    """Copy in and copy out of shared memory (or of the GPU)."""
    if cluster.stage_rate:
        return 2.0 * nbytes / cluster.stage_rate
    return 2.0 * nbytes * p.copy_cost


def step_latency(cluster: Cluster, alpha: float) -> float:
    """Per ring step: software α plus half a round trip when the ring leaves the host."""
    return alpha + (cluster.rtt_s / 2.0 if cluster.hosts > 1 else 0.0)


def horovod_rate(cluster: Cluster, p: Params) -> Dict[str, float]:
    """Horovod+Gloo: one flow per neighbour, one thread per rank that sends, receives and adds."""
    net = p.goodput * cluster.nic_Bps
    if cluster.hosts > 1:
        net = min(net, p.hvd_eff * p.goodput * cluster.flow_Bps)
    cores, hosts = _cpu_domain(cluster)
    threads = hosts * cluster.ranks_per_host
    kap = p.kappa_gloo * (1.0 + p.gamma * (max(1.0, threads / cores) - 1.0))
    cpu = min(1.0 / kap, cores / (threads * kap + hosts * p.kappa_net))
    return {"network": net, "cpu": cpu, "rate": min(net, cpu), "bound": "cpu" if cpu < net else "network"}


def horovod_allreduce(nbytes: float, cluster: Cluster, p: Params) -> Dict[str, float]:
    """Horovod 0.28 with Gloo: fusion-buffer copies in and out, one flat ring over n ranks."""
    n = cluster.ranks
    r = horovod_rate(cluster, p)
    t = p.t0_hvd + cluster.rtt_s + stage_seconds(nbytes, cluster, p) \
        + ring_time(nbytes, n, r["rate"], step_latency(cluster, p.alpha_hvd))
    return {"seconds": t, "busbw": busbw(nbytes, t, n), "rate": r["rate"], "bound": r["bound"]}


def fasthorovod_allreduce(nbytes: float, cluster: Cluster, plane: Plane, p: Params) -> Dict[str, float]:
    """FastHorovod: below the threshold Horovod's path; above it k lanes × S sockets per rank,
    flat (every rank in one ring per lane) or hierarchical (shared-memory reduce-scatter and
    allgather inside the host, P rings of M/P between hosts)."""
    n, P, H = cluster.ranks, cluster.ranks_per_host, cluster.hosts
    if nbytes < plane.threshold or n <= 1:
        out = horovod_allreduce(nbytes, cluster, p)
        out["path"] = "horovod"
        return out
    r = fasthorovod_rate(cluster, plane, p)
    fixed = p.t0_fh + cluster.rtt_s + stage_seconds(nbytes, cluster, p)
    lat = step_latency(cluster, p.alpha_fh)
    if plane.hierarchical and P > 1:
        local = (P - 1) / P * nbytes * (p.reduce_cost + p.copy_cost)  # every rank in parallel
        t = fixed + local + ring_time(nbytes, H, r["rate"], lat) if H > 1 else fixed + local
    else:
        t = fixed + ring_time(nbytes, n, r["rate"], lat)
    return {"seconds": t, "busbw": busbw(nbytes, t, n), "rate": r["rate"], "bound": r["bound"],
            "network_rate": r["network"], "cpu_rate": r["cpu"], "path": "proxies"}


def allgather_seconds(payload: float, cluster: Cluster, plane: Plane, p: Params) -> float:
    """A ring allgather where every rank contributes `payload` bytes: n−1 steps, each rank sends
    and receives (n−1)·payload (FastHorovod's lanes; CD-SGD's 2-bit payloads)."""
    n = cluster.ranks
    if n <= 1:
        return 0.0
    r = fasthorovod_rate(cluster, plane, p)["rate"]
    return p.t0_fh + cluster.rtt_s + (n - 1) * step_latency(cluster, p.alpha_fh) + (n - 1) * payload / r


# -- the zero-configuration rule -----------------------------------------------------------------


def probe_curve(cluster: Cluster, p: Params, max_flows: int = 32) -> Dict[int, float]:
    """What the start-up probe would measure on one hop: raw TCP with 1, 2, 4, ... flows (no
    reduction: the socket cost only), stopping once doubling gains less than 5%."""
    cores, hosts = _cpu_domain(cluster)
    curve: Dict[int, float] = {}
    f, last = 1, 0.0
    while f <= max_flows:
        net = p.goodput * min(cluster.nic_Bps, cluster.flow_Bps * distinct_buckets(f, cluster.flow_buckets))
        per_flow_cpu = p.eta / p.socket_cost
        cpu = min(f * per_flow_cpu, cores / (p.socket_cost + p.kappa_net) / hosts)
        rate = min(net, cpu)
        curve[f] = rate
        if last and rate < 1.05 * last:
            break
        last, f = rate, f * 2
    return curve


def zero_config_plane(cluster: Cluster, p: Params, k: int = 4, threshold: int = 1 << 20) -> Plane:
    """The k and S FastHorovod chooses by itself: k = FASTHOROVOD_NUM_PROXIES's default (4), S =
    ceil(knee / k), the knee being the fewest flows reaching 95% of the probe's best
    (fasthorovod/proxy/probe.py, applied to the modelled curve)."""
    from fasthorovod.proxy import probe

    if cluster.hosts <= 1:
        return Plane(k=k, S=1, threshold=8 << 20)
    choice = probe.choose([probe_curve(cluster, p)], lanes=k)
    return Plane(k=k, S=choice.sockets_per_lane, threshold=threshold)


def cpu_bound_k(cluster: Cluster, p: Params, S: Optional[int] = None, hierarchical: bool = False,
                max_k: int = 32) -> Dict[str, Optional[int]]:
    """Where proxies stop paying: ``k_fill`` the fewest proxies whose predicted rate reaches 95% of
    the largest over k = 1..max_k; ``k_cpu`` the smallest k at which the CPU, not the network,
    limits (None: never up to max_k)."""
    rates = {}
    k_cpu = None
    for k in range(1, max_k + 1):
        s = S if S is not None else max(1, math.ceil(zero_config_plane(cluster, p, k).S))
        r = fasthorovod_rate(cluster, Plane(k=k, S=s, hierarchical=hierarchical), p)
        rates[k] = r["rate"]
        if k_cpu is None and r["bound"] == "cpu":
            k_cpu = k
    best = max(rates.values())
    k_fill = min(k for k, v in rates.items() if v >= 0.95 * best)
    return {"k_fill": k_fill, "k_cpu": k_cpu, "best_rate": best}
