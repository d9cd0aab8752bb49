"""The allreduce model: ring time, flows, caps and CPU, for Horovod and FastHorovod.

Notation (lab/scale.md has the derivation):

* a job has H hosts with P ranks each, n = H·P ranks; a message of M bytes;
* a ring allreduce of n ranks takes 2(n−1) steps and every rank sends (and receives) its share of
  2(n−1)/n · M bytes, so with one chain of frames the time is ``2(n−1)·α + 2(n−1)/n · M / R``: α
  the per-step latency (half a round trip plus software per step), R the rate of the ring's slowest
  hop. The bus bandwidth 2(n−1)/n · M / T is then R for a big message. Since 2026-12-02 (evening)
  a ring is several chains of frames in flight (FastHorovod: every lane's segments; Horovod: Gloo's
  two segments), and one chain's wait overlaps the others' bytes: :func:`chains_throughput` (a
  closed network of the waits and the shared path, product form), :func:`pipeline_seconds`;
* flows: a host's NIC carries ``B`` bytes/s, one TCP flow at most ``C`` (the cloud's per-flow cap);
  one TCP flow gets a fraction ``goodput`` of its cap, many flows together ``link_goodput`` of the
  link (headers, framing, TCP sharing: the raw-TCP ring ceiling). FastHorovod runs k lanes
  (proxies) of S sockets each; a frame (one segment) travels whole on one socket, and since commit
  636c542 a ring chunk M/(k·n) is cut into at least S segments (``segment_bytes``, 1 MiB, or
  chunk/S, not below 64 KiB: :func:`ring_segment_bytes`) that go, in order, each to the socket with
  the least left to send; segment i of a step waits only for segment i of the step before, so a
  lane keeps ``a = min(S, chunk / largest frame)`` sockets' worth of flow busy (:func:`active_frames`:
  S for any chunk from S·64 KiB on, chunk/64 KiB below; before 636c542 one per 1 MiB segment,
  ``striping="first-free"``). A lane's ring moves at its slowest hop; on the emulated cloud the S sockets of a lane to one server
  port share the per-flow caps of the buckets their source ports hash into, and Linux hands out
  the source ports of successive connections 2 + 2·U{0..7} apart (:func:`port_buckets`), so each
  hop has D ≤ S distinct caps. A host's lanes carry
  ``min(link_goodput · B, goodput · C · k · E[min(a, min over hops D)])`` (lanes are rebalanced to
  their rates, so the sum is what counts);
* CPU: a proxy pays ``kappa`` CPU-seconds per wire byte it sends (the send, the matching receive,
  half a byte of adds: lab/placement.md) and each byte through the host's network stack
  ``kappa_net`` more (zero on a real NIC with offloads; on the emulated cloud its bridge, veth pairs
  and htb shapers run on the same two cores as everything else). ``kappa_lane`` of a lane's
  CPU-seconds per byte lie on its ring's critical path (a segment is received, added, and only then
  sent on). While the CPU domain is busy a fraction ρ of the time, that work waits for a core:
  1 / r = 1 / r_net + kappa_lane / (1 − ρ) per lane, with ρ = (other jobs + compute + the proxies'
  own load at rate r) / cores, solved for r (:func:`lane_rate`; M/M/1-like waiting); a proxy also
  never exceeds ``eta / kappa_m`` (placement.py's single-thread bound);
* a flat ring with P ranks per host keeps every rank's proxies as busy as the NIC's: the host's
  proxies do P times the NIC's work. A hierarchical allreduce (reduce-scatter inside the host over
  shared memory, P inter-host rings of M/P, allgather inside the host) does the NIC's work once;
* Horovod (Gloo) sends a rank's whole ring over one TCP flow per neighbour, from one thread that
  also reduces: ``R = min(hvd_eff · goodput · C, goodput · B, 1 / kappa_gloo)``.

Every function here is pure and cheap: the CLI, the projection and the tests call them directly.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Dict, Mapping, Optional

# Defaults for the CPU pieces: the placement model fitted on this machine (lab/placement.md, run 2,
# lab/results/placement-run2-2026-12-01.json); unit costs from the same run.
PLACEMENT_KAPPA = 4.41e-10
PLACEMENT_ETA = 0.919
PLACEMENT_GAMMA = 0.0945
COPY_COST = 1.10e-10       # memcpy, s/B
REDUCE_COST = 7.9e-11      # float32 add into a shard, s/B
SOCKET_COST = 2.39e-10     # loopback TCP send + receive, s/B (the probe's raw flows)
# One core of Gloo moved ~1.07 GB/s through an allreduce on 40 GbE (facebookincubator/gloo#248).
GLOO_KAPPA = 1.0 / 1.07e9
# FASTHOROVOD_SEGMENT_BYTES' default: the ring's pipelining unit, one frame on one socket.
SEGMENT_BYTES = 1 << 20
# The smallest segment the ring cuts a chunk into to give every socket of a lane a frame
# (kMinRingSegmentBytes, csrc/collectives/ring.h).
MIN_SEGMENT_BYTES = 64 << 10
# How a lane hands frames to its sockets: "least-left" (since commit 636c542, 2026-12-02 16:31 UTC:
# the socket with the least left to send, chunks cut into >= S segments) or "first-free" (before:
# the first socket the kernel takes a frame on, chunks cut into segments of segment_bytes).
STRIPING_CHANGE = "2026-12-02T16:31:51+00:00"
# Linux (>= 5.18, "tcp: add small random increments to the source port") gives the next connect()
# to the same destination the port 2 + 2·U{0..7} above the last: 1..8 steps of the emulated
# cloud's hash, which takes bits 1-4 of a port.
LINUX_PORT_STEP = 8


@dataclasses.dataclass
class Params:
    """The model's physical parameters (what `calibrate` fits; defaults are priors, see lab/scale.md)."""

    kappa: float = PLACEMENT_KAPPA
    """proxy CPU-seconds per wire byte sent, alone on a core"""
    eta: float = PLACEMENT_ETA
    """largest fraction of the time a proxy is busy (it waits on its ring neighbours otherwise)"""
    gamma: float = PLACEMENT_GAMMA
    """extra per-byte cost per additional busy thread on a core"""
    kappa_net: float = 0.0
    """extra CPU-seconds per byte through the host's network stack beyond loopback's"""
    kappa_lane: float = 0.0
    """CPU-seconds per byte on a lane's ring critical path (receive, add, send on), alone on a core"""
    copy_cost: float = COPY_COST
    reduce_cost: float = REDUCE_COST
    socket_cost: float = SOCKET_COST
    goodput: float = 0.95
    """TCP goodput of one flow as a fraction of its configured cap"""
    link_goodput: Optional[float] = None
    """goodput of a link filled by many flows, fraction of its rate (the raw-TCP ring ceiling);
    None: ``goodput``"""
    link_jitter: float = 0.0
    """coefficient of variation of a flow's share of a link it shares (a ring waits for its
    slowest hop at every step: :func:`link_share`)"""
    alpha_fh: float = 2.0e-4
    """FastHorovod: software latency per ring step, s"""
    t0_fh: float = 2.0e-3
    """FastHorovod: fixed cost per collective (submit, negotiation, doorbells, completion), s"""
    wait_cv: float = 1.0
    """FastHorovod: coefficient of variation of a chain's wait (:func:`ring_seconds`; 1: exponential)"""
    queue_bytes: Optional[float] = None
    """FastHorovod: bytes the network holds for one flow, which the lane's choice of socket does not
    see (the emulated cloud's shaper: measured from frame traces); set, the rings go socket by socket
    (:func:`socket_ring_seconds`); None (the projection): chains without sockets"""
    queue_frames: float = 0.0
    """FastHorovod, the form without sockets: a chain's frame waits this many frames' time at one flow's
    rate behind the other chains of its lane (only with more than one chain per lane; :func:`chain_wait`;
    0 unless set by hand: calibrate measures ``queue_bytes`` instead)"""
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
    emulated cloud: 16); None: every flow has its own cap. ``port_step``: successive connections of a
    lane get source ports 1..port_step buckets apart (Linux: 8, see :func:`port_buckets`); None:
    ports hash uniformly. ``stage_rate``: bytes/s of the copy
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
    port_step: Optional[int] = None

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
                   background_cores=background_cores, flow_buckets=16, port_step=LINUX_PORT_STEP)


@dataclasses.dataclass(frozen=True)
class Plane:
    """FastHorovod's data-plane setting: k lanes (proxies per rank), S sockets per lane."""

    k: int = 4
    S: int = 1
    hierarchical: bool = False
    threshold: int = 1 << 20
    segment_bytes: int = SEGMENT_BYTES
    local_overlap: bool = True
    """hierarchical: the shared-memory work overlaps the ring segment by segment (since commit
    836aa67); False: three phases one after the other (the version measured in docs/hierarchical.md)"""
    striping: str = "least-left"
    """how a lane's frames go to its sockets: "least-left" (since commit 636c542) or "first-free"
    (the data plane before it, as the model of the afternoon of 2026-12-02 described it), see
    :func:`active_frames`"""


def striping_at(date: Optional[str]) -> str:
    """The striping of a data plane measured at `date` (ISO 8601; None: today's)."""
    if not date:
        return "least-left"
    import datetime

    when = datetime.datetime.fromisoformat(date.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return "first-free" if when < datetime.datetime.fromisoformat(STRIPING_CHANGE) else "least-left"


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
    """Expected number of distinct per-flow caps `flows` flows hash into when their ports hash
    uniformly (b(1−(1−1/b)^f)); `flows` when every flow has its own cap (buckets None)."""
    if buckets is None or flows <= 0:
        return float(max(flows, 0))
    return buckets * (1.0 - (1.0 - 1.0 / buckets) ** flows)


@functools.lru_cache(maxsize=None)
def port_buckets(sockets: int, buckets: int = 16, step: Optional[int] = LINUX_PORT_STEP) -> tuple:
    """Distribution of D, the number of distinct per-flow buckets the `sockets` connections of one
    lane to one server port land in: P(D = d) for d = 0..buckets.

    step None: ports hash uniformly (occupancy of `buckets` bins). Otherwise successive source ports
    are 1..step buckets apart, uniformly (Linux's random increments of the ephemeral port; the
    emulated cloud hashes bits 1-4 of it): computed exactly over (occupied set, last bucket)."""
    if sockets <= 0:
        return tuple([1.0] + [0.0] * buckets)
    if step is None:  # P(D = d) = C(b, d) d! S2(s, d) / b^s, by recursion on the sockets
        dist = [0.0] * (buckets + 1)
        dist[1] = 1.0
        for _ in range(sockets - 1):
            nxt = [0.0] * (buckets + 1)
            for d, pr in enumerate(dist):
                if pr:
                    nxt[d] += pr * d / buckets
                    if d < buckets:
                        nxt[d + 1] += pr * (buckets - d) / buckets
            dist = nxt
        return tuple(dist)
    import numpy as np

    prob = np.zeros((1 << buckets, buckets))
    prob[1, 0] = 1.0  # the first socket's bucket, by symmetry bucket 0
    for _ in range(sockets - 1):
        nxt = np.zeros_like(prob)
        for pos in range(buckets):
            col = prob[:, pos]
            masks = np.nonzero(col)[0]
            if len(masks) == 0:
                continue
            for d in range(1, step + 1):
                new = (pos + d) % buckets
                np.add.at(nxt[:, new], masks | (1 << new), col[masks] / step)
        prob = nxt
    counts = np.array([bin(x).count("1") for x in range(1 << buckets)])
    dist = np.bincount(counts, weights=prob.sum(axis=1), minlength=buckets + 1)
    return tuple(float(x) for x in dist)


def lane_flows(sockets: int, active: float, hops: int, buckets: Optional[int],
               step: Optional[int] = LINUX_PORT_STEP) -> float:
    """Per-flow caps one lane's ring can use: E[min(active, min over `hops` hops of D)], D the
    distinct buckets of the lane's `sockets` connections on a hop (independent per hop), `active`
    the sockets its frames keep busy. Every flow its own cap (buckets None): min(active, sockets)."""
    if sockets <= 0 or active <= 0:
        return 0.0
    if buckets is None:
        return float(min(active, sockets))
    dist = port_buckets(sockets, buckets, step)
    hops = max(1, hops)
    total = 0.0
    for d in range(1, len(dist)):
        at_least = sum(dist[d:]) ** hops  # P(min over hops >= d)
        total += min(1.0, max(0.0, active - (d - 1))) * at_least
    return total


def ring_segment_bytes(chunk: float, sockets: int, segment: int = SEGMENT_BYTES) -> float:
    """The ring's segment for a chunk of `chunk` bytes on a lane of `sockets` sockets
    (RingSegmentElements, csrc/collectives/ring.cc): `segment`, or less so that the chunk has a
    segment for every socket, but not below 64 KiB: min(segment, max(chunk/S, 64 KiB)) for S > 1."""
    if sockets <= 1:
        return float(segment)
    return float(min(segment, max(chunk / sockets, MIN_SEGMENT_BYTES)))


def active_frames(nbytes: Optional[float], lanes: int, ring: int, sockets: int,
                  segment: int = SEGMENT_BYTES, striping: str = "least-left") -> float:
    """Sockets' worth of flow a lane keeps busy through a ring of `ring` ranks, for a ring chunk of
    M/(lanes·ring) bytes, each frame whole on one socket.

    "least-left" (since commit 636c542): the chunk is cut into segments of
    :func:`ring_segment_bytes` and each frame ready to go is given to the socket with the least left
    to send. Segment i of step t+1 leaves once segment i of step t has arrived, so the s segments
    are s chains of 2(n−1) frames each that wait for themselves, not for a step's other frames: a
    lane's ring takes max(2(n−1)·chunk / (S·c), 2(n−1)·f / c) on sockets of rate c, f the largest
    frame, min(segment, chunk) — the sockets' bytes or the longest chain, whichever is longer — and
    keeps a = min(S, chunk / f) sockets busy: 1 for a chunk up to 64 KiB, chunk/64 KiB up to
    S·64 KiB, S from there on (the fill and drain of the chains, a frame each, left out).
    "first-free" (before 636c542, the model of the afternoon of 2026-12-02): segments of `segment`
    bytes, a step waiting for its busiest socket's ceil(s/S) full segments:
    chunk / (ceil(s/S) · segment), one socket for any chunk up to one segment.
    nbytes None: a large message (S)."""
    if nbytes is None or sockets <= 1:
        return float(max(sockets, 0))
    chunk = nbytes / max(1, lanes) / max(1, ring)
    if chunk <= 0:
        return 1.0
    if striping == "first-free":
        s = max(1, math.ceil(chunk / segment))
        return chunk / (math.ceil(s / sockets) * min(segment, chunk))
    if striping != "least-left":
        raise ValueError(f"unknown striping {striping!r} (least-left, first-free)")
    largest = min(ring_segment_bytes(chunk, sockets, segment), chunk)
    return min(float(sockets), chunk / largest)


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables] (0 for n = 1; 0.564 for 2, 1.267 for 6)."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    x = -8.0
    while x < 8.0:
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += x * n * phi * cdf ** (n - 1) * step
        x += step
    return total


def link_share(hops: int, jitter: float) -> float:
    """Fraction of a shared link a ring of `hops` hops keeps: each step waits for its slowest hop,
    and the flows sharing a link get shares that vary by `jitter` (coefficient of variation):
    1 / (1 + jitter · E[max of hops standard normals])."""
    return 1.0 / (1.0 + max(jitter, 0.0) * expected_max_normal(max(1, hops)))


def network_rate(cluster: Cluster, k: int, S: int, p: Params, nbytes: Optional[float] = None,
                 ring: Optional[int] = None, segment: int = SEGMENT_BYTES, striping: str = "least-left") -> float:
    """Bytes/s a host's k lanes of S sockets can send over its NIC for an allreduce of `nbytes` over
    a ring of `ring` ranks (rebalanced lanes: the sum; each lane at its slowest hop)."""
    ring = cluster.ranks if ring is None else ring
    hops = cluster.hosts if cluster.hosts > 1 else 1  # the hops that leave a host (shaped, hashed)
    a = active_frames(nbytes, k, ring, S, segment, striping)
    flows = k * lane_flows(S, a, hops, cluster.flow_buckets, cluster.port_step)
    link = (p.goodput if p.link_goodput is None else p.link_goodput) * link_share(hops, p.link_jitter)
    return min(link * cluster.nic_Bps, p.goodput * cluster.flow_Bps * flows)


def unlucky_ports_probability(cluster: Cluster, plane: Plane, nbytes: Optional[float] = None) -> float:
    """Probability that some hop of the ring has two busy flows of *different* lanes in one per-flow
    bucket (the slow mode): their server ports (one per lane, random) agree in the
    hash's 4 bits with probability 1/b and their source ports with 1/b again, independently; with
    f = k·ceil(a) busy flows per hop, f(f−1)/2 − k·ceil(a)(ceil(a)−1)/2 such pairs on each of the
    ring's H hops between hosts. The model's rates are those of the lucky draw (no such pair): the median job while
    this probability is below one half; until the lanes are rebalanced, an unlucky job waits for
    the lanes that share a cap. 0 on a cloud that caps every flow on its own (buckets None)."""
    b = cluster.flow_buckets
    if b is None or cluster.hosts <= 1:
        return 0.0
    nic_lanes, _, ring = _plane_shape(cluster, plane)
    a = math.ceil(active_frames(nbytes, nic_lanes, ring, plane.S, plane.segment_bytes, plane.striping) - 1e-9)
    f = nic_lanes * a
    pairs = f * (f - 1) / 2 - nic_lanes * a * (a - 1) / 2
    hops = cluster.hosts  # the ring's hops that leave a host
    return 1.0 - (1.0 - 1.0 / (b * b)) ** (pairs * hops)


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


def lane_rate(net: float, serial: float, load: float, busy: float, cores: float) -> float:
    """A lane's pace r (bytes/s) from 1/r = 1/net + serial/(1 − ρ), ρ = (busy + load·r)/cores:
    `serial` CPU-seconds per byte on the lane's critical path, `load` CPU-seconds per byte of pace r
    that the whole CPU domain spends (all its proxies and NIC streams), `busy` cores already taken.
    The smaller root of A·L·r² − (L + A(1 − b) + s)·r + (1 − b) = 0 (A = 1/net, L = load/cores,
    b = busy/cores, s = serial): the one with ρ < 1."""
    b = min(max(busy / cores, 0.0), 0.95)
    L = max(load, 0.0) / cores
    s = max(serial, 0.0)
    A = 1.0 / net if net > 0 else 0.0
    if A == 0.0 and L == 0.0 and s == 0.0:
        return math.inf
    q = L + A * (1.0 - b) + s
    disc = max(q * q - 4.0 * A * L * (1.0 - b), 0.0)
    return 2.0 * (1.0 - b) / (q + math.sqrt(disc))


def _plane_shape(cluster: Cluster, plane: Plane):
    """(lanes per host on the NIC, proxies per host, ring size) of a data plane."""
    P = cluster.ranks_per_host
    if plane.hierarchical and P > 1:
        return P * plane.k, P * plane.k, cluster.hosts
    return plane.k, P * plane.k, cluster.ranks


def fasthorovod_rate(cluster: Cluster, plane: Plane, p: Params, nbytes: Optional[float] = None) -> Dict[str, float]:
    """NIC bytes/s per host: the network's limit, the rate its CPU lets the lanes reach, and the rate.

    Each of the N lanes on a host's NIC runs at r: 1/r = 1/(net/N) + kappa_lane/(1 − ρ), and a
    host's proxies spend (T·kappa_m + N·kappa_net)·r CPU-seconds per second (T proxies: a flat ring
    with P ranks per host keeps all P·k at the ring's pace, k of them on the NIC; hierarchical: P·k
    lanes, all on the NIC). kappa_m = kappa·(1 + gamma·(m − 1)) with m the proxies per core that
    want a core (each runs r·kappa_m of the time and waits 1/(1 − ρ) as long: all of them on a
    saturated CPU, few when they mostly wait on the network), and no proxy exceeds eta/kappa_m. ``cpu`` is the rate with an infinitely
    fast network (the CPU's ceiling); ``bound`` says which of the two costs more time per byte."""
    cores, hosts = _cpu_domain(cluster)
    nic_lanes, proxies, ring = _plane_shape(cluster, plane)
    net = network_rate(cluster, nic_lanes, plane.S, p, nbytes, ring, plane.segment_bytes, plane.striping)
    busy = 0.0  # other jobs and compute are already taken out of `cores` (_cpu_domain)

    def pace(lane_net: float) -> float:
        # crowding counts the proxies that want a core, not those waiting on the network: each runs
        # r·kappa_m of the time and waits for a core 1/(1 − ρ) as long (a fixed point, a few rounds)
        kap, r = p.kappa, 0.0
        for _ in range(12):
            load = hosts * (proxies * kap + nic_lanes * p.kappa_net)
            single = p.eta / kap if kap > 0 else math.inf
            r = min(lane_rate(lane_net, p.kappa_lane, load, busy, cores), single)
            if not math.isfinite(r):
                busy_threads = hosts * proxies
            else:
                rho = min(0.999, load * r / cores)
                busy_threads = hosts * proxies * min(1.0, r * kap / (1.0 - rho))
            new = crowded_kappa(p, busy_threads, cores)
            if abs(new - kap) <= 1e-6 * kap:
                break
            kap = new
        return r

    rate = pace(net / nic_lanes) * nic_lanes
    cpu = pace(math.inf) * nic_lanes
    bound = "cpu" if cpu < net else "network"
    return {"network": net, "cpu": cpu, "rate": rate, "bound": bound}


def proxy_cpu_rate(cluster: Cluster, plane: Plane, p: Params) -> float:
    """The NIC bytes/s per host the proxies' CPU allows with an infinitely fast network."""
    return fasthorovod_rate(dataclasses.replace(cluster, nic_bps=1e18, flow_bps=1e18), plane, p)["cpu"]


def stage_seconds(nbytes: float, cluster: Cluster, p: Params) -> float:
    """Copy in and copy out of shared memory (or of the GPU)."""
    if cluster.stage_rate:
        return 2.0 * nbytes / cluster.stage_rate
    return 2.0 * nbytes * p.copy_cost


def step_latency(cluster: Cluster, alpha: float) -> float:
    """Per ring step: software α plus half a round trip when the ring leaves the host."""
    return alpha + (cluster.rtt_s / 2.0 if cluster.hosts > 1 else 0.0)



# -- rings as chains of frames (a pipeline) ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A ring's traffic through one host's path as `chains` chains of frames in flight.

    A chain sends a frame of `frame_bytes`, then waits (the step's latency: a frame's last byte
    reaching the neighbour, a wake-up, the next frame's first) before it sends its next one; the
    chains share the path, which moves ``rates[j − 1]`` bytes/s while j of them are transferring.
    `frames`: the frames of all the chains together."""

    frames: float
    chains: int
    frame_bytes: float
    rates: tuple

    @property
    def rate(self) -> float:
        """The path's rate with every chain transferring (the bytes-only limit)."""
        return self.rates[-1]


def chains_throughput(chains: int, frame_bytes: float, wait: float, rates) -> float:
    """Frames per second of `chains` chains, each alternating a frame of `frame_bytes` on a shared path
    (``rates[j − 1]`` bytes/s in all while j transfer, shared equally) with a wait of `wait` seconds.

    A closed network of two stations: the wait (every chain its own: an infinite server) and the
    path (processor sharing with a load-dependent rate). Its stationary distribution has product
    form and depends on the two times only through their means (BCMP):
    P(j transferring) ∝ wait^(C−j)/(C−j)! · Π_{i≤j} frame_bytes/rates[i−1], and the throughput is
    Σ_j P(j) · rates[j−1]/frame_bytes. Closed forms: one chain, 1/(wait + frame_bytes/rate) (the
    latency and the bytes in series); no wait, rates[C−1]/frame_bytes (the bytes only); many chains,
    the path's rate (the latency hidden)."""
    if chains <= 0 or frame_bytes <= 0:
        return math.inf
    if wait <= 0:
        return rates[chains - 1] / frame_bytes
    logs = []
    acc = 0.0
    for j in range(chains + 1):
        if j > 0:
            acc += math.log(frame_bytes / rates[j - 1])
        logs.append((chains - j) * math.log(wait) - math.lgamma(chains - j + 1) + acc)
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    busy = sum(w * rates[j - 1] for j, w in enumerate(weights) if j > 0)
    return busy / frame_bytes / sum(weights)


def pipeline_seconds(pipe: Pipeline, wait: float) -> float:
    """Time for a pipeline's frames when each chain waits `wait` between its frames (see
    :func:`chains_throughput`; the fill and drain left out)."""
    if pipe.frames <= 0:
        return 0.0
    return pipe.frames / chains_throughput(pipe.chains, pipe.frame_bytes, wait, pipe.rates)


# A ring's chains from their common start (2026-12-03): the expected time of a finite ring whose chains
# all send their first frame at once, each then alternating a random wait with a frame, the collective
# ending with its slowest chain. Estimated by a seeded event-by-event run of many draws at once
# (common random numbers: the same unit draws for every wait, so the time is a smooth, increasing
# function of the mean wait, as a fit needs).
WAIT_CV = 1.0
"""default coefficient of variation of a chain's wait (1: exponential, the closed network's own
assumption; 0: every wait the mean, the chains in lockstep)"""
START_DRAWS = 128
START_MAX_FRAMES = 4096
"""above this many frames (chains × steps) the ring is long enough for its chains to mix: the closed
network's steady state (:func:`pipeline_seconds`) plus the start's and the end's cost is used instead"""


@functools.lru_cache(maxsize=32)
def _unit_waits(draws: int, chains: int, steps: int, cv: float):
    import numpy as np

    if cv <= 0:
        return np.ones((draws, chains, steps))
    rng = np.random.default_rng(20261203)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / shape, size=(draws, chains, steps))


@functools.lru_cache(maxsize=200_000)
def _ring_from_start(chains: int, steps: int, frame_bytes: float, rates: tuple, wait: float, cv: float,
                     draws: int) -> float:
    import numpy as np

    C, s = chains, steps
    per_of = np.concatenate([[0.0], np.asarray(rates, float) / np.arange(1, C + 1)])  # each of j transferring
    waits = wait * _unit_waits(draws, C, s, cv)
    left = np.full((draws, C), float(frame_bytes))  # bytes left of the frame in transfer
    phase = np.zeros((draws, C), np.int8)            # 0 transferring, 1 waiting, 2 done
    wake = np.full((draws, C), np.inf)
    sent = np.zeros((draws, C), np.int64)
    now = np.zeros(draws)
    end = np.zeros((draws, C))
    tiny = frame_bytes * 1e-9
    for _ in range(4 * C * s + 8):
        moving = phase == 0
        per = per_of[moving.sum(1)]
        with np.errstate(divide="ignore", invalid="ignore"):
            t_tx = np.where(per > 0, np.where(moving, left, np.inf).min(1) / per, np.inf)
        t_wake = np.where(phase == 1, wake, np.inf).min(1) - now
        dt = np.minimum(t_tx, t_wake)
        live = np.isfinite(dt)
        if not live.any():
            break
        dt = np.where(live, dt, 0.0)
        now = now + dt
        left = left - np.where(moving, (per * dt)[:, None], 0.0)
        arrived = moving & (left <= tiny)
        if arrived.any():
            w = np.take_along_axis(waits, np.minimum(sent, s - 1)[:, :, None], 2)[:, :, 0]
            sent = sent + arrived
            phase = np.where(arrived, 1, phase)
            wake = np.where(arrived, now[:, None] + w, wake)
        woke = (phase == 1) & (wake <= now[:, None] * (1 + 1e-12) + 1e-15)
        if woke.any():
            last = woke & (sent >= s)
            end = np.where(last, wake, end)
            phase = np.where(last, 2, np.where(woke, 0, phase)).astype(np.int8)
            left = np.where(woke & ~last, float(frame_bytes), left)
            wake = np.where(woke, np.inf, wake)
    return float(end.max(1).mean())


def ring_seconds(pipe: "Pipeline", wait: float, cv: float = WAIT_CV, draws: int = START_DRAWS) -> float:
    """Expected time of a ring's chains from their common start to the end of the slowest chain.

    The ring queues the first step's frames of every chain at once (csrc/collectives/ring.cc,
    Execute), a step's frames are equal (RingSegmentElements) and the path shares its rate among
    the frames in transfer, so the chains start in lockstep; each chain then sends its
    `pipe.frames / pipe.chains` frames, each followed by a wait (mean `wait`, coefficient of
    variation `cv`: gamma distributed), and the collective ends with its last chain. Closed forms
    (tests): every wait its mean (cv 0) keeps the chains in lockstep, steps × (chains × frame /
    rates[-1] + wait), the old series form; one chain, steps × (wait + frame / rates[0]) whatever cv;
    no wait, the bytes over the path's rate; and as the steps grow the time per step tends to the
    closed network's (:func:`pipeline_seconds`), which leaves out the start (all chains in transfer,
    then all waiting) and the end (the slowest of the chains, each a sum of random waits).
    Rings of more than ``START_MAX_FRAMES`` frames: the steady state plus one step's worth of the
    difference between lockstep and steady state (their start and end)."""
    if pipe.frames <= 0:
        return 0.0
    C = max(1, int(pipe.chains))
    steps = max(1, int(round(pipe.frames / C)))
    if wait <= 0:
        return pipe.frames * pipe.frame_bytes / pipe.rates[-1]
    if C * steps > START_MAX_FRAMES:
        steady = pipeline_seconds(pipe, wait)
        lockstep = steps * (C * pipe.frame_bytes / pipe.rates[-1] + wait)
        return steady + max(0.0, lockstep - steady) / steps
    rates = tuple(float(r) for r in pipe.rates)
    return _ring_from_start(C, steps, float(pipe.frame_bytes), rates, float(wait), float(cv), int(draws))


def lane_chains(chunk: float, sockets: int, segment: int = SEGMENT_BYTES, striping: str = "least-left") -> int:
    """Independent chains of frames a lane's ring runs for a chunk: "least-left" (since 636c542) one
    per segment of :func:`ring_segment_bytes` (segment i of step t+1 waits only for segment i of step
    t); "first-free" (before) one: a step of the lane waited for its busiest socket, so the lane's
    segments moved together."""
    if chunk <= 0:
        return 1
    if striping == "first-free":
        return 1
    seg = min(ring_segment_bytes(chunk, sockets, segment), chunk)
    return max(1, math.ceil(chunk / seg - 1e-9))


def fasthorovod_pipeline(cluster: Cluster, plane: Plane, p: Params, nbytes: float,
                         rate: Optional[float] = None) -> Pipeline:
    """A FastHorovod ring through one host's NIC as chains of frames: the N lanes on the NIC each run
    :func:`lane_chains` chains over the ring's 2(ring − 1) steps, a frame being chunk/chains bytes
    (chunk = M/(N·ring)). With j frames transferring the host moves min(R, min(j, f)·c): R the
    lanes' rate (:func:`fasthorovod_rate`: the network, the CPU), f the per-flow caps the lanes use
    (:func:`network_rate`'s k·E[min(a, min_hops D)]), c one flow's goodput. With no wait it takes
    2(ring−1)/ring · M / R, as :func:`ring_time` with α = 0."""
    nic_lanes, _, ring = _plane_shape(cluster, plane)
    if rate is None:
        rate = fasthorovod_rate(cluster, plane, p, nbytes)["rate"]
    chunk = nbytes / nic_lanes / ring
    per_lane = lane_chains(chunk, plane.S, plane.segment_bytes, plane.striping)
    chains = nic_lanes * per_lane
    hops = cluster.hosts if cluster.hosts > 1 else 1
    a = active_frames(nbytes, nic_lanes, ring, plane.S, plane.segment_bytes, plane.striping)
    flows = nic_lanes * lane_flows(plane.S, a, hops, cluster.flow_buckets, cluster.port_step)
    one = p.goodput * min(cluster.flow_Bps, cluster.nic_Bps)
    per_chain = one * max(1.0, flows / chains)  # "first-free": a lane's one chain on its a sockets
    rates = tuple(min(rate, j * per_chain, flows * one) for j in range(1, chains + 1))
    rates = rates[:-1] + (rate,)  # every chain transferring: the lanes' rate, as without waits
    steps = 2 * (ring - 1)
    return Pipeline(frames=steps * chains, chains=chains, frame_bytes=chunk / per_lane, rates=rates)


# Gloo's ring allreduce (gloo/allreduce.cc, ring()): segments of min(ceil(M / 2n), 1 MiB)
# (AllreduceOptions' kMaxSegmentSize), two in flight (it waits for segment i − 2 before it posts i).
GLOO_SEGMENT_BYTES = 1 << 20
GLOO_IN_FLIGHT = 2


def horovod_pipeline(nbytes: float, cluster: Cluster, p: Params, rate: Optional[float] = None) -> Pipeline:
    """Horovod+Gloo's ring as chains: one thread per rank with two segments in flight on one flow
    per neighbour (Gloo's double buffering), each segment min(M/(2n), 1 MiB): the flow at R_H
    (:func:`horovod_rate`) whether one or two are transferring. Without waits 2(n−1)/n · M / R_H;
    with only waits (M/2n ≤ 1 MiB: 4(n−1) segments) 2(n−1)·wait, the old model's latency count."""
    n = cluster.ranks
    if rate is None:
        rate = horovod_rate(cluster, p)["rate"]
    seg = min(nbytes / (2 * n), GLOO_SEGMENT_BYTES)
    return Pipeline(frames=ring_bytes(nbytes, n) / seg, chains=GLOO_IN_FLIGHT, frame_bytes=seg,
                    rates=(rate,) * GLOO_IN_FLIGHT)


def chain_wait(cluster: Cluster, plane: Plane, p: Params, nbytes: float) -> float:
    """A FastHorovod chain's mean wait between two of its frames: α plus half a round trip
    (:func:`step_latency`) plus, in the form without sockets and when a lane runs more than one chain,
    q = ``p.queue_frames`` frames at one flow's rate: the frame waits behind another chain's frame on
    its socket (with ``p.queue_bytes`` known the socket-by-socket ring has that wait in it, and q is
    not added) (the lane
    gives it to the socket with the least unsent bytes and cannot see what the network still holds;
    lab/scale.md, lab/sim/waits.py)."""
    lat = step_latency(cluster, p.alpha_fh)
    if p.queue_frames <= 0 or (p.queue_bytes is not None and plane.striping == "least-left"):
        return lat  # the socket-by-socket ring (socket_ring_seconds) has the queueing in it
    nic_lanes, _, ring = _plane_shape(cluster, plane)
    chunk = nbytes / nic_lanes / ring
    per_lane = lane_chains(chunk, plane.S, plane.segment_bytes, plane.striping)
    if per_lane <= 1:
        return lat
    one = p.goodput * min(cluster.flow_Bps, cluster.nic_Bps)
    return lat + p.queue_frames * chunk / per_lane / one


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
    t = p.t0_hvd + cluster.rtt_s + stage_seconds(nbytes, cluster, p)
    if n > 1:
        t += pipeline_seconds(horovod_pipeline(nbytes, cluster, p, r["rate"]), step_latency(cluster, p.alpha_hvd))
    return {"seconds": t, "busbw": busbw(nbytes, t, n), "rate": r["rate"], "bound": r["bound"]}


def local_phase_seconds(nbytes: float, cluster: Cluster, plane: Plane, p: Params) -> float:
    """The hierarchical allreduce's shared-memory work that the ring does not hide: lane j's proxy
    of each of the P local ranks adds the other P−1 ranks' copies of its 1/P of the lane's shard
    and copies the other P−1 parts in: (P−1)/P · M/k bytes of adds and of copies per proxy, all
    P·k proxies of a host at once (bounded by the CPU domain's cores). As three phases one after
    the other (plane.local_overlap False: proxy.cc before 836aa67) all of it; overlapped with the
    ring segment by segment (since 836aa67) the first step's adds and the last step's copies, 1/H."""
    P = cluster.ranks_per_host
    if not plane.hierarchical or P <= 1:
        return 0.0
    per_proxy = (P - 1) / P * nbytes / plane.k * (p.reduce_cost + p.copy_cost)
    cores, hosts = _cpu_domain(cluster)
    proxies = hosts * P * plane.k
    total = per_proxy * max(1.0, proxies / cores)
    return total / cluster.hosts if plane.local_overlap and cluster.hosts > 1 else total


SOCKET_DRAWS = 48
SOCKET_MAX_FRAMES = 2048


@functools.lru_cache(maxsize=100_000)
def _ring_on_sockets(lanes: int, per_lane: int, sockets: int, steps: int, frame: float, rates: tuple, wait: float,
                     cv: float, held: float, draws: int) -> float:
    import heapq
    import random

    S, C, NS = sockets, lanes * per_lane, lanes * sockets
    shape = 1.0 / (cv * cv) if cv > 0 else 0.0
    total = 0.0
    for d in range(draws):
        rng = random.Random(20261203 + d)

        def draw() -> float:
            if wait <= 0:
                return 0.0
            return wait if cv <= 0 else rng.gammavariate(shape, wait / shape)

        queue = [[] for _ in range(NS)]   # per socket, first in first out: [chain, bytes left]
        queued = [0.0] * NS
        sent = [0] * C
        end = 0.0
        for c in range(C):  # the first step, queued at once: the lane counts what it just gave each socket
            lane = c // per_lane
            k = min(range(lane * S, lane * S + S), key=lambda j: (queued[j], j))
            queue[k].append([c, frame])
            queued[k] += frame
        wakes = []
        now = 0.0
        while True:
            busy = [k for k in range(NS) if queue[k]]
            per = rates[len(busy) - 1] / len(busy) if busy else 0.0
            t_done = now + min(queue[k][0][1] for k in busy) / per if busy else math.inf
            t_wake = wakes[0][0] if wakes else math.inf
            if t_done == math.inf and t_wake == math.inf:
                break
            t = min(t_done, t_wake)
            moved = per * (t - now)
            for k in busy:
                queue[k][0][1] -= moved
                queued[k] -= moved
            now = t
            if t_done <= t_wake:
                for k in busy:
                    if queue[k][0][1] <= frame * 1e-9:
                        c = queue[k].pop(0)[0]
                        queued[k] = sum(x[1] for x in queue[k])
                        sent[c] += 1
                        if sent[c] < steps:
                            heapq.heappush(wakes, (now + draw(), c))
                        else:
                            end = max(end, now + draw())
            else:
                _, c = heapq.heappop(wakes)
                lane = c // per_lane
                # the socket with the least unsent bytes: what the network holds (up to `held`) is not seen
                k = min(range(lane * S, lane * S + S), key=lambda j: (max(0.0, queued[j] - held), j))
                queue[k].append([c, frame])
                queued[k] += frame
        total += end
    return total / draws


def socket_ring_seconds(cluster: Cluster, plane: Plane, p: Params, nbytes: float, rate: float, wait: float) -> float:
    """A FastHorovod ring through one host's path, socket by socket (2026-12-03): each lane's chains
    (:func:`lane_chains`) hand their frames to the lane's S sockets, one frame after the other on a
    socket (first in first out), the busy sockets sharing the path (j busy: min(R, j·c) in all, R
    the lanes' rate, c one flow's goodput), and a chain's next frame leaves a wait (mean `wait`,
    coefficient of variation ``p.wait_cv``) after its previous frame arrived. The lane gives a frame
    to the socket with the least unsent bytes, and what the network already holds for a flow (up to
    ``p.queue_bytes``) does not count as unsent: with frames below that, a frame goes to the first
    socket even when it still carries another chain's frame, and waits for it — the wait the frame
    traces show (lab/sim/waits.py); the first step's frames, queued together, are spread
    over the sockets. From the common start to the slowest chain, as :func:`ring_seconds`; the mean
    of ``SOCKET_DRAWS`` seeded draws. Rings of more than ``SOCKET_MAX_FRAMES`` frames: ring_seconds."""
    pipe = fasthorovod_pipeline(cluster, plane, p, nbytes, rate)
    nic_lanes, _, ring = _plane_shape(cluster, plane)
    per_lane = max(1, int(round(pipe.chains / nic_lanes)))
    steps = max(1, int(round(pipe.frames / pipe.chains)))
    if pipe.frames > SOCKET_MAX_FRAMES or p.queue_bytes is None:
        return ring_seconds(pipe, wait, p.wait_cv)
    one = p.goodput * min(cluster.flow_Bps, cluster.nic_Bps)
    NS = nic_lanes * plane.S
    rates = tuple(min(rate, j * one) for j in range(1, NS)) + (rate,)
    return _ring_on_sockets(nic_lanes, per_lane, plane.S, steps, float(pipe.frame_bytes), rates, float(wait),
                            float(p.wait_cv), float(p.queue_bytes), SOCKET_DRAWS)


def fasthorovod_ring_seconds(cluster: Cluster, plane: Plane, p: Params, nbytes: float, rate: float,
                             wait: float) -> float:
    """The ring's time at the lanes' rate and a chain's mean wait: socket by socket
    (:func:`socket_ring_seconds`) when the network's hold on a flow is known (``p.queue_bytes``, the
    emulated cloud's, from frame traces) and the lane stripes "least-left"; otherwise the chains
    from their common start (:func:`ring_seconds`)."""
    if p.queue_bytes is not None and plane.striping == "least-left":
        return socket_ring_seconds(cluster, plane, p, nbytes, rate, wait)
    return ring_seconds(fasthorovod_pipeline(cluster, plane, p, nbytes, rate), wait, p.wait_cv)


def fasthorovod_allreduce(nbytes: float, cluster: Cluster, plane: Plane, p: Params) -> Dict[str, float]:
    """FastHorovod: below the threshold Horovod's path; above it k lanes × S sockets per rank,
    flat (every rank in one ring per lane) or hierarchical (shared-memory reduce-scatter, one ring of
    M/P per local rank across the H hosts, shared-memory allgather: :func:`local_phase_seconds`;
    all P·k lanes of a host on its NIC)."""
    n, P = cluster.ranks, cluster.ranks_per_host
    if nbytes < plane.threshold or n <= 1:
        out = horovod_allreduce(nbytes, cluster, p)
        out["path"] = "horovod"
        return out
    r = fasthorovod_rate(cluster, plane, p, nbytes)
    fixed = p.t0_fh + cluster.rtt_s + stage_seconds(nbytes, cluster, p)
    lat = chain_wait(cluster, plane, p, nbytes)
    # the ring as chains of frames from their common start (ring_seconds; socket by socket where the network's
    # hold on a flow is known, socket_ring_seconds): one chain's wait overlaps the others' bytes once they are
    # out of step, and the collective ends with the slowest; hierarchical: each host's NIC carries 2(H−1)/H · M
    # (its P rings of M/P), at r["rate"] in all
    ring = fasthorovod_ring_seconds(cluster, plane, p, nbytes, r["rate"], lat)
    if plane.hierarchical and P > 1:
        t = fixed + local_phase_seconds(nbytes, cluster, plane, p) + ring
    else:
        t = fixed + ring
    return {"seconds": t, "busbw": busbw(nbytes, t, n), "rate": r["rate"], "bound": r["bound"],
            "network_rate": r["network"], "cpu_rate": r["cpu"], "path": "proxies",
            "p_unlucky_ports": unlucky_ports_probability(cluster, plane, nbytes)}


def allgather_seconds(payload: float, cluster: Cluster, plane: Plane, p: Params) -> float:
    """A ring allgather where every rank contributes `payload` bytes: n−1 steps, each rank sends
    and receives (n−1)·payload (FastHorovod's lanes; CD-SGD's 2-bit payloads)."""
    n = cluster.ranks
    if n <= 1:
        return 0.0
    r = fasthorovod_rate(cluster, dataclasses.replace(plane, hierarchical=False), p, n * payload)["rate"]
    return p.t0_fh + cluster.rtt_s + (n - 1) * step_latency(cluster, p.alpha_fh) + (n - 1) * payload / r


# -- the zero-configuration rule -----------------------------------------------------------------


def probe_curve(cluster: Cluster, p: Params, max_flows: int = 32) -> Dict[int, float]:
    """What the start-up probe would measure on its slowest hop: raw TCP with 1, 2, 4, ... flows to
    one port (no reduction: the socket cost only), stopping once doubling gains less than 5%."""
    cores, hosts = _cpu_domain(cluster)
    curve: Dict[int, float] = {}
    f, last = 1, 0.0
    while f <= max_flows:
        link = p.goodput if p.link_goodput is None else p.link_goodput
        caps = lane_flows(f, f, cluster.hosts, cluster.flow_buckets, cluster.port_step)
        net = min(link * cluster.nic_Bps, p.goodput * cluster.flow_Bps * caps)
        per_flow_cpu = p.eta / p.socket_cost
        cpu = min(f * per_flow_cpu, cores / (p.socket_cost + p.kappa_net) / hosts)
        rate = min(net, cpu)
        curve[f] = rate
        if last and rate < 1.05 * last:
            break
        last, f = rate, f * 2
    return curve


def zero_config_plane(cluster: Cluster, p: Params, k: Optional[int] = None, threshold: int = 1 << 20) -> Plane:
    """The k and S FastHorovod chooses by itself (fasthorovod/proxy/probe.py, applied to the modelled
    probe curve): k from ``probe.choose_lanes`` (the curve's best rate over the host's rings, at
    least 4, above that at most the cores per rank) unless `k` is given, as FASTHOROVOD_NUM_LANES
    would be; S = ceil(knee / k), the knee being the fewest flows reaching 95% of the best."""
    from fasthorovod.proxy import probe

    if cluster.hosts <= 1:
        return Plane(k=k or probe.MIN_LANES, S=1, threshold=8 << 20)
    curve = probe_curve(cluster, p)
    if k is None:
        cores = cluster.shared_cores if cluster.shared_cores is not None else cluster.cores
        k = probe.choose_lanes(max(curve.values()), cores / cluster.ranks_per_host, cluster.ranks_per_host)
    choice = probe.choose([curve], lanes=k)
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
