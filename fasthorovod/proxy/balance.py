"""Lane rebalancing: a policy on top of ProxyGroup's mechanisms (lane counters, lane weights).

A striped transfer finishes when its slowest lane does, and real flows are uneven (per-flow caps,
hash collisions, CPU contention). With FASTHOROVOD_REBALANCE_EVERY = N, every N-th request the
ranks exchange each lane's rate since the last exchange (bytes sent per second busy in
collectives); a lane's ring is as fast as its slowest hop, so its rate is the minimum over the
ranks, and the lane weights move halfway towards those rates.

Nothing here blocks a post. The exchange is an asynchronous Horovod allgather started just before
request k·N is posted; its result is applied just before request k·N + D, D = max(1, N // 2),
after waiting for it only if it has not arrived by then (it usually has: Horovod's background
thread runs it while D requests travel). Every rank counts the same requests in the same order
and computes the same weights from the same gathered numbers, so every rank switches its shard
boundaries at the same request. At most one exchange is in flight (D <= N).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

# gather_async(tensor of shape (1, lanes), name) starts an allgather over the ranks and returns a
# function that waits for it and gives the (size, lanes) result.
GatherAsync = Callable[[torch.Tensor, str], Callable[[], torch.Tensor]]


def rebalanced(weights: Sequence[float], gathered: Sequence[Sequence[float]]) -> List[float]:
    """New lane weights from every rank's per-lane rates (`gathered[r][lane]`): halfway from the
    normalized weights towards the normalized ring rates (minimum over ranks); unchanged when a
    lane moved nothing measurable."""
    ring_rates = [min(rates[lane] for rates in gathered) for lane in range(len(weights))]
    if not ring_rates or min(ring_rates) <= 0.0:
        return list(weights)
    total_w, total_r = sum(weights), sum(ring_rates)
    return [0.5 * w / total_w + 0.5 * r / total_r for w, r in zip(weights, ring_rates)]


class LaneBalancer:
    """Counts a ProxyGroup's allreduce requests and rebalances its lanes every `every` of them
    (0: never; the count is kept anyway, for hvd.join()'s reconciliation)."""

    def __init__(self, group, every: int, gather_async: GatherAsync) -> None:
        self.group = group
        self.every = every
        self.delay = max(1, every // 2)
        self.requests = 0  # requests counted so far (the next one is number requests + 1)
        self._gather_async = gather_async
        self._pending: Optional[Tuple[int, Callable[[], torch.Tensor]]] = None  # (apply before, wait)
        self._last_totals = [(0, 0)] * len(group.lane_weights)

    def before_request(self) -> None:
        """Call just before each allreduce request is posted, in posting order."""
        self.requests += 1
        if not self.every:
            return
        if self._pending is not None and self._pending[0] == self.requests:
            _, wait = self._pending
            self._pending = None
            gathered = wait().tolist()
            self.group.set_lane_weights(rebalanced(self.group.lane_weights, gathered))
        if self.requests % self.every == 0:
            rates = torch.tensor([self._lane_rates()], dtype=torch.float64)
            wait = self._gather_async(rates, f"fasthorovod.lane_rates.{self.requests}")
            self._pending = (self.requests + self.delay, wait)

    def _lane_rates(self) -> List[float]:
        """Each lane's bytes per busy nanosecond since the last call (0 when it moved nothing)."""
        rates = []
        for lane, stats in enumerate(self.group.lane_stats()):
            sent, busy = self._last_totals[lane]
            d_bytes, d_busy = stats["bytes_sent"] - sent, stats["busy_ns"] - busy
            self._last_totals[lane] = (stats["bytes_sent"], stats["busy_ns"])
            rates.append(d_bytes / d_busy if d_busy > 0 and d_bytes > 0 else 0.0)
        return rates

    def adopt(self, requests: int) -> None:
        """Continue from another rank's request count (hvd.join(): ranks that joined early posted
        fewer requests). An exchange in flight is dropped, on every rank alike; the next one starts
        at the next multiple of `every`."""
        self.requests = requests
        self._pending = None
