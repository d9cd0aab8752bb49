"""The data plane's plan (fasthorovod/proxy/plan.py) on synthetic peers and probe curves: no process
is started. Each test states a choice start-up makes, and why, as the plan reports it."""
import pytest

from fasthorovod.config import Config, ConfigError
from fasthorovod.proxy import plan as planner
from fasthorovod.proxy import probe
from fasthorovod.proxy.plan import Peer

MBIT = 1e6 / 8  # bytes/s


def peers(*hosts: str, cpus: int = 8):
    return [Peer(host, cpus) for host in hosts]


def settings(**env: str) -> Config:
    return Config.from_env({f"FASTHOROVOD_{name.upper()}": value for name, value in env.items()})


def capped_hop(link_mbit: float = 1000, per_flow_mbit: float = 200):
    """A hop of a cloud that caps every flow: n flows carry min(n x cap, link)."""
    return {n: min(n * per_flow_mbit, link_mbit) * 0.95 * MBIT for n in (1, 2, 4, 8, 16)}


FOUR_HOSTS = peers("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4")


def test_with_nothing_set_and_nothing_measured_the_defaults_hold_and_say_so():
    p = planner.plan(settings(), FOUR_HOSTS, 0, single_host=False)
    assert (p.lanes, p.sockets_per_lane, p.threshold_bytes) == (4, 1, 1 << 20)
    assert p.probes and p.flow_choice is None  # across hosts the probe will measure
    assert p.lanes_because == "default lanes" and p.threshold_because == "default"
    assert p.layout is None and p.flat_because is None  # one rank per host: nothing to explain


def test_the_probes_curves_choose_the_sockets_per_lane_from_the_knee():
    hops = [capped_hop() for _ in FOUR_HOSTS]  # 5 flows fill a 1 Gbit/s link at 200 Mbit/s per flow
    p = planner.plan(settings(), FOUR_HOSTS, 2, single_host=False, hops=hops)
    assert p.flow_choice.knee_flows == 8 and (p.lanes, p.sockets_per_lane) == (4, 2)
    assert p.sockets_because == "probe" and p.flows == 8
    assert "needs 1 lane" in p.lanes_because and "at least 4" in p.lanes_because
    assert p.describe()["probe"]["knee_flows"] == 8
    assert p.summary().startswith("data plane: 4 lanes x 2 sockets (slowest hop carries")


def test_rehashing_lets_the_plan_take_the_knee_one_flows_rate_implies():
    # a hop whose 8 flows read 7% low although 8 x 190 Mbit/s would fill it: flows that collided
    collided = {1: 190 * MBIT, 2: 379 * MBIT, 4: 726 * MBIT, 8: 858 * MBIT, 16: 920 * MBIT}
    hops = [collided] + [capped_hop() for _ in range(3)]
    assert planner.plan(settings(), FOUR_HOSTS, 0, single_host=False, hops=hops).sockets_per_lane == 2
    assert planner.plan(settings(rehash="0"), FOUR_HOSTS, 0, single_host=False, hops=hops).sockets_per_lane == 4


def test_one_slow_hop_decides_for_the_whole_ring():
    hops = [capped_hop() for _ in range(3)] + [capped_hop(per_flow_mbit=60)]
    p = planner.plan(settings(), FOUR_HOSTS, 0, single_host=False, hops=hops)
    assert p.flow_choice.knee_flows == 16 and p.sockets_per_lane == 4


def test_a_fast_network_gets_more_lanes_but_never_more_than_the_fewest_cpus_of_any_worker():
    fast = [{n: min(n * 2000, 40000) * MBIT for n in (1, 2, 4, 8, 16, 32)} for _ in FOUR_HOSTS]  # 40 Gbit/s
    roomy = planner.plan(settings(), FOUR_HOSTS, 0, single_host=False, hops=fast)
    assert roomy.lanes == 5  # 5 GB/s needs 5 lanes of 1 GB/s
    tight = [Peer(p.host, 8) for p in FOUR_HOSTS[:3]] + [Peer(FOUR_HOSTS[3].host, 4)]
    assert planner.plan(settings(), tight, 0, single_host=False, hops=fast).lanes == 4
    assert "at most 4 CPUs per worker" in planner.plan(settings(), tight, 0, single_host=False, hops=fast).lanes_because


def test_the_users_settings_win_over_the_probe():
    hops = [capped_hop() for _ in FOUR_HOSTS]
    p = planner.plan(settings(num_lanes="2"), FOUR_HOSTS, 0, single_host=False, hops=hops)
    assert p.lanes == 2 and p.lanes_because == "lanes from FASTHOROVOD_NUM_LANES"
    assert p.sockets_per_lane == 4  # the knee's 8 flows over the user's 2 lanes
    told = planner.plan(settings(sockets_per_lane="3", probe="1"), FOUR_HOSTS, 0, single_host=False, hops=hops)
    assert not told.probes and told.flow_choice is None  # nothing left for the probe to choose
    assert told.sockets_per_lane == 3 and told.sockets_because == "FASTHOROVOD_SOCKETS_PER_LANE"


def test_the_probe_runs_only_where_it_can_choose_and_there_is_a_network():
    assert planner.probes(settings(), single_host=False)
    assert not planner.probes(settings(), single_host=True)
    assert planner.probes(settings(probe="1"), single_host=True)
    assert not planner.probes(settings(probe="0"), single_host=False)
    assert not planner.probes(settings(num_lanes="0", probe="1"), single_host=False)
    on_loopback = planner.plan(settings(), peers("127.0.0.1", "127.0.0.1"), 0, single_host=True)
    assert on_loopback.sockets_because == "default (one host: no probe)"
    assert planner.plan(settings(probe="0"), FOUR_HOSTS, 0, single_host=False).sockets_because == \
        "default (FASTHOROVOD_PROBE=0)"


def test_single_host_jobs_send_only_large_allreduces_through_the_proxies_unless_told():
    two = peers("127.0.0.1", "127.0.0.1")
    assert planner.plan(settings(), FOUR_HOSTS, 0, single_host=False).threshold_bytes == 1 << 20
    one_host = planner.plan(settings(), two, 0, single_host=True)
    assert one_host.threshold_bytes == planner.SINGLE_HOST_PROXY_THRESHOLD == 8 << 20
    assert "one host" in one_host.threshold_because
    for value in ("1048576", "0"):
        told = planner.plan(settings(proxy_threshold_bytes=value), two, 0, single_host=True)
        assert told.threshold_bytes == int(value) and told.threshold_because == "FASTHOROVOD_PROXY_THRESHOLD_BYTES"


def test_even_hosts_run_the_hierarchical_allreduce_and_each_rank_rings_with_its_peer_on_the_next_host():
    six = peers("a", "a", "b", "b", "c", "c")
    p = planner.plan(settings(), six, 3, single_host=False)
    assert p.layout is not None and (p.layout.num_hosts, p.layout.local_size, p.layout.local_rank) == (3, 2, 1)
    assert p.ring_next() == 5  # local rank 1 of the next host
    assert p.describe()["hierarchical"] == {"hosts": 3, "ranks_per_host": 2, "host_index": 1, "local_rank": 1}
    flat = p.flat("rank 4 cannot share memory with its host: denied")
    assert flat.layout is None and flat.ring_next() == 4 and flat.flat_because.startswith("rank 4")


def test_the_flat_ring_says_why_where_ranks_share_hosts():
    uneven = peers("a", "a", "b")
    p = planner.plan(settings(), uneven, 0, single_host=False)
    assert p.layout is None and p.flat_because == "the hosts run different numbers of ranks (1, 2)"
    off = planner.plan(settings(hierarchical="0"), peers("a", "a", "b", "b"), 0, single_host=False)
    assert off.layout is None and off.flat_because == "FASTHOROVOD_HIERARCHICAL=0"
    assert planner.plan(settings(hierarchical="0"), FOUR_HOSTS, 0, single_host=False).flat_because is None


def test_a_required_hierarchical_allreduce_that_cannot_run_is_an_error_naming_why():
    with pytest.raises(ConfigError, match="FASTHOROVOD_HIERARCHICAL=1, but every host runs one rank"):
        planner.plan(settings(hierarchical="1"), FOUR_HOSTS, 0, single_host=False)
    with pytest.raises(ConfigError, match=r"different numbers of ranks \(1, 2\).*ranks per host: \[2, 1\]"):
        planner.plan(settings(hierarchical="1"), peers("a", "a", "b"), 0, single_host=False)
    assert planner.plan(settings(hierarchical="1"), peers("a", "a"), 1, single_host=True).hierarchical_required


def test_the_hierarchical_rings_share_a_link_so_the_lanes_count_the_rate_per_ring():
    hosts = peers("a", "a", "b", "b")
    fast = [{n: min(n * 2000, 20000) * MBIT for n in (1, 2, 4, 8, 16)}] * 2  # 20 Gbit/s between hosts
    p = planner.plan(settings(), hosts, 0, single_host=False, hops=fast)
    # 2.5 GB/s over 2 rings: 1.25 GB/s per ring needs 2 lanes, so the floor of 4 holds
    assert p.lanes == 4 and "over 2 rings" in p.lanes_because


def test_a_reused_probe_is_described_as_such():
    hops = [capped_hop() for _ in FOUR_HOSTS]
    p = planner.plan(settings(), FOUR_HOSTS, 0, single_host=False, hops=hops)
    import dataclasses

    reused = dataclasses.replace(p, probe_run=planner.ProbeRun(runs=0, reused_hosts=6))
    assert "earlier start-up of this job among 6 hosts, these 4 among them" in reused.summary()
    assert reused.describe()["probe"]["reused"] is True


def test_every_rank_computes_the_same_choices():
    hops = [capped_hop(per_flow_mbit=f) for f in (200, 180, 220, 150)]
    plans = [planner.plan(settings(), FOUR_HOSTS, r, single_host=False, hops=hops) for r in range(4)]
    assert len({(p.lanes, p.sockets_per_lane, p.threshold_bytes) for p in plans}) == 1
    assert [p.ring_next() for p in plans] == [1, 2, 3, 0]


def test_bad_ranks_and_missing_measurements_are_refused():
    with pytest.raises(ValueError, match="rank 4 is not among 4 peers"):
        planner.plan(settings(), FOUR_HOSTS, 4, single_host=False)
    with pytest.raises(ValueError, match="every hop needs at least one measurement"):
        planner.plan(settings(), FOUR_HOSTS, 0, single_host=False, hops=[{}] * 4)


def test_proxies_run_only_where_there_is_someone_to_talk_to():
    assert planner.enabled(settings(), 2) and not planner.enabled(settings(), 1)
    assert not planner.enabled(settings(num_lanes="0"), 8)
    assert probe.MIN_LANES == planner.DEFAULT_LANES  # the floor the probe keeps is the default
