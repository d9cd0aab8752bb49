"""The flow re-hashing policy (fasthorovod/proxy/rehash.py) on simulated sockets: which flows it
finds slow, when it asks them to reconnect, and that it leaves even or unmeasured flows alone."""
import random
import types

from fasthorovod.proxy.probe import FlowChoice
from fasthorovod.proxy.rehash import (MAX_REHASHES, MIN_BACKLOGGED_NS, MIN_BYTES, SLOW, WARM_UP_COLLECTIVES,
                                      WARM_UP_MAX_BYTES, WINDOWS, FlowRehasher, collisions, expected_flow_rate, link_rate,
                                      slow_sockets, warm_up, warm_up_bytes)


CAP = 0.025  # bytes per ns: a 200 Mbit/s per-flow cap


class FakeSockets:
    """ProxyGroup's re-hashing mechanisms: per lane and send socket, counters that advance per
    request as flows of the given rates would (frames go to the socket with the least backlog, so
    each socket carries bytes in proportion to its rate and is backlogged all the collective), and
    request_rehash, which gives the socket a new rate (its new hash) after the next request."""

    def __init__(self, rates, fresh=lambda lane, socket: 1.0, plan=None):
        self.plan = plan
        self.rates = [list(lane) for lane in rates]  # per lane and socket, in CAPs
        self.fresh = fresh  # the rate a reconnected socket gets
        self.sent = [[0] * len(lane) for lane in rates]
        self.backlogged = [[0] * len(lane) for lane in rates]
        self.asked = []  # (request number, lane, sockets)
        self.pending = []
        self.requests = 0

    @property
    def lanes(self):
        return len(self.rates)

    def lane_progress(self):
        return tuple((sum(lane), 0) for lane in self.sent)

    def socket_progress(self, lane):
        return list(zip(self.sent[lane], self.backlogged[lane]))

    def request_rehash(self, lane, sockets):
        self.asked.append((self.requests, lane, list(sockets)))
        self.pending.append((lane, list(sockets)))

    def post(self, nbytes_per_lane):
        self.requests += 1
        for lane, rates in enumerate(self.rates):
            ns = nbytes_per_lane / (sum(rates) * CAP)  # the lane's sockets all drain until it is done
            for socket, rate in enumerate(rates):
                self.sent[lane][socket] += int(rate * CAP * ns)
                self.backlogged[lane][socket] += int(ns)
        for lane, sockets in self.pending:  # replaced after the collective
            for socket in sockets:
                self.rates[lane][socket] = self.fresh(lane, socket)
        self.pending.clear()


def run(sockets, policy, requests, nbytes_per_lane=16 << 20):
    for _ in range(requests):
        policy.before_request()
        sockets.post(nbytes_per_lane)


def test_slow_sockets_are_those_well_below_the_upper_quartile_of_the_measured_ones():
    ms = 100_000_000
    deltas = {(0, 0): (100, ms), (0, 1): (40, ms), (1, 0): (100, ms), (1, 1): (95, ms),
              (2, 0): (1, MIN_BACKLOGGED_NS - 1)}  # not backlogged long enough: not measured
    assert slow_sockets(deltas) == [(0, 1)]
    # two of four flows share a cap: the median would be theirs; the upper quartile is not
    assert slow_sockets({(0, 0): (200, ms), (1, 0): (100, ms), (2, 0): (100, ms), (3, 0): (200, ms)}) == [(1, 0), (2, 0)]
    assert slow_sockets({(0, 0): (100, ms), (0, 1): (10, ms)}) == [], "two sockets: nothing to compare with"


def test_a_flow_that_shares_a_cap_reconnects_after_two_looks_and_the_others_stay():
    sockets = FakeSockets([[1.0, 1.0], [1.0, 0.5], [1.0, 1.0], [1.0, 1.0]])  # lane 1 socket 1: a shared cap
    forgotten = []
    policy = FlowRehasher(sockets, forget=lambda: forgotten.append(sockets.requests))
    run(sockets, policy, 6)
    # the first request has nothing to compare; looks 1 and 2 find it; asked before request 3
    assert sockets.asked == [(WINDOWS, 1, [1])] and policy.requested == 1, sockets.asked
    assert forgotten == [WINDOWS], "the balancer forgets the window of the switch"
    assert sockets.rates[1][1] == 1.0


def test_an_unlucky_new_hash_is_found_again_and_replaced_until_it_is_lucky():
    draws = iter([0.5, 0.5, 1.0])  # the first two new connections collide again
    sockets = FakeSockets([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], fresh=lambda lane, socket: next(draws))
    policy = FlowRehasher(sockets)
    run(sockets, policy, 12)
    assert [(lane, s) for _, lane, s in sockets.asked] == [(0, [2])] * 3
    assert sockets.rates[0][2] == 1.0


def test_where_the_link_is_the_limit_only_a_flow_far_below_its_share_of_it_is_replaced():
    ms = 100_000_000
    uneven = {(lane, 0): (rate, ms) for lane, rate in enumerate([100, 70, 100, 100, 20, 100, 100, 100])}
    assert slow_sockets(uneven) == [(1, 0), (4, 0)]
    assert slow_sockets(uneven, expected=800.0) == [(4, 0)], "800 bytes/s expected (the others: 1000): 700 is TCP's rough fairness"


def test_a_pair_in_one_bucket_below_its_share_of_a_full_link_is_replaced():
    # 8 flows on a 920 Mbit/s link: each may expect 115 Mbit/s; six drain at 120-130, two that
    # share one 200 Mbit/s bucket at 88 each: below 80% of the expected share, so they reconnect
    ms = 100_000_000
    rates = [125, 130, 120, 88, 128, 122, 88, 126]  # Mbit/s
    deltas = {(lane, socket): (int(rates[2 * lane + socket] * 1e6 / 8 / 10), ms)  # bytes in 100 ms
              for lane in range(4) for socket in range(2)}
    assert slow_sockets(deltas, expected=115e6 / 8) == [(1, 1), (3, 0)]
    assert SLOW == 0.8


def test_the_expected_rate_is_one_flows_or_the_links_share_per_flow_from_the_probes_curve():
    choice = FlowChoice(sockets_per_lane=2, knee_flows=8, curve={1: 25e6, 2: 50e6, 4: 100e6, 8: 115e6}, hops=[])
    plan = types.SimpleNamespace(flow_choice=choice, flows=4, layout=None)
    assert expected_flow_rate(plan) == 25e6  # 4 flows: the per-flow cap is the limit
    assert expected_flow_rate(types.SimpleNamespace(flow_choice=choice, flows=16, layout=None)) == 115e6 / 16
    assert expected_flow_rate(types.SimpleNamespace(flow_choice=None, flows=16, layout=None)) is None


def test_the_links_rate_comes_from_hops_whose_probe_flows_did_not_collide():
    # Measured on a 64-bucket cloud: into one rank every flow count hashed into two buckets (378
    # Mbit/s with 4 to 16 flows), the others reached the link. Its curve alone would make each of
    # 8 flows expect 47 Mbit/s, so that no flow of that hop would ever look slow.
    mbit = 1e6 / 8
    collided = {1: 190 * mbit, 2: 191 * mbit, 4: 378 * mbit, 8: 378 * mbit, 16: 378 * mbit}
    clean = {1: 190 * mbit, 2: 380 * mbit, 4: 726 * mbit, 8: 914 * mbit, 16: 917 * mbit}
    slower = {1: 190 * mbit, 2: 380 * mbit, 4: 700 * mbit, 8: 880 * mbit, 16: 890 * mbit}
    choice = FlowChoice(sockets_per_lane=2, knee_flows=8, curve=collided, hops=[clean, collided, slower, clean])
    assert link_rate(choice) == 890 * mbit  # the slowest hop that did not collide
    plan = types.SimpleNamespace(flow_choice=choice, flows=8, layout=None)
    assert expected_flow_rate(plan) == 890 * mbit / 8
    # every hop collided: the best any hop carried
    assert link_rate(FlowChoice(2, 8, collided, [collided, {1: 190 * mbit, 2: 190 * mbit, 4: 560 * mbit}])) == 560 * mbit
    # no per-hop curves kept: the slowest hop's best, as before
    assert link_rate(FlowChoice(2, 8, clean, [])) == 917 * mbit


def test_a_socket_that_stays_unlucky_is_replaced_at_most_max_rehashes_times():
    sockets = FakeSockets([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]], fresh=lambda lane, socket: 0.5)  # always shares
    policy = FlowRehasher(sockets)
    run(sockets, policy, 40)
    assert [(lane, s) for _, lane, s in sockets.asked] == [(0, [2])] * MAX_REHASHES


def test_even_flows_and_noise_within_ten_percent_are_left_alone():
    rng = random.Random(1)
    sockets = FakeSockets([[1.0] * 4 for _ in range(4)])
    policy = FlowRehasher(sockets)
    for _ in range(40):
        sockets.rates = [[1.0 + rng.uniform(-0.1, 0.1) for _ in lane] for lane in sockets.rates]
        run(sockets, policy, 1)
    assert sockets.asked == [] and policy.looks == 39  # the first request has nothing to compare


def test_a_look_waits_until_every_lane_has_moved_min_bytes():
    sockets = FakeSockets([[1.0, 0.3], [1.0, 1.0]])
    policy = FlowRehasher(sockets)
    run(sockets, policy, 20, nbytes_per_lane=MIN_BYTES // 8 + 1024)  # 2.5 windows' worth in all
    assert policy.looks == 2 and sockets.asked == [(16, 0, [1])], (policy.looks, sockets.asked)


MBIT = 1e6 / 8  # bytes/s


def _choice(*hops):
    return FlowChoice(sockets_per_lane=2, knee_flows=8, curve={}, hops=[{n: r * MBIT for n, r in hop.items()}
                                                                        for hop in hops])


def test_the_probe_sees_flows_collide_where_twice_the_flows_carry_well_below_twice_the_rate():
    clean = {1: 190, 2: 376, 4: 729, 8: 918, 16: 914}  # 8 flows fill the link: no collision
    four_like_two = {1: 190, 2: 376, 4: 555, 8: 918}   # two of the four flows share a cap
    assert collisions(_choice(clean, clean)) == []
    assert collisions(_choice(clean, four_like_two)) == [(1, 2, 376 * MBIT, 555 * MBIT)]
    link_shared = {1: 200, 2: 200, 4: 200}  # one cap for every flow is a link's limit, not a collision
    assert collisions(_choice(link_shared)) == []
    assert collisions(None) == [], "no probe, nothing seen"


def test_a_warm_up_allreduce_has_every_lane_send_a_look_of_bytes():
    flat = types.SimpleNamespace(layout=None, size=4, lanes=4)
    nbytes = warm_up_bytes(flat)
    assert 2 * 3 / 4 * nbytes / 4 >= 1.25 * MIN_BYTES > 2 * 3 / 4 * (nbytes - 4096) / 4 and nbytes % 4096 == 0
    hier = types.SimpleNamespace(layout=types.SimpleNamespace(local_size=2, num_hosts=2), size=4, lanes=4)
    assert 2 * 1 / 2 * warm_up_bytes(hier) / (4 * 2) >= 1.25 * MIN_BYTES  # each local rank's half, 2 hosts
    eight_per_host = types.SimpleNamespace(local_size=8, num_hosts=2)
    assert warm_up_bytes(types.SimpleNamespace(layout=eight_per_host, size=16, lanes=16)) == WARM_UP_MAX_BYTES
    assert warm_up_bytes(types.SimpleNamespace(layout=types.SimpleNamespace(local_size=4, num_hosts=1), size=4,
                                               lanes=4)) == 0, "one host: no ring, nothing to re-hash"


class WarmUpGroup(FakeSockets):
    """FakeSockets behind ProxyGroup's allreduce: each request runs the re-hasher's hook first, as
    the group's one submit path does, then moves `bytes x 2(n-1)/n / lanes` per lane."""

    def __init__(self, rates, setting, choice, fresh=lambda lane, socket: 1.0):
        super().__init__(rates, fresh, plan=types.SimpleNamespace(layout=None, size=4, lanes=len(rates),
                                                                  flow_choice=choice, flows=2 * len(rates)))
        self.config = types.SimpleNamespace(rehash_warm_up=setting)
        self.rehasher = FlowRehasher(self)
        self.posted = []

    def allreduce(self, tensors, outputs, name, average, prescale, postscale):
        assert outputs is None and not average, "zeros, summed, into lent outputs"
        self.posted.append(name)
        nbytes = tensors[0].numel() * 4
        self.rehasher.before_request()
        self.post(int(nbytes * 2 * 3 / 4 / self.lanes))
        return types.SimpleNamespace(wait=lambda: None)


def test_where_the_probe_saw_collisions_start_up_replaces_the_colliding_flow_before_the_job_starts():
    collided = _choice({1: 190, 2: 376, 4: 555, 8: 918})
    group = WarmUpGroup([[1.0, 1.0], [1.0, 0.5], [1.0, 1.0], [1.0, 1.0]], "auto", collided)
    said = warm_up(group, group.rehasher)
    assert group.posted == [f"fasthorovod.rehash.warm_up.{i}" for i in range(WARM_UP_COLLECTIVES)]
    assert group.asked == [(WINDOWS, 1, [1])] and group.rates[1][1] == 1.0, group.asked
    assert said.startswith("the probe saw flows collide (1 time; into rank 0 4 flows carried 555 Mbit/s, 2 carried "
                           "376): 4 allreduces of") and "replaced 1 of this rank's connections" in said, said


def test_the_warm_up_follows_its_setting():
    clean = _choice({1: 190, 2: 376, 4: 729, 8: 918})
    for setting, runs in (("auto", False), ("1", True), ("0", False)):
        group = WarmUpGroup([[1.0, 1.0]] * 4, setting, clean)
        said = warm_up(group, group.rehasher)
        assert (said is not None) == runs and bool(group.posted) == runs, setting
    collided = _choice({1: 190, 2: 376, 4: 555, 8: 918})
    group = WarmUpGroup([[1.0, 1.0]] * 4, "0", collided)
    assert warm_up(group, group.rehasher) is None and not group.posted
    group = WarmUpGroup([[1.0, 1.0]] * 4, "auto", collided)
    assert "(FASTHOROVOD_REHASH=0)" in warm_up(group, None), "a rank without the rule takes part all the same"
