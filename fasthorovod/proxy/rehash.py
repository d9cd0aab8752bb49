"""Re-hashing unlucky flows: a policy on top of ProxyGroup's mechanisms (a ``before_submit`` hook,
the send sockets' counters, ``ProxyGroup.request_rehash``).

Networks cap bandwidth per flow by hashing: two flows whose ports hash alike share one cap (a
shaper's per-flow bucket, one ECMP path). Which of a job's flows collide is decided by the source
ports the kernel hands out when the rings connect, so without this policy a job's pace would be
decided by luck at start-up (docs/benchmarks.md, "When flows collide").

Every send socket counts the bytes it wrote and the time it had bytes the kernel had not sent yet
(its *backlogged* time, transport/lane.h): while a socket is backlogged the flow, not this rank, is
the limit, so bytes per backlogged second is the rate the flow drains at, whatever the ring's other
hops do. Once every lane has sent ``MIN_BYTES`` since the last look (so that one small collective
decides nothing), a rank compares the rates of its sockets that were backlogged for at least
``MIN_BACKLOGGED_NS``, all lanes together (they all cross the same hop, to the next rank): a socket
below ``SLOW`` of their upper quartile in ``WINDOWS`` looks in a row is asked to reconnect after
its next collective. The upper quartile, not the median, is the reference: with four flows of which
two share a cap, the median is the shared flows' rate and would hide them. Where the start-up probe
measured the path, the reference is at most the rate a flow can expect (:func:`expected_flow_rate`:
one flow's rate, or the link's share of each of the hop's flows where that is lower, the link's
rate taken from hops whose probe flows did not collide): where the
link, not a per-flow cap, is the limit, flows drain unevenly (TCP's fairness is rough) and a new
hash cannot help, so only a flow below ``SLOW`` of its share of the link is replaced; two flows in
one bucket where the link is the limit drain at 0.75-0.8 of that share, and a lane with such a pair
is slow on that hop, so ``SLOW`` is 0.8 (at 0.6 they stayed: docs/benchmarks.md). The new connection has
a new source port, hence a new hash; if it is unlucky again, the same rule finds it again, at most
``MAX_REHASHES`` times per socket (where a network has fewer buckets than the job has flows, some
flows always share, and replacing them again only costs pauses). Fewer than ``MIN_MEASURED``
measured sockets: nothing to compare with, nothing is decided. Flows that share a link's
bandwidth fairly drain alike, and where flows are not capped the sockets are rarely backlogged:
nothing happens.

The same rule runs before the job's first collective where the start-up probe saw flows collide
(:func:`collisions`: on some hop, twice the flows carried less than ``SLOW`` of twice the rate, or
of the link): :func:`warm_up` runs ``WARM_UP_COLLECTIVES`` allreduces of zeros, each large enough
for one look, so that a job whose rings drew colliding ports starts on new ones instead of finding
them in its first steps.

Rebalancing (balance.py) moves shard weight *between* lanes by their busy times; re-hashing
changes which flows carry a lane. So they do not fight, a re-hash makes the balancer forget its
current window (``LaneBalancer.forget``): the window would mix the lane's pace before and after.
Purely local, like rebalancing: nothing collective, nothing that blocks, and the receiving proxy
learns of each replacement from the collective's own end marker (docs/dataplane.md).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

MIN_BYTES = 4 << 20           # each lane sends at least this much between two looks
MIN_BACKLOGGED_NS = 20_000_000  # a socket measured in a look was the limit for at least 20 ms
SLOW = 0.8                    # below this fraction of the upper quartile's rate a socket is slow...
WINDOWS = 2                   # ...in this many looks in a row before it reconnects
MIN_MEASURED = 3              # sockets measured in a look, at least, to compare them
MAX_REHASHES = 3              # replacements of one socket, at most, per data plane
WARM_UP_COLLECTIVES = WINDOWS + 2  # looks enough to condemn a socket, then one to replace it and one more
WARM_UP_MAX_BYTES = 64 << 20  # the largest warm-up allreduce


def expected_flow_rate(plan) -> Optional[float]:
    """The rate (bytes/s) one of the data plane's flows can expect on the ring's slowest hop, from
    the start-up probe's curves (None where it did not run): one flow's, or the link's share of each
    of the hop's flows (:func:`link_rate` over the lanes x sockets of every ring that crosses the
    link) where that is lower."""
    choice = getattr(plan, "flow_choice", None)
    if choice is None or not choice.curve:
        return None
    rings = plan.layout.local_size if plan.layout is not None else 1
    one_flow = choice.curve[min(choice.curve)]
    return min(one_flow, link_rate(choice) / (plan.flows * rings))


def link_rate(choice) -> float:
    """The most a link of the ring carries (bytes/s), as the start-up probe saw it: the lowest best
    aggregate among the hops whose flows did not collide (:func:`collisions`), so that a hop whose
    flows shared caps does not pass for a slower link (its flows would then seem to get their share
    of it, and never be replaced); where every hop's flows collided, the best any hop carried;
    without per-hop curves, the slowest hop's best."""
    bests = {i: max(hop.values()) for i, hop in enumerate(choice.hops) if hop}
    if not bests:
        return max(choice.curve.values())
    collided = {hop for hop, _, _, _ in collisions(choice)}
    clean = [best for i, best in bests.items() if i not in collided]
    return min(clean) if clean else max(bests.values())


def slow_sockets(deltas: Dict[Tuple[int, int], Tuple[int, int]],
                 expected: Optional[float] = None) -> List[Tuple[int, int]]:
    """The (lane, socket) keys of `deltas` ((bytes, backlogged ns) in one look) whose rate is below
    ``SLOW`` of the reference: the upper quartile of the rates of the sockets backlogged long enough
    to be measured, or `expected` (bytes/s; :func:`expected_flow_rate`) where that is lower."""
    rates = {key: sent / backlogged for key, (sent, backlogged) in deltas.items() if backlogged >= MIN_BACKLOGGED_NS}
    if len(rates) < MIN_MEASURED:
        return []
    ordered = sorted(rates.values())
    reference = ordered[math.ceil(0.75 * (len(ordered) - 1))]
    if expected is not None:
        reference = min(reference, expected / 1e9)  # rates here are bytes per ns
    return sorted(key for key, rate in rates.items() if rate < SLOW * reference)


class FlowRehasher:
    """Watches a ProxyGroup's send sockets and has the persistently slow ones reconnect."""

    def __init__(self, group, forget: Optional[Callable[[], None]] = None) -> None:
        self.group = group
        self.expected = expected_flow_rate(group.plan)
        self.forget = forget  # called when sockets are asked to reconnect (the balancer's window)
        self.looks = 0        # windows measured
        self.requested = 0    # sockets asked to reconnect
        self._since = self._progress()
        self._lane_sent = self._lanes_sent()  # the lanes' bytes at the last look (the cheap gate)
        self._strikes: Dict[Tuple[int, int], int] = {}
        self._replaced: Dict[Tuple[int, int], int] = {}  # per socket, how often

    def _lanes_sent(self) -> List[int]:
        return [sent for sent, _ in self.group.lane_progress()]

    def _progress(self) -> Dict[Tuple[int, int], Tuple[int, int]]:
        return {(lane, socket): counters for lane in range(self.group.lanes)
                for socket, counters in enumerate(self.group.socket_progress(lane))}

    def before_request(self) -> None:
        """Call just before each proxy request is submitted."""
        sent = self._lanes_sent()
        if min(now - then for now, then in zip(sent, self._lane_sent)) < MIN_BYTES:
            return
        self._lane_sent = sent
        progress = self._progress()
        deltas = {key: (b - self._since[key][0], t - self._since[key][1]) for key, (b, t) in progress.items()}
        self._since = progress
        self.looks += 1
        slow = [key for key in slow_sockets(deltas, self.expected) if self._replaced.get(key, 0) < MAX_REHASHES]
        self._strikes = {key: self._strikes.get(key, 0) + 1 for key in slow}
        due = [key for key, strikes in self._strikes.items() if strikes >= WINDOWS]
        if not due:
            return
        for lane in sorted({lane for lane, _ in due}):
            self.group.request_rehash(lane, [socket for l, socket in due if l == lane])
        for key in due:
            del self._strikes[key]
            self._replaced[key] = self._replaced.get(key, 0) + 1
        self.requested += len(due)
        if self.forget is not None:
            self.forget()


def collisions(choice) -> List[Tuple[int, int, float, float]]:
    """Where the start-up probe (`choice`: the plan's ``flow_choice``, or None) saw flows collide:
    (hop, flows m, bytes/s of m flows, bytes/s of 2m flows) for every hop and doubling whose 2m flows
    carried less than ``SLOW`` of twice what m carried (or of the hop's best, where the link is the
    limit). Every rank holds the same curves, so every rank finds the same."""
    found = []
    for hop, curve in enumerate(choice.hops if choice is not None else ()):
        best = max(curve.values(), default=0.0)
        for m, rate in sorted(curve.items()):
            doubled = curve.get(2 * m)
            if doubled is not None and doubled < SLOW * min(2 * rate, best):
                found.append((hop, m, rate, doubled))
    return found


def warm_up_bytes(plan) -> int:
    """An allreduce that has every lane send at least ``MIN_BYTES`` (a quarter more), within
    ``WARM_UP_MAX_BYTES``: each lane carries 2 (R - 1) / R of its shard round a ring of R ranks (the
    hosts, with the hierarchical layout, whose L local ranks share the tensor)."""
    local = plan.layout.local_size if plan.layout is not None else 1
    ring = plan.layout.num_hosts if plan.layout is not None else plan.size
    if ring < 2:
        return 0
    needed = MIN_BYTES * plan.lanes * local * ring / (2 * (ring - 1)) * 1.25
    return min(WARM_UP_MAX_BYTES, int(math.ceil(needed / 4096)) * 4096)


def warm_up(group, rehasher: Optional[FlowRehasher]) -> Optional[str]:
    """Before the job's first collective, where the probe saw flows collide (or always, with
    FASTHOROVOD_REHASH_WARM_UP=1; never with 0): runs ``WARM_UP_COLLECTIVES`` allreduces of zeros so
    that the re-hashing rule (`rehasher`, this rank's; None where FASTHOROVOD_REHASH=0) replaces
    colliding flows now. Collective: every rank calls it, and every rank decides alike
    (:func:`collisions`, from the curves every rank shares, and the setting, which the proxies'
    handshake checks the ranks agree on). Returns what it did, in words (None: nothing)."""
    setting = group.config.rehash_warm_up
    seen = collisions(group.plan.flow_choice)
    nbytes = warm_up_bytes(group.plan)
    if setting == "0" or not nbytes or (setting == "auto" and not seen):
        return None
    started = time.monotonic()
    zeros = torch.zeros(nbytes // 4)
    for i in range(WARM_UP_COLLECTIVES):
        group.allreduce([zeros], None, f"fasthorovod.rehash.warm_up.{i}", False, 1.0, 1.0).wait()
    if seen:
        hop, m, rate, doubled = seen[0]
        why = (f"the probe saw flows collide ({len(seen)} time{'s' if len(seen) > 1 else ''}; into rank {hop} "
               f"{2 * m} flows carried {doubled * 8e-6:.0f} Mbit/s, {m} carried {rate * 8e-6:.0f})")
    else:
        why = "FASTHOROVOD_REHASH_WARM_UP=1"
    replaced = f"replaced {rehasher.requested} of this rank's connections" if rehasher else "(FASTHOROVOD_REHASH=0)"
    return (f"{why}: {WARM_UP_COLLECTIVES} allreduces of {nbytes / (1 << 20):.1f} MiB before the job's first "
            f"{replaced} in {time.monotonic() - started:.1f} s")
