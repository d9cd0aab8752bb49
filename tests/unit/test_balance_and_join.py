"""Policies on top of the data plane's mechanisms, without processes: the lane balancer's schedule
(never blocking a post, switching at the same request everywhere), join reconciliation, and the
data plane's public API for buffers and dtypes."""
import os

import pytest
import torch

from fasthorovod.config import Config
from fasthorovod.proxy.balance import LaneBalancer, rebalanced
from fasthorovod.proxy.buffers import BufferPool
from fasthorovod.proxy.group import ProxyGroup
from fasthorovod.torch.join import JoinReconciler, last_joined


class FakeLanes:
    """ProxyGroup's rebalancing mechanisms: lane counters that advance per request, lane weights."""

    def __init__(self, speeds):
        self.speeds = speeds  # bytes per busy ns, per lane
        self.lane_weights = [1.0] * len(speeds)
        self.sent = [0] * len(speeds)
        self.switches = []  # (number of the request the new weights apply to, weights)
        self.requests = 0

    def lane_stats(self):
        return [{"bytes_sent": s, "busy_ns": s // speed} for s, speed in zip(self.sent, self.speeds)]

    def set_lane_weights(self, weights):
        self.switches.append((self.requests + 1, list(weights)))
        self.lane_weights = list(weights)

    def post(self):
        self.requests += 1
        for lane, speed in enumerate(self.speeds):
            self.sent[lane] += 1000 * speed


def test_rebalance_starts_an_exchange_and_applies_it_half_a_period_later():
    ranks = [FakeLanes([4, 2]), FakeLanes([4, 1])]
    started, waited = [], []

    def gather_for(rank):
        def gather_async(rates, name):
            started.append((rank, ranks[rank].requests + 1, name))
            def wait():
                waited.append((rank, ranks[rank].requests + 1))
                return torch.cat([torch.tensor([r._rates_at_start]) for r in ranks])
            ranks[rank]._rates_at_start = rates[0].tolist()
            return wait
        return gather_async

    balancers = [LaneBalancer(lanes, 4, gather_for(r)) for r, lanes in enumerate(ranks)]
    for _ in range(10):
        for lanes, balancer in zip(ranks, balancers):
            balancer.before_request()
            lanes.post()
    # exchanges start before requests 4 and 8 and are applied before requests 6 and 10 (+ 4 // 2)
    assert [(r, n) for r, n, _ in started] == [(0, 4), (1, 4), (0, 8), (1, 8)]
    assert started[0][2] == "fasthorovod.lane_rates.4"
    assert waited == [(0, 6), (1, 6), (0, 10), (1, 10)]
    assert ranks[0].switches == ranks[1].switches and [n for n, _ in ranks[0].switches] == [6, 10]
    # rates of lane 0: min(4, 4); lane 1: min(2, 1): halfway from (1/2, 1/2) towards (4/5, 1/5)
    assert ranks[0].switches[0][1] == pytest.approx([0.65, 0.35])


def test_rebalanced_keeps_the_weights_when_a_lane_moved_nothing():
    assert rebalanced([1.0, 1.0], [[3.0, 0.0], [3.0, 1.0]]) == [1.0, 1.0]
    assert rebalanced([1.0, 3.0], [[1.0, 1.0]]) == [0.375, 0.625]


def test_rebalancing_off_only_counts():
    lanes = FakeLanes([1, 1])
    balancer = LaneBalancer(lanes, 0, lambda rates, name: pytest.fail("no exchange when off"))
    for _ in range(5):
        balancer.before_request()
    assert balancer.requests == 5 and not lanes.switches


def test_adopt_drops_the_exchange_in_flight():
    lanes = FakeLanes([1, 1])
    balancer = LaneBalancer(lanes, 2, lambda rates, name: (lambda: pytest.fail("dropped exchange waited")))
    balancer.before_request()
    balancer.before_request()  # request 2: exchange started, due before request 3
    balancer.adopt(7)
    balancer.before_request()  # request 8: a new exchange, nothing applied
    assert balancer.requests == 8 and not lanes.switches


def test_last_joined_corrects_horovod_with_the_zero_fill_counts():
    # rank 0 joined first and zero-filled rank 1's collectives: it cannot be last
    assert last_joined(0, [(100, 3), (200, 0), (150, 0)]) == 1
    assert last_joined(2, [(100, 3), (200, 0), (150, 0)]) == 2  # Horovod's answer stands
    assert last_joined(1, [(100, 1), (200, 1)]) == 1  # nobody is a candidate: keep Horovod's


def test_join_reconciler_adopts_rank_0s_lane_state():
    lanes = FakeLanes([1, 1])
    calls = []
    lanes.begin_join = lambda: calls.append("begin")
    lanes.end_join = lambda: calls.append("end")
    lanes.zero_filled = lambda: 2
    balancer = LaneBalancer(lanes, 0, None)
    reconciler = JoinReconciler(lanes, balancer, lambda mine, name: [(5, 0, [0.25, 0.75], 9), mine])
    reconciler.begin()
    assert reconciler.end(1) == 0  # rank 1 (this one) zero-filled: rank 0 joined last
    assert calls == ["begin", "end"] and lanes.lane_weights == [0.25, 0.75] and balancer.requests == 9


def test_proxy_group_alloc_and_supports():
    group = ProxyGroup(Config(num_proxies=2), 0, 2)
    assert group.supports(torch.bfloat16) and not group.supports(torch.complex64)
    group.pool = BufferPool(f"/fasthorovod.test.alloc.{os.getpid()}")
    try:
        flat = group.alloc(10, torch.float32)
        assert flat.shape == (10,) and torch.equal(flat, torch.zeros(10))
        assert group.pool.locate(flat[2:5]) is not None  # shared memory the proxies can address
        assert group.alloc(0, torch.int64).numel() == 0
        with pytest.raises(ValueError, match="do not carry"):
            group.alloc(3, torch.complex64)
        group.set_lane_weights([1, 3])
        assert group.lane_boundaries(8) == [0, 2, 8]
        with pytest.raises(ValueError, match="2 positive numbers"):
            group.set_lane_weights([1.0, 0.0])
    finally:
        group.pool.close()
