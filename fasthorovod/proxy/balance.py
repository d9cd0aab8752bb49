"""Lane rebalancing: a policy on top of ProxyGroup's mechanisms (a ``before_submit`` hook, the
lanes' progress counters, lane weights).

A striped transfer finishes when its slowest lane does, and real flows are uneven: per-flow caps,
two flows hashed onto one bucket of a shaper or one ECMP path (docs/benchmarks.md),
CPU contention. So, by default (FASTHOROVOD_REBALANCE_EVERY = 1; 0 turns it off), before every
N-th proxy request a rank looks at what each of its lanes did since its last decision: once every
lane has moved at least ``MIN_BYTES`` (so that one small collective's noise decides nothing), it
compares the lanes' busy times. If the slowest lane was busy more than ``DEADBAND`` longer than
the quickest in this window and in the one before, with the same lane the slowest both times,
the lanes are not finishing together and the weights move ``STEP`` of the way towards the lanes'
rates over both windows (bytes sent per busy second); otherwise they stay, so a steady network
does not make them wander. Once the weights have moved, the tolerated spread drops to ``SETTLE``
until a window comes in under it: without that hysteresis the weights would stop just inside the
dead band, short of the best split (seen in CI with a 10% band: a halved lane recovered to 87% of
what the remaining capacity allows). The dead band is narrow because a skew left alone is paid on
every collective: in training, the last collective of a step ends when its slowest lane does, and
with a 10% band AlexNet's steps on the emulated cloud ended 0.1-0.4 s (3-10%) after the quickest
lane (docs/dataplane.md). What keeps noise out is the second window: on a steady loopback network
shaped to 200 Mbit/s per lane one window's spread is 0-7%, but the same lane the slowest, beyond
the band, in two windows in a row is rare, and a move it causes is only towards measured rates.
No lane's share drops below ``MIN_SHARE`` of an equal share, so a lane that recovers is measured
again and wins its share back.

A lane's ring runs at its slowest hop's pace and every rank's collective lasts until the ring
has finished, so one rank's own counters already see the ring's rate; no exchange between ranks
is needed. Nor do the ranks need equal weights: ``set_lane_weights`` tells the rank's negotiation
member, which passes new weights to the coordinator only when they change; the coordinator cuts
each run order by the weights the lowest rank that submitted the collective (rank 0, unless it
has joined) had when it submitted it, and every rank cuts its shards there. So the policy is
purely local — nothing collective, nothing that blocks, no Horovod call — and keeps working while
ranks are in ``hvd.join()``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

MIN_BYTES = 4 << 20   # each lane moves at least this much between two decisions
DEADBAND = 0.04       # busy-time spread (slowest / quickest - 1) tolerated before acting
SETTLE = 0.02         # the spread tolerated after a change, until a window comes in under it
STEP = 0.5            # fraction of the way towards the measured rates per decision
MIN_SHARE = 0.2       # floor of a lane's share, relative to an equal share


def rebalanced(weights: Sequence[float], rates: Sequence[float], step: float = STEP,
               min_share: float = MIN_SHARE) -> List[float]:
    """New lane weights (normalized): `step` of the way from the normalized weights towards the
    normalized lane rates, with no share below `min_share` / lanes; unchanged when a lane moved
    nothing measurable."""
    if not rates or min(rates) <= 0.0:
        return list(weights)
    total_w, total_r, n = sum(weights), sum(rates), len(weights)
    moved = [(1 - step) * w / total_w + step * r / total_r for w, r in zip(weights, rates)]
    floored = [max(share, min_share / n) for share in moved]
    total = sum(floored)
    return [share / total for share in floored]


class LaneBalancer:
    """Watches a ProxyGroup's lanes and re-weighs them when they stop finishing together
    (every `every`-th request at most; 0: never)."""

    def __init__(self, group, every: int) -> None:
        self.group = group
        self.every = every
        self.requests = 0
        self.decisions = 0  # measurements taken (each lane had moved MIN_BYTES)
        self.changes = 0    # decisions that moved the weights
        self.last_spread = 0.0  # busy-time spread of the last window (slowest / quickest - 1)
        self.settling = False   # the weights moved and the lanes do not finish within SETTLE yet
        self._since: List[Tuple[int, int]] = [(0, 0)] * len(group.lane_weights)
        # the last window, when it was out of balance: (its slowest lane, its per-lane deltas)
        self._previous: Optional[Tuple[int, List[Tuple[int, int]]]] = None

    def forget(self) -> None:
        """Starts a new window from here, forgetting the last one (the lanes' flows changed:
        rehash.py)."""
        self._since = list(self.group.lane_progress())
        self._previous = None

    def before_request(self) -> None:
        """Call just before each proxy request is submitted."""
        self.requests += 1
        if not self.every or self.requests % self.every:
            return
        progress = self.group.lane_progress()  # per lane (bytes_sent, busy_ns)
        deltas = [(sent - sent0, busy - busy0) for (sent, busy), (sent0, busy0) in zip(progress, self._since)]
        if min(d_bytes for d_bytes, _ in deltas) < MIN_BYTES or min(d_busy for _, d_busy in deltas) <= 0:
            return  # not enough since the last decision: keep counting
        self._since = list(progress)
        self.decisions += 1
        busy = [d_busy for _, d_busy in deltas]
        self.last_spread = max(busy) / min(busy) - 1.0
        previous, self._previous = self._previous, None
        if self.last_spread <= (SETTLE if self.settling else DEADBAND):
            self.settling = False
            return
        slowest = busy.index(max(busy))
        self._previous = (slowest, deltas)
        if previous is None or previous[0] != slowest:
            return  # one window's noise (a descheduled proxy, a retransmit) is not a slow lane
        self.changes += 1
        self.settling = True
        both = [(b0 + b1, t0 + t1) for (b0, t0), (b1, t1) in zip(previous[1], deltas)]
        self.group.set_lane_weights(rebalanced(self.group.lane_weights, [b / t for b, t in both]))
