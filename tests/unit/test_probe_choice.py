"""The choice of lanes and of sockets per lane from the path probe's curves (fasthorovod/proxy/probe.py)."""
import math

import pytest

from fasthorovod.config import MAX_LANES
from fasthorovod.proxy import probe

MBIT = 1e6 / 8


def capped(per_flow_mbit, link_mbit, counts=(1, 2, 4, 8, 16)):
    """The curve of a link with a per-flow cap: n flows carry min(n * cap, link)."""
    return {n: min(n * per_flow_mbit, link_mbit) * MBIT for n in counts}


def test_a_lower_per_flow_cap_needs_more_flows():
    assert probe.choose([capped(200, 950)], lanes=4).sockets_per_lane == 2  # knee at 8 flows
    assert probe.choose([capped(100, 950)], lanes=4).sockets_per_lane == 4  # knee at 16
    assert probe.choose([capped(400, 950)], lanes=4).sockets_per_lane == 1  # knee at 4
    assert probe.choose([capped(200, 950)], lanes=2).sockets_per_lane == 4


def test_no_per_flow_cap_means_one_socket_per_lane():
    choice = probe.choose([{1: 3e9, 2: 3.05e9}], lanes=4)
    assert (choice.knee_flows, choice.sockets_per_lane) == (1, 1)


def test_the_knee_is_the_fewest_flows_within_95_percent_of_the_best():
    hop = {1: 200 * MBIT, 2: 400 * MBIT, 4: 800 * MBIT, 8: 900 * MBIT, 16: 930 * MBIT}
    assert probe.choose([hop], lanes=4).knee_flows == 8  # 900 >= 0.95 * 930
    hop[8] = 850 * MBIT
    assert probe.choose([hop], lanes=4).knee_flows == 16


def test_the_slowest_hop_decides_and_a_hop_that_stopped_early_counts_as_flat():
    fast = capped(400, 950, counts=(1, 2, 4))  # stopped doubling at its knee (4 flows)
    slow = capped(100, 950)
    curve = probe.ring_curve([fast, slow])
    assert curve[16] == pytest.approx(950 * MBIT)  # fast hop flat at 950 beyond 4 flows
    assert curve[2] == pytest.approx(200 * MBIT)
    assert probe.choose([fast, slow], lanes=4).knee_flows == 16
    # every rank computes the same answer from the same exchanged curves, whatever their order
    assert probe.choose([slow, fast], lanes=4) == probe.choose([slow, fast], lanes=4)


def test_one_disturbed_phase_does_not_pull_the_choice_down():
    # measured under CPU load on 4:1gbit:200mbit (knee 8): one hop lost its 8-flow phase, another
    # its 16-flow phase; the lowest-aggregate curve reads 4: 726, 8: 742, 16: 397
    good = {1: 189 * MBIT, 2: 377 * MBIT, 4: 730 * MBIT, 8: 921 * MBIT, 16: 925 * MBIT}
    stalled_at_8 = {**good, 8: 742 * MBIT}
    stalled_at_8.pop(16)  # that hop stopped doubling: 8 flows gained too little
    stalled_at_16 = {**good, 16: 397 * MBIT}
    choice = probe.choose([good, stalled_at_8, stalled_at_16, good], lanes=4)
    assert (choice.knee_flows, choice.sockets_per_lane) == (8, 2)
    assert choice.curve[16] == pytest.approx(397 * MBIT)  # the printed curve still shows it
    assert probe.hop_knee(stalled_at_8) == 4


def test_a_phase_that_reads_high_does_not_raise_the_choice():
    # A/B of 2026-12-03 on 4:1gbit:200mbit, after a second probe (merged): hop 0's 32-flow phase read
    # 978 Mbit/s, above what the 1 Gbit/s link carries, and against 95% of that its knee was 32
    hops = [{1: 191, 2: 381, 4: 742, 8: 926, 16: 907, 32: 978},
            {1: 191, 2: 381, 4: 733, 8: 911, 16: 910, 32: 903},
            {1: 193, 2: 382, 4: 726, 8: 916, 16: 900},
            {1: 193, 2: 378, 4: 727, 8: 924, 16: 933, 32: 901}]
    hops = [{n: rate * MBIT for n, rate in hop.items()} for hop in hops]
    assert probe.hop_knee(hops[0]) == 32  # against its own best alone
    assert probe.hop_knees(hops) == [8, 8, 8, 8]  # against the best any other hop reached (933)
    choice = probe.choose(hops, lanes=4)
    assert (choice.knee_flows, choice.sockets_per_lane) == (8, 2)
    assert not probe.disagree(hops)
    # a slow hop still decides: its own best is the lower one
    slow = capped(100, 950)
    assert probe.hop_knees([capped(200, 950), slow, capped(200, 950)]) == [8, 16, 8]
    assert probe.hop_knees([slow]) == [16]


# 4:1gbit:200mbit,buckets=64, a job of 2026-12-06 after its second probe: two hops' 8-flow phase read
# 5-7% low (flows hashed into one bucket), so their measured knee is 16
BUCKETS64 = [{1: 194, 2: 377, 4: 563, 8: 919, 16: 911, 32: 914},
             {1: 190, 2: 375, 4: 722, 8: 897, 16: 923, 32: 918},
             {1: 191, 2: 379, 4: 726, 8: 858, 16: 901, 32: 925},
             {1: 191, 2: 378, 4: 554, 8: 855, 16: 920, 32: 910}]
BUCKETS64 = [{n: rate * MBIT for n, rate in hop.items()} for hop in BUCKETS64]


def test_with_rehashing_a_phase_that_collided_does_not_raise_the_knee():
    assert probe.hop_knees(BUCKETS64) == [8, 8, 16, 16]
    assert (probe.choose(BUCKETS64, lanes=4).sockets_per_lane, probe.choose(BUCKETS64, lanes=4, rehash=True)
            .sockets_per_lane) == (4, 2)
    assert probe.hop_knees(BUCKETS64, rehash=True) == [8, 8, 8, 8]  # 8 x 190 fills 0.95 x 925
    # where one flow's rate says more flows are needed, the measured knee stands
    assert probe.hop_knees([capped(100, 950)], rehash=True) == [16]


def test_with_rehashing_the_measured_knee_stands_where_the_flows_are_not_capped_or_fell_far_short():
    # not capped: one flow carries more than half of the link (a CPU-bound fast path); its 2 flows
    # read low, and more flows are what fills it
    fast = {1: 600 * MBIT, 2: 900 * MBIT, 4: 1100 * MBIT, 8: 1150 * MBIT}
    assert probe.capped_knee(fast, 0.95 * 1150 * MBIT) is None
    assert probe.hop_knees([fast], rehash=True) == probe.hop_knees([fast]) == [4]
    # capped, but 8 flows carried only 60% of the target: fewer buckets than flows, more flows help
    few_buckets = {1: 190 * MBIT, 2: 380 * MBIT, 4: 520 * MBIT, 8: 560 * MBIT, 16: 900 * MBIT}
    assert probe.capped_knee(few_buckets, 0.95 * 900 * MBIT) is None
    assert probe.hop_knees([few_buckets], rehash=True) == [16]
    # without a one-flow phase there is nothing to model
    assert probe.capped_knee({2: 380 * MBIT, 4: 700 * MBIT}, 700 * MBIT) is None


def test_sockets_are_bounded_and_bad_input_is_refused():
    assert probe.choose([capped(1, 950, counts=(1, 2, 4, 8, 16, 32))], lanes=1, max_sockets=8).sockets_per_lane == 8
    with pytest.raises(ValueError, match="lanes must be >= 1"):
        probe.choose([capped(200, 950)], lanes=0)
    with pytest.raises(ValueError, match="every hop needs at least one measurement"):
        probe.choose([{}], lanes=4)


def test_hop_curve_reads_the_probe_phases():
    phases = [{"flows": 1, "seconds": 0.15, "bytes_per_second": 2.5e7, "flow_bytes_per_second": [2.5e7]},
              {"flows": 2, "seconds": 0.15, "bytes_per_second": 5e7, "flow_bytes_per_second": [2.5e7, 2.5e7]}]
    assert probe.hop_curve(phases) == {1: 2.5e7, 2: 5e7}
    assert "knee at 2 flows" in probe.choose([probe.hop_curve(phases)], lanes=4).describe()


def test_hops_that_disagree_are_measured_again_and_keep_their_better_phases():
    # make bench, 2026-12-02: three hops with knee 8, one whose 8-flow phase was disturbed (knee 16)
    good = {1: 190 * MBIT, 2: 378 * MBIT, 4: 730 * MBIT, 8: 915 * MBIT, 16: 919 * MBIT}
    dipped = {**good, 8: 834 * MBIT}
    first = [good, dipped, good, good]
    assert probe.disagree(first) and probe.choose(first, lanes=4).sockets_per_lane == 4
    second = [good, good, {**good, 4: 560 * MBIT}, good]  # another phase dips the second time
    merged = probe.merge(first, second)
    assert not probe.disagree(merged) and probe.choose(merged, lanes=4).sockets_per_lane == 2
    assert merged[2][4] == pytest.approx(730 * MBIT) and merged[1][8] == pytest.approx(915 * MBIT)
    # a hop that needs more flows measures so both times and still decides
    slow = capped(100, 950)
    assert probe.choose(probe.merge([good, slow], [good, slow]), lanes=4).knee_flows == 16
    assert not probe.disagree([good, good])
    # a count measured by one probe only (the doubling stopped earlier in the other) is kept
    assert probe.merge([{1: 1.0, 2: 2.0}], [{1: 1.5}]) == [{1: 1.5, 2: 2.0}]
    with pytest.raises(ValueError, match="measured 1 and 2 hops"):
        probe.merge([good], [good, good])


def test_a_second_probe_measures_only_the_disputed_flow_counts():
    good = {1: 190 * MBIT, 2: 378 * MBIT, 4: 730 * MBIT, 8: 915 * MBIT, 16: 919 * MBIT}
    dipped = {**good, 8: 834 * MBIT}  # knee 16 where the others' is 8
    assert probe.disputed_flows([good, dipped, good]) == (8, 8)  # the highest knee's count is not measured again
    # the second probe's curves hold only 8; the merge keeps the first probe's other counts
    second = [{8: 910 * MBIT}, {8: 912 * MBIT}, {8: 899 * MBIT}]
    merged = probe.merge([good, dipped, good], second)
    assert sorted(merged[1]) == [1, 2, 4, 8, 16] and merged[1][4] == pytest.approx(730 * MBIT)
    assert merged[1][16] == pytest.approx(919 * MBIT)
    assert not probe.disagree(merged) and probe.choose(merged, lanes=4).sockets_per_lane == 2
    # measuring the top count again could only have confirmed the dispute: a better 16-flow reading
    # raises the target 8 flows are measured against
    burst = probe.merge(merged, [{16: 1000 * MBIT}, {16: 1000 * MBIT}, {16: 1000 * MBIT}])
    assert probe.choose(burst, lanes=4).knee_flows == 16
    # a hop that needs more flows: the counts below its knee are measured again and it still decides
    slow = capped(100, 950)
    assert probe.disputed_flows([good, slow]) == (8, 8)
    assert probe.choose(probe.merge([good, slow], [{8: 915 * MBIT}, {8: 800 * MBIT}]), lanes=4).knee_flows == 16
    # knees further apart: only the count one doubling below the highest, which decides the job
    assert probe.hop_knees([capped(200, 950), capped(50, 950)]) == [4, 16]
    assert probe.disputed_flows([capped(200, 950), capped(50, 950)]) == (8, 8)
    assert probe.disputed_flows([good, good]) == (8, 8)  # knees that agree (a forced second probe)


def test_lanes_grow_only_where_four_proxies_cpu_cannot_carry_the_ring_and_the_cpus_allow():
    lane = probe.LANE_BYTES_PER_SECOND
    assert probe.choose_lanes(1e9 / 8, cpus_per_worker=0.5) == probe.MIN_LANES == 4  # 1 Gbit/s, 2 cores, 4 ranks
    assert probe.choose_lanes(4 * lane, cpus_per_worker=12) == 4
    assert probe.choose_lanes(4 * lane + 1, cpus_per_worker=12) == 5
    assert probe.choose_lanes(12.5e9, cpus_per_worker=12) == 12      # 100 Gbit/s, one rank on 96 cores / 8
    assert probe.choose_lanes(12.5e9, cpus_per_worker=16) == math.ceil(12.5e9 / lane)
    assert probe.choose_lanes(12.5e9, cpus_per_worker=6) == 6        # the CPUs bound it ...
    assert probe.choose_lanes(12.5e9, cpus_per_worker=2) == 4        # ... but not below MIN_LANES
    assert probe.choose_lanes(12.5e9, cpus_per_worker=12, rings_per_link=8) == 4  # 8 rings share the link
    assert probe.choose_lanes(1e15, cpus_per_worker=1000) == MAX_LANES == 64  # csrc/shm/channel.h kMaxLanes
    for bad in ((-1.0, 4), (1e9, 0), (float("nan"), 4)):
        with pytest.raises(ValueError, match="choose_lanes"):
            probe.choose_lanes(*bad)
    with pytest.raises(ValueError, match="rings_per_link"):
        probe.choose_lanes(1e9, 4, rings_per_link=0)
