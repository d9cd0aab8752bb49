"""Policies on top of the data plane's mechanisms, without processes: the lane balancer (local,
never blocking a post), the lane boundaries its weights give, and the data plane's public API for
buffers and dtypes."""
import random

import pytest
import torch

from fasthorovod import _C
from fasthorovod.config import Config
from fasthorovod.proxy.balance import DEADBAND, MIN_BYTES, MIN_SHARE, SETTLE, LaneBalancer, rebalanced
from fasthorovod.proxy.buffers import BufferPool
from fasthorovod.proxy import plan as planner
from fasthorovod.proxy.group import ProxyGroup
from fasthorovod.proxy.plan import Peer


class FakeLanes:
    """ProxyGroup's rebalancing mechanisms: lane counters that advance per request as lanes of the
    given speeds would (each lane carries its weight's share and is busy for share / speed), and
    lane weights."""

    def __init__(self, speeds):
        self.speeds = speeds  # bytes per busy ns, per lane
        self.lane_weights = [1.0] * len(speeds)
        self.sent = [0] * len(speeds)
        self.busy = [0] * len(speeds)
        self.switches = []  # (number of the request the new weights apply to, weights)
        self.requests = 0

    def lane_progress(self):
        return tuple(zip(self.sent, self.busy))

    def set_lane_weights(self, weights):
        self.switches.append((self.requests + 1, list(weights)))
        self.lane_weights = list(weights)

    def post(self, nbytes):
        self.requests += 1
        total = sum(self.lane_weights)
        for lane, speed in enumerate(self.speeds):
            share = int(nbytes * self.lane_weights[lane] / total)
            self.sent[lane] += share
            self.busy[lane] += share // speed

    def collective_ns(self, nbytes):
        """How long a collective of `nbytes` takes now: until its slowest lane is done."""
        total = sum(self.lane_weights)
        return max(nbytes * w / total / s for w, s in zip(self.lane_weights, self.speeds))


def run(lanes, balancer, requests, nbytes):
    for _ in range(requests):
        balancer.before_request()
        lanes.post(nbytes)


def test_a_slow_lane_loses_share_until_the_lanes_finish_together_then_the_weights_stay():
    lanes = FakeLanes([4, 4, 4, 1])
    balancer = LaneBalancer(lanes, 1)
    before = lanes.collective_ns(64 << 20)
    run(lanes, balancer, 30, 64 << 20)
    weights = lanes.lane_weights
    assert weights[3] < 0.1 < min(weights[:3])
    # the rates are 4:4:4:1, so the best split is 4/13 ... 1/13: once moving, the weights go on
    # until the lanes finish within SETTLE of each other, not just inside the wider dead band
    assert weights[3] == pytest.approx(1 / 13, rel=SETTLE)
    best = (64 << 20) / 13
    assert lanes.collective_ns(64 << 20) <= best * (1 + SETTLE) < 0.4 * before
    assert not balancer.settling
    changes = balancer.changes
    run(lanes, balancer, 30, 64 << 20)
    assert balancer.changes == changes and balancer.decisions > changes  # settled: measured, kept


def test_equal_lanes_are_measured_but_never_moved():
    lanes = FakeLanes([3, 3])
    balancer = LaneBalancer(lanes, 1)
    run(lanes, balancer, 20, 16 << 20)
    assert balancer.decisions >= 10 and balancer.changes == 0 and not lanes.switches


def test_small_collectives_add_up_and_two_windows_must_agree_before_a_change():
    lanes = FakeLanes([4, 1])
    balancer = LaneBalancer(lanes, 1)
    per_request = 1 << 20  # 512 KiB per lane: 8 requests before each lane has moved MIN_BYTES
    run(lanes, balancer, 8, per_request)
    assert balancer.decisions == 0
    run(lanes, balancer, 1, per_request)
    assert balancer.decisions == 1 and not lanes.switches  # one window out of balance: wait
    run(lanes, balancer, 8, per_request)
    assert balancer.decisions == 2 and [n for n, _ in lanes.switches] == [17]
    # rates 4 : 1 → halfway from (1/2, 1/2) towards (4/5, 1/5)
    assert lanes.switches[0][1] == pytest.approx([0.65, 0.35])
    assert MIN_BYTES == 4 << 20


def test_one_noisy_window_moves_nothing():
    lanes = FakeLanes([2, 2])
    balancer = LaneBalancer(lanes, 1)
    run(lanes, balancer, 3, 16 << 20)
    lanes.speeds = [2, 1]  # one window in which lane 1 was slow (a descheduled proxy) ...
    run(lanes, balancer, 1, 16 << 20)
    lanes.speeds = [2, 2]  # ... and then it was not
    run(lanes, balancer, 10, 16 << 20)
    assert balancer.decisions >= 10 and balancer.changes == 0 and not lanes.switches
    lanes.speeds = [1, 2]  # a slowdown that lasts: lane 0 is the slowest twice in a row
    run(lanes, balancer, 3, 16 << 20)
    assert balancer.changes >= 1 and lanes.lane_weights[0] < lanes.lane_weights[1]


def test_a_recovered_lane_wins_its_share_back():
    lanes = FakeLanes([4, 1])
    balancer = LaneBalancer(lanes, 1)
    run(lanes, balancer, 30, 64 << 20)
    assert lanes.lane_weights[1] < 0.25
    lanes.speeds = [4, 4]
    run(lanes, balancer, 30, 64 << 20)
    assert lanes.lane_weights == pytest.approx([0.5, 0.5], abs=0.05)


def test_a_small_imbalance_is_left_alone_but_a_change_is_followed_past_the_dead_band():
    # 3% apart: inside the dead band, so a steady network with a little skew is not chased ...
    lanes = FakeLanes([103, 100])
    balancer = LaneBalancer(lanes, 1)
    run(lanes, balancer, 20, 16 << 20)
    assert SETTLE < 0.03 < DEADBAND and balancer.changes == 0
    # ... but once a real slowdown has moved the weights, they go on to within SETTLE of the best
    lanes.speeds = [50, 100]
    run(lanes, balancer, 20, 16 << 20)
    assert lanes.lane_weights[0] == pytest.approx(1 / 3, rel=SETTLE)
    assert not balancer.settling


def test_a_steady_skew_beyond_the_dead_band_is_split_to_within_settle():
    # 6% apart costs 6% of every collective (a step's last one ends with its slowest lane): chased
    lanes = FakeLanes([106, 100])
    balancer = LaneBalancer(lanes, 1)
    run(lanes, balancer, 20, 16 << 20)
    assert SETTLE < 0.06 and DEADBAND < 0.06 and balancer.changes >= 1
    assert lanes.lane_weights[0] == pytest.approx(106 / 206, rel=SETTLE)
    assert lanes.collective_ns(16 << 20) <= (16 << 20) / 206 * (1 + SETTLE)


def test_rebalanced_normalizes_floors_and_keeps_the_weights_when_a_lane_moved_nothing():
    assert rebalanced([1.0, 1.0], [3.0, 0.0]) == [1.0, 1.0]
    assert rebalanced([1.0, 3.0], [1.0, 1.0]) == [0.375, 0.625]
    floored = rebalanced([1.0, 1.0], [1000.0, 1.0], step=1.0)  # the slow lane keeps a floor
    floor = MIN_SHARE / 2
    assert floored[1] == pytest.approx(floor / (1000 / 1001 + floor))
    assert sum(floored) == pytest.approx(1.0)


def test_rebalancing_off_only_counts():
    lanes = FakeLanes([1, 1])
    balancer = LaneBalancer(lanes, 0)
    for _ in range(5):
        balancer.before_request()
    assert balancer.requests == 5 and not lanes.switches and balancer.decisions == 0


def test_proxy_group_alloc_and_supports():
    group = ProxyGroup(Config(num_lanes=2), 0, 2)
    group.plan = planner.plan(group.config, [Peer("127.0.0.1", 2)] * 2, 0, single_host=True)
    assert group.supports(torch.bfloat16) and not group.supports(torch.complex64)
    group.pool = BufferPool()
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


class RecordingMember:
    """The negotiation member's submit and lane weights, recorded in order: ("submit", request,
    description) and ("weights", weights) per call."""

    def __init__(self):
        self.calls = []

    def set_lane_weights(self, weights):
        self.calls.append(("weights", list(weights)))

    def submit(self, request, description):
        self.calls.append(("submit", request, description))
        return 100 + sum(call[0] == "submit" for call in self.calls)


def test_every_collective_passes_the_hooks_once_on_the_one_submit_path():
    """allreduce, broadcast and allgather all run the before_submit hooks before they are submitted
    (so a policy's new weights reach the member first and apply to that very collective) and the
    after_submit hooks with what the rank contributed, once each. No request carries lane
    boundaries (the run order does); the allgather lays its row out by equal shares."""
    group = ProxyGroup(Config(num_lanes=2), 0, 2)
    # two hosts: the flat ring, whose allgather has its own schedule (one host: a sum, plan.py)
    group.plan = planner.plan(group.config, [Peer("10.0.0.1", 2), Peer("10.0.0.2", 2)], 0, single_host=False)
    assert group.plan.layout is None
    group.pool, group.member = BufferPool(), RecordingMember()
    group.set_lane_weights([1.0, 1.0])
    calls = []
    group.before_submit.append(lambda: (calls.append("before"), group.set_lane_weights([1.0, 3.0])))
    gathered = []
    group.after_submit.append(lambda name, nbytes, ticket: calls.append((name, nbytes, ticket)))
    try:
        x = torch.arange(8, dtype=torch.float32)
        group.allreduce([x], [torch.empty(8)], "sum", average=False, prescale=1.0, postscale=1.0)
        group.broadcast(x, torch.empty(8), "bcast", root=0)
        request = group.allgather(torch.arange(6, dtype=torch.int32) + 10, "gather")
        gathered = request._buffer.view(torch.int32, 0, 12).tolist()
    finally:
        group.pool.close()
    assert calls == ["before", ("sum", 32, 101), "before", ("bcast", 32, 102), "before", ("gather", 24, 103)]
    kinds = [call[0] for call in group.member.calls]
    assert kinds == ["weights", "weights", "submit", "weights", "submit", "weights", "submit"]
    assert group.member.calls[1] == ("weights", [1.0, 3.0])
    assert all(list(call[1].lane_begin) == [] for call in group.member.calls if call[0] == "submit")
    # Rank 0's row in chunk 1 of each lane's region: lane 0 columns [0, 3), lane 1 [3, 6).
    assert gathered[3:6] == [10, 11, 12] and gathered[9:12] == [13, 14, 15]


def _reference_boundaries(count, weights):
    """The lane boundaries as the workers once computed them in Python: the coordinator's C++
    function (_C.shard_boundaries) must give the same integers."""
    total = 0.0
    for w in weights:
        total += w
    bounds, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        bounds.append(int(count * acc / total))
    bounds.append(count)
    return bounds


def test_shard_boundaries_are_computed_once_in_cpp_with_the_same_integers():
    rng = random.Random(7)
    cases = [(8, [1.0, 3.0]), (10, [1.0, 1.0, 1.0]), (0, [1.0, 2.0]), (5, [2.0]), (2**40 + 3, [0.1, 0.2, 0.7])]
    for _ in range(2000):
        lanes = rng.randint(1, 16)
        weights = [rng.choice([1.0, rng.uniform(0.2, 1.0), rng.random() + 1e-9]) for _ in range(lanes)]
        cases.append((rng.choice([rng.randint(0, 100), rng.randint(0, 1 << 34)]), weights))
    for count, weights in cases:
        assert _C.shard_boundaries(count, weights) == _reference_boundaries(count, weights), (count, weights)
    for bad in ([], [1.0, 0.0], [1.0, -1.0], [float("nan")], [float("inf"), 1.0]):
        with pytest.raises(ValueError, match="lane weights"):
            _C.shard_boundaries(10, bad)
