"""Choosing the number of TCP flows from the path probe's measurements.

At start-up every rank measures its incoming ring hop with 1, 2, 4, ... parallel flows
(``_C.PathProbe``, csrc/transport/probe.h) and the ranks exchange their curves. Every rank then
runs :func:`choose` on the same curves, so they agree without another round:

* a hop's *knee* is the fewest flows whose aggregate reaches ``KNEE`` (95%) of that hop's best:
  more flows stop paying there. The job's knee is the largest of the hops' knees: the hop that
  needs the most flows to fill its link decides (a ring runs at its slowest hop's pace). Taking
  each hop's knee, rather than the knee of the lowest aggregate at each flow count, keeps one
  disturbed phase (a CPU stall on one rank during its 8-flow phase, seen under load as
  ``4: 726, 8: 742, 16: 397`` on a cloud whose knee is 8) from pulling the choice down: noise
  only ever lowers a phase, and a lower later phase lowers only that hop's knee. The job's curve
  (the lowest aggregate of any hop at each flow count, a hop that stopped doubling taken as flat
  beyond it) is what rank 0 prints;
* the lanes: :func:`choose_lanes` (unless FASTHOROVOD_NUM_LANES is set). A lane is one proxy,
  one thread: it carries at most about one core's worth of TCP and reduction work
  (``LANE_BYTES_PER_SECOND``, the lowest rate a proxy alone on a core reached in
  lab/placement.md's runs). Below four lanes nothing is saved where the network is the limit: on
  4:1gbit:200mbit, where one proxy's CPU could carry the whole link, 1 x 8 reached 0.785 Gbit/s,
  2 x 4 0.794 and 4 x 2 0.82-0.85 (docs/dataplane.md, "Against the ceiling"), so ``MIN_LANES``
  is 4. More lanes only where the probe's best rate needs more than four lanes' CPU, and never
  more than the CPUs each worker has (the fewest over the ranks: every rank must run the same k);
* the sockets per lane are the knee's flows spread over the lanes (times ``HEADROOM``, 1.0: no flows beyond the knee). The knee, a power of two,
  already carries some spare: on 4:1gbit:200mbit five flows would fill the link and the knee is
  eight, so a flow that gets less than its cap (two flows hashed onto one bucket of a shaper or one
  ECMP path; docs/benchmarks.md) leaves the link full; within a lane frames go to
  whichever socket is free, and between lanes rebalancing (balance.py) evens out the rest. With
  this choice ten identical AlexNet jobs ran within 6% of each other (docs/benchmarks.md).
* a phase measures 0.15 s, and one disturbed phase can also *raise* a hop's knee: on
  4:1gbit:200mbit a hop measured ``4: 730, 8: 834, 16: 919`` (knee 16) where the other three
  measured knee 8, and the job ran with 4 sockets per lane, about 10% slower than with 2 (make bench,
  2026-12-02: 2 of 3 jobs). So when the hops' knees :func:`disagree`, the ranks probe once more and
  each hop keeps, per flow count, the better of its two measurements (:func:`merge`; noise only
  lowers a phase). A hop that really needs more flows measures so twice and still decides. The
  second probe measures only the count one doubling below the highest knee
  (:func:`disputed_flows`: 8 when the knees are 8 and 16), not the whole doubling again: on
  6:1gbit:200mbit the hops disagreed in 4 of 6 jobs, whose probes took 3.2-3.7 s with the whole
  doubling again and 2.6-2.9 s with the counts from the lowest knee to the highest; with the
  changes of 2026-12-03 evening (this count rule, the second probe's port exchanged with the
  first curves, no drain at the end of a probe) a probe that runs twice takes 1.66-1.76 s there
  (docs/dataplane.md).
* a phase can also read *high*: a shaper that idled during a disturbed phase has saved up tokens,
  and the next phase gets them as a burst. On 4:1gbit:200mbit one hop measured
  ``8: 926, 16: 907, 32: 978`` Mbit/s (above what a 1 Gbit/s link carries as TCP payload) where the
  other hops' best was 911-933; with 95% of 978 as its target that hop's knee was 32 and the job ran
  with 8 sockets per lane (A/B of 2026-12-03, 1 job of 6). So a hop's target is 95% of the lower of
  its own best and the best of any *other* hop (:func:`hop_knees`): the ring runs at its slowest
  hop's pace, and flows that only reach what no other hop can carry do not pay. A slow hop still
  decides (its own best is the lower one), and a hop's low phase lowers no other hop's target.
* with re-hashing on (the default), a phase that reads a little low where its flows, each at one
  flow's rate, would fill the link is taken for what it most likely is, flows that hashed into one
  per-flow bucket, which the rings' re-hashing mends and the probe's own connections cannot: such
  a hop's knee is the fewest flows that one flow's rate says fill it (:func:`capped_knee`), where
  one flow carries less than half of the target (the flows are capped, not the link) and those
  flows measured at least ``SLOW_PHASE`` of the target (a large shortfall, as where the buckets
  are fewer than the flows, is left to the measured knee). On a 64-bucket cloud
  (4:1gbit:200mbit,buckets=64) the 8-flow phase read 5-7% low on one or two hops, twice, and the
  knee was 16; with this rule the probe chose 4 x 2, as fast as 4 x 4 (1.00x-1.02x in two
  invocations) on 33 connections per rank instead of 49 (docs/benchmarks.md, "Identical jobs").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from fasthorovod.config import MAX_LANES

KNEE = 0.95
SLOW_PHASE = 0.8  # capped_knee: the least a phase must reach of its target to pass for a collision
HEADROOM = 1.0
MAX_FLOWS = 32  # the probe's upper end; the doubling stops earlier at the knee
MIN_LANES = 4
LANE_BYTES_PER_SECOND = 1.0e9  # wire bytes/s one proxy carries on a core of its own (placement.md: 1.0-2.1 GB/s)


@dataclasses.dataclass(frozen=True)
class FlowChoice:
    """What the probe measured and what was chosen from it."""

    sockets_per_lane: int
    knee_flows: int
    curve: Dict[int, float]  # flows -> bytes/s of the slowest hop
    hops: List[Dict[int, float]]  # per receiving rank: flows -> bytes/s of its incoming hop

    def describe(self) -> str:
        points = ", ".join(f"{n}: {mbit(rate)}" for n, rate in sorted(self.curve.items()))
        return (f"slowest hop carries {points} Mbit/s with 1, 2, 4, ... flows; knee at {self.knee_flows} "
                f"flow{'s' if self.knee_flows > 1 else ''}")


def mbit(bytes_per_second: float) -> str:
    return f"{bytes_per_second * 8e-6:.0f}"


def hop_curve(phases: Sequence[dict]) -> Dict[int, float]:
    """flows -> aggregate bytes/s from one hop's probe phases (``_C.PathProbe.run``'s result)."""
    return {int(p["flows"]): float(p["bytes_per_second"]) for p in phases}


def ring_curve(hops: Sequence[Dict[int, float]]) -> Dict[int, float]:
    """At each flow count any hop measured, the lowest aggregate over the hops (flat beyond a hop's
    last measurement)."""
    if not hops or any(not hop for hop in hops):
        raise ValueError("every hop needs at least one measurement")
    counts = sorted({n for hop in hops for n in hop})

    def at(hop: Dict[int, float], n: int) -> float:
        below = [m for m in hop if m <= n]
        return hop[max(below)] if below else 0.0

    return {n: min(at(hop, n) for hop in hops) for n in counts}


def hop_knee(hop: Dict[int, float], ceiling: float = math.inf, rehash: bool = False) -> int:
    """The fewest flows whose aggregate on this hop reaches ``KNEE`` of the hop's best, or of
    `ceiling` where that is lower; with `rehash`, fewer where :func:`capped_knee` says so."""
    target = KNEE * min(max(hop.values()), ceiling)
    measured = min(n for n, rate in hop.items() if rate >= target)
    capped = capped_knee(hop, target) if rehash else None
    return capped if capped is not None and capped < measured else measured


def capped_knee(hop: Dict[int, float], target: float) -> Optional[int]:
    """The fewest flows, a measured count, that would reach `target` bytes/s at one flow's rate each,
    where one flow carries less than half of it and those flows measured at least ``SLOW_PHASE`` of
    it; None otherwise (no one-flow phase, or a hop whose flows are not capped below the link)."""
    one = hop.get(1, 0.0)
    if not one > 0 or 2 * one >= target:
        return None
    enough = [n for n in sorted(hop) if n * one >= target]
    if not enough or hop[enough[0]] < SLOW_PHASE * target:
        return None
    return enough[0]


def hop_knees(hops: Sequence[Dict[int, float]], rehash: bool = False) -> List[int]:
    """Each hop's knee against the lower of its own best and the best any other hop reached (one
    hop alone: its own best); `rehash` as in :func:`hop_knee`."""
    bests = [max(hop.values()) for hop in hops]
    return [hop_knee(hop, max(bests[:i] + bests[i + 1:], default=math.inf), rehash) for i, hop in enumerate(hops)]


def choose_lanes(rate: float, cpus_per_worker: float, rings_per_link: int = 1) -> int:
    """The number of lanes k for a ring whose hops carry `rate` bytes/s at best (the probe's), shared
    by `rings_per_link` rings (the hierarchical allreduce runs one per local rank over one link),
    on workers with `cpus_per_worker` CPUs each (the fewest of any rank): enough lanes that none
    needs more than LANE_BYTES_PER_SECOND, at least MIN_LANES, and above that no more than the CPUs."""
    if not rate >= 0 or not cpus_per_worker > 0 or rings_per_link < 1:
        raise ValueError(f"choose_lanes: rate {rate!r} must be >= 0, cpus_per_worker {cpus_per_worker!r} > 0, "
                         f"rings_per_link {rings_per_link!r} >= 1")
    return max(MIN_LANES, min(lanes_needed(rate, rings_per_link), int(cpus_per_worker), MAX_LANES))


def lanes_needed(rate: float, rings_per_link: int = 1) -> int:
    """The lanes a ring needs so that none carries more than LANE_BYTES_PER_SECOND of its share
    (1 / `rings_per_link`) of `rate`, before choose_lanes's floor and CPU bound."""
    return math.ceil(rate / rings_per_link / LANE_BYTES_PER_SECOND)


def choose(hops: Sequence[Dict[int, float]], lanes: int, max_sockets: int = 64, rehash: bool = False) -> FlowChoice:
    """The sockets per lane for `lanes` lanes from every hop's curve (the same on every rank);
    `rehash`: the rings re-hash colliding flows (FASTHOROVOD_REHASH, :func:`capped_knee`)."""
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    curve = ring_curve(hops)
    knee = max(hop_knees(hops, rehash))
    sockets = max(1, math.ceil(knee * HEADROOM / lanes)) if knee > 1 else 1
    return FlowChoice(sockets_per_lane=min(sockets, max_sockets), knee_flows=knee, curve=curve, hops=list(hops))


def disagree(hops: Sequence[Dict[int, float]]) -> bool:
    """Whether the hops' knees differ (then a second probe settles whether that is the network or
    a disturbed phase); every rank computes it alike from the exchanged curves."""
    return len(set(hop_knees(hops))) > 1


def disputed_flows(hops: Sequence[Dict[int, float]]) -> Tuple[int, int]:
    """The flow counts a second probe measures again, as (first, last) of its doubling: the count
    one doubling below the highest of the hops' knees (e.g. knees 8 and 16, or 4 and 16: 8), or
    the knee itself when the knees agree. Every other count keeps its first measurement in
    :func:`merge`.

    The job's knee is the highest hop knee, so only a better reading below it can lower the
    choice, and a disturbed phase moves a knee up by one doubling (8 to 16 in the cases seen). The
    highest knee's own count is not measured again: :func:`merge` keeps each count's better
    reading, and a better reading at the top count only raises the targets the knees are measured
    against (:func:`hop_knees`), so it could only confirm the dispute. One phase keeps a probe that
    runs twice within 2 s on an uneven cloud too, whose knees disagree by several doublings (4
    and 32 on 5:1gbit:200mbit with two hosts at 100 Mbit/s per flow: 2.4 s with the counts 4 to 16
    measured again). The same on every rank: the same curves."""
    knees = hop_knees(hops)
    low, high = min(knees), max(knees)
    count = max(low, high // 2)
    return count, count


def merge(first: Sequence[Dict[int, float]], second: Sequence[Dict[int, float]]) -> List[Dict[int, float]]:
    """Per hop and flow count, the better of two probes' measurements (a count measured only once
    keeps that measurement)."""
    if len(first) != len(second):
        raise ValueError(f"the two probes measured {len(first)} and {len(second)} hops")
    return [{n: max(a.get(n, 0.0), b.get(n, 0.0)) for n in sorted(set(a) | set(b))} for a, b in zip(first, second)]
