"""Lane rebalancing: a policy on top of ProxyGroup's mechanisms (lane counters, lane weights).

A striped transfer finishes when its slowest lane does, and real flows are uneven (per-flow caps,
hash collisions, CPU contention). With FASTHOROVOD_REBALANCE_EVERY = N, every N-th request a rank
measures each of its lanes' rates since the last time (bytes sent per second busy in collectives)
and moves its lane weights halfway towards them. A lane's ring runs at its slowest hop's pace and
every rank's collective lasts until the ring has finished, so one rank's own measurement already
sees the ring's rate; no exchange between ranks is needed.

Nor do the ranks need equal weights: the negotiation's run order carries the lane boundaries of
the lowest rank that submitted the collective (rank 0, unless it has joined), and every rank cuts
its shards there. So this policy is purely local: nothing collective, nothing that blocks, and it
keeps working while ranks are in ``hvd.join()``.
"""
from __future__ import annotations

from typing import List, Sequence


def rebalanced(weights: Sequence[float], rates: Sequence[float]) -> List[float]:
    """New lane weights: halfway from the normalized weights towards the normalized lane rates;
    unchanged when a lane moved nothing measurable."""
    if not rates or min(rates) <= 0.0:
        return list(weights)
    total_w, total_r = sum(weights), sum(rates)
    return [0.5 * w / total_w + 0.5 * r / total_r for w, r in zip(weights, rates)]


class LaneBalancer:
    """Counts a ProxyGroup's requests and rebalances its lanes every `every` of them (0: never)."""

    def __init__(self, group, every: int) -> None:
        self.group = group
        self.every = every
        self.requests = 0
        self._last_totals = [(0, 0)] * len(group.lane_weights)

    def before_request(self) -> None:
        """Call just before each allreduce request is submitted."""
        self.requests += 1
        if self.every and self.requests % self.every == 0:
            self.group.set_lane_weights(rebalanced(self.group.lane_weights, self._lane_rates()))

    def _lane_rates(self) -> List[float]:
        """Each lane's bytes per busy nanosecond since the last call (0 when it moved nothing)."""
        rates = []
        for lane, stats in enumerate(self.group.lane_stats()):
            sent, busy = self._last_totals[lane]
            d_bytes, d_busy = stats["bytes_sent"] - sent, stats["busy_ns"] - busy
            self._last_totals[lane] = (stats["bytes_sent"], stats["busy_ns"])
            rates.append(d_bytes / d_busy if d_busy > 0 and d_bytes > 0 else 0.0)
        return rates
