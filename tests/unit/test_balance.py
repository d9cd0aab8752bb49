"""Policies on top of the data plane's mechanisms, without processes: the lane balancer (local,
never blocking a post), and the data plane's public API for buffers and dtypes."""
import os

import pytest
import torch

from fasthorovod.config import Config
from fasthorovod.proxy.balance import LaneBalancer, rebalanced
from fasthorovod.proxy.buffers import BufferPool
from fasthorovod.proxy.group import ProxyGroup


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


def test_rebalance_moves_the_weights_halfway_towards_the_measured_rates_every_n_requests():
    lanes = FakeLanes([4, 1])
    balancer = LaneBalancer(lanes, 4)
    for _ in range(8):
        balancer.before_request()  # counters read before request 4 and 8
        lanes.post()
    assert [n for n, _ in lanes.switches] == [4, 8]
    # rates 4 : 1 → halfway from (1/2, 1/2) towards (4/5, 1/5), then again
    assert lanes.switches[0][1] == pytest.approx([0.65, 0.35])
    assert lanes.switches[1][1] == pytest.approx([0.725, 0.275])


def test_rebalanced_keeps_the_weights_when_a_lane_moved_nothing():
    assert rebalanced([1.0, 1.0], [3.0, 0.0]) == [1.0, 1.0]
    assert rebalanced([1.0, 3.0], [1.0, 1.0]) == [0.375, 0.625]


def test_rebalancing_off_only_counts():
    lanes = FakeLanes([1, 1])
    balancer = LaneBalancer(lanes, 0)
    for _ in range(5):
        balancer.before_request()
    assert balancer.requests == 5 and not lanes.switches


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
