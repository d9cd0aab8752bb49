"""hvd.join() with proxies: the data plane's join mechanism plus what the ranks reconcile after it.

``ProxyGroup.begin_join`` makes this rank's proxies fill the other ranks' collectives with zeros;
``ProxyGroup.end_join`` stops that. Between the two, Horovod's own ``join`` runs and decides
which rank joined last, by the order in which its coordinator saw the JOIN requests. Here a rank
has joined as soon as its proxies start zero-filling, a moment before its JOIN reaches Horovod, so
under load another rank's JOIN can overtake it. The proxies count the collectives they
zero-filled during the join: a rank that filled one posted by rank R joined before R and cannot
be the last. If Horovod names such a rank, the answer becomes the latest (by wall clock) of the
ranks that filled nothing (:func:`last_joined`). The counts and times are exchanged with one
allgather after the join, every rank computing the same answer.

Ranks that joined early posted fewer proxy requests and missed lane rebalances; with the same
allgather every rank adopts rank 0's lane weights and request count, so shard boundaries and
rebalance points agree again.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Tuple


def last_joined(horovod_last: int, joins: Sequence[Tuple[int, int]]) -> int:
    """The rank that joined last, from Horovod's answer and each rank's (wall-clock ns at which it
    joined, collectives its proxies zero-filled)."""
    candidates = [r for r, (_, filled) in enumerate(joins) if filled == 0]
    if horovod_last in candidates or not candidates:
        return horovod_last
    return max(candidates, key=lambda r: joins[r][0])


class JoinReconciler:
    """One hvd.join() of a rank with proxies: begin(), then Horovod's join, then end() (or
    abandon() if Horovod's join failed)."""

    def __init__(self, group, balancer, allgather_object: Callable) -> None:
        self.group = group
        self.balancer = balancer  # LaneBalancer or None
        self._allgather_object = allgather_object
        self._joined_ns: Optional[int] = None

    def begin(self) -> None:
        self.group.begin_join()  # returns once the lanes finished this rank's earlier requests
        self._joined_ns = time.time_ns()

    def abandon(self) -> None:
        """Horovod's join failed: take the proxies out of the joined state, nothing collective."""
        self.group.end_join()

    def end(self, horovod_last: int) -> int:
        """Every rank has joined (Horovod says `horovod_last` joined last): leave the joined state,
        exchange what the proxies saw, adopt rank 0's lane state; returns the corrected answer."""
        self.group.end_join()  # returns after the lanes' last zero-filled collective
        # Each lane reset its count when it took the join request, so it holds this join's fills.
        requests = self.balancer.requests if self.balancer is not None else 0
        mine = (self._joined_ns, self.group.zero_filled(), self.group.lane_weights, requests)
        everyone = self._allgather_object(mine, name="fasthorovod.join")
        self.group.set_lane_weights(everyone[0][2])
        if self.balancer is not None:
            self.balancer.adopt(everyone[0][3])
        return last_joined(horovod_last, [(entry[0], entry[1]) for entry in everyone])
