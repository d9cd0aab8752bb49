"""The CPU placement model and planner (lab/placement.py), without processes:
topology from a fake sysfs tree, the fit recovering known parameters, predictions and plans in
cases whose answer is clear."""
import dataclasses
import json
import math

import pytest

from lab import placement as placement_module
from lab.placement import (Busy, Placement, PlacementModel, ProxySpec, Topology, parse_cpu_list,
                                         plan, read_topology)

# -- topology -------------------------------------------------------------------------------------------


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(root, cores, nodes=None, name="core_cpus_list"):
    """`cores`: list of CPU lists, one per physical core; `nodes`: {node: cpulist text}."""
    for core in cores:
        text = ",".join(map(str, core)) + "\n"
        for cpu in core:
            write(root / "cpu" / f"cpu{cpu}" / "topology" / name, text)
    for node, text in (nodes or {}).items():
        write(root / "node" / f"node{node}" / "cpulist", text + "\n")
    return str(root)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("") == []
    assert parse_cpu_list("0-6:2") == [0, 2, 4, 6]


def test_topology_with_smt_and_numa(tmp_path):
    # 4 cores x 2 threads, Linux numbering: sibling of cpu i is i+4; two NUMA nodes
    root = fake_sysfs(tmp_path, [[0, 4], [1, 5], [2, 6], [3, 7]], {0: "0-1,4-5", 1: "2-3,6-7"})
    topo = read_topology(root, usable=range(8))
    assert topo.smt
    assert topo.siblings(1) == (5,)
    assert topo.core_of[6] == (2, 6)
    assert topo.node_of[5] == 0 and topo.node_of[7] == 1
    assert topo.cores() == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_topology_restricted_affinity_and_old_names(tmp_path):
    # the older thread_siblings_list name; the process may use only CPUs 0, 1, 4
    root = fake_sysfs(tmp_path, [[0, 4], [1, 5], [2, 6], [3, 7]], name="thread_siblings_list")
    topo = read_topology(root, usable=[0, 1, 4])
    assert topo.cpus == (0, 1, 4)
    assert topo.siblings(0) == (4,)
    assert topo.siblings(1) == ()  # its sibling 5 is not usable
    assert topo.node_of == {0: 0, 1: 0, 4: 0}  # no node directory: node 0
    assert "3 usable CPUs" in topo.describe()


def test_topology_without_sysfs(tmp_path):
    topo = read_topology(str(tmp_path / "missing"), usable=[0, 1])
    assert not topo.smt and topo.cores() == [(0,), (1,)]


def test_topology_of_this_host():
    topo = read_topology()
    assert topo.cpus and all(c in topo.core_of for c in topo.cpus)


# -- prediction ----------------------------------------------------------------------------------------

KAPPA = 0.5e-9  # s per wire byte: 2 GB/s of CPU work
MODEL = PlacementModel(kappa=KAPPA, eta=0.6, gamma=0.2, beta=0.3)
TWO = (0, 1)


def placement(lanes, busy=(), cpus=TWO, **kw):
    """`lanes`: per lane, the CPU sets of its local proxies (None: unpinned)."""
    proxies = tuple(ProxySpec(j, c) for j, ends in enumerate(lanes) for c in ends)
    return Placement(cpus, proxies, tuple(busy), **kw)


def test_alone_is_eta_over_kappa():
    pred = MODEL.predict(placement([[(0,)]]))
    assert pred.aggregate == pytest.approx(0.6 / KAPPA)
    assert pred.proxy_cpu == [pytest.approx(0.6)]


def test_clustered_lane_shares_its_cpu():
    # both ends of one lane on one CPU: half a CPU each; they hand the CPU over (one runs while the
    # other waits for its bytes), so neither crowds the other: no clustered penalty
    pred = MODEL.predict(placement([[(0,), (0,)]]))
    assert pred.aggregate == pytest.approx(0.5 / KAPPA)
    assert pred.proxy_clustered == [pytest.approx(0.0)] * 2
    assert sum(pred.proxy_cpu) == pytest.approx(1.0)


def test_two_pinned_neighbours_with_a_third_thread():
    # closed form: the pair and a compute thread on one CPU, a third each; the pair is clustered by
    # the compute only (gamma_busy), and its hand-overs save delta
    model = PlacementModel(kappa=KAPPA, eta=1.0, gamma=0.4, gamma_busy=0.1, beta=0.0, delta=0.25)
    pred = model.predict(placement([[(0,), (0,)]], [Busy((0,))]))
    assert pred.proxy_clustered == [pytest.approx(1.0)] * 2
    assert pred.proxy_peer_clustered == [pytest.approx(1.0)] * 2
    assert pred.proxy_kappa == [pytest.approx(KAPPA * (1 + 0.1 - 0.25))] * 2
    assert pred.busy_cpu == [pytest.approx(1 / 3)]
    assert pred.aggregate == pytest.approx((1 / 3) / (KAPPA * 0.85))
    # two pairs on one CPU: each pair is clustered by the other (gamma) and saves delta
    two = model.predict(placement([[(0,), (0,)], [(0,), (0,)]]))
    assert two.proxy_kappa == [pytest.approx(KAPPA * (1 + 0.4 - 0.25))] * 4
    assert two.aggregate == pytest.approx(2 * 0.25 / (KAPPA * 1.15))


def test_two_proxies_on_two_cpus_double_the_rate():
    one = MODEL.predict(placement([[(0,)]])).aggregate
    two = MODEL.predict(placement([[(0,)], [(1,)]])).aggregate
    assert two == pytest.approx(2 * one)


def test_compute_thread_takes_half_of_a_shared_cpu():
    pred = MODEL.predict(placement([[(0,)]], [Busy((0,))]))
    assert pred.busy_cpu == [pytest.approx(0.5)]
    assert pred.proxy_cpu == [pytest.approx(0.5)]
    assert pred.aggregate < MODEL.predict(placement([[(0,)]])).aggregate


def test_duty_cycle_compute_leaves_the_rest():
    # the compute runs 30% of the time and then takes its fair half of CPU 0; the other 70% the
    # proxy is alone and takes the 0.6 it wants
    pred = MODEL.predict(placement([[(0,)]], [Busy((0,), 0.3)]))
    assert pred.states == 2
    assert pred.busy_cpu == [pytest.approx(0.3 * 0.5)]
    assert pred.proxy_cpu == [pytest.approx(0.3 * 0.5 + 0.7 * 0.6)]
    shared = 0.5 / (KAPPA * (1 + 0.2 * 0.6))  # m = 0.6 + 1: clustered 60% of its time
    assert pred.aggregate == pytest.approx(0.3 * shared + 0.7 * 0.6 / KAPPA)


def test_duty_cycle_is_the_time_average_of_on_and_off():
    pl = placement([[(0,), (1,)]], [Busy((0,), 0.4)])
    on = MODEL.predict(placement([[(0,), (1,)]], [Busy((0,))]))
    off = MODEL.predict(placement([[(0,), (1,)]]))
    pred = MODEL.predict(pl)
    assert pred.aggregate == pytest.approx(0.4 * on.aggregate + 0.6 * off.aggregate)
    assert pred.busy_cpu == [pytest.approx(0.4 * on.busy_cpu[0])]


def test_unpinned_proxy_goes_to_the_idle_cpu():
    # an unpinned proxy next to a compute thread pinned to CPU 0: the balancer does not leave it
    # queued on CPU 0 while CPU 1 is idle
    pred = MODEL.predict(placement([[None]], [Busy((0,))]))
    assert pred.states == 1
    assert pred.aggregate == pytest.approx(0.6 / KAPPA)
    assert pred.busy_cpu == [pytest.approx(1.0)]
    # a 50% compute: while it runs the proxy is on CPU 1, while it sleeps on either idle CPU
    pred = MODEL.predict(placement([[None]], [Busy((0,), 0.5)]))
    assert pred.states == 3
    assert pred.aggregate == pytest.approx(0.6 / KAPPA)


def test_two_unpinned_neighbours_on_two_idle_cpus_run_separated():
    # the separated rate, not the mean of separated and clustered: the balancer pulls the waiting
    # one to the idle CPU
    model = PlacementModel(kappa=KAPPA, eta=0.9, gamma=0.3, beta=0.0)
    apart = model.predict(placement([[(0,), (1,)]]))
    pred = model.predict(placement([[None, None]]))
    assert pred.states == 2
    assert pred.aggregate == pytest.approx(apart.aggregate) == pytest.approx(0.9 / KAPPA)
    # one end pinned, the other free: also apart
    assert model.predict(placement([[(0,), None]])).aggregate == pytest.approx(0.9 / KAPPA)


def test_unpinned_states_keep_the_queues_even():
    # two lanes unpinned on two idle CPUs: the 6 two-and-two splits, equally likely (2 with a lane
    # per CPU, 4 with each lane across both CPUs); never three on one CPU
    model = PlacementModel(kappa=KAPPA, eta=0.9, gamma=0.3, beta=0.0, delta=0.1)
    per_cpu = model.predict(placement([[(0,), (0,)], [(1,), (1,)]])).aggregate
    across = model.predict(placement([[(0,), (1,)], [(0,), (1,)]])).aggregate
    pred = model.predict(placement([[None, None], [None, None]]))
    assert pred.states == 6
    assert pred.aggregate == pytest.approx((2 * per_cpu + 4 * across) / 6)
    # next to a compute thread on CPU 0, proxies that want a whole CPU: one or two of them share
    # CPU 0 (4 + 6 states), never 0 or 3; wanting 0.9, only one (2.8 against 1.8 would move one)
    pl = placement([[None, None], [None, None]], [Busy((0,))])
    for eta, expected in ((1.0, [1] * 4 + [2] * 6), (0.9, [1] * 4)):
        states = placement_module._states(pl, KAPPA, eta)
        assert sorted(sum(p.cpus == (0,) for p in st.proxies) for _, st in states) == expected
        assert sum(w for w, _ in states) == pytest.approx(1.0)


def test_lane_runs_at_its_slowest_proxy():
    pred = MODEL.predict(placement([[(0,), (1,)]], [Busy((0,))]))
    slow = MODEL.predict(placement([[(0,)]], [Busy((0,))])).aggregate
    assert pred.aggregate == pytest.approx(slow, rel=1e-6)


def test_network_caps():
    pred = MODEL.predict(placement([[(0,)], [(1,)]], net_rate=300e6))
    assert pred.aggregate == pytest.approx(300e6)
    pred = MODEL.predict(placement([[(0,)], [(1,)]], lane_rate=100e6))
    assert pred.lane_rates == {0: pytest.approx(100e6), 1: pytest.approx(100e6)}
    assert pred.proxy_cpu[0] == pytest.approx(100e6 * KAPPA)


def test_busy_smt_sibling_raises_cost():
    siblings = {0: (1,), 1: (0,)}
    idle = MODEL.predict(placement([[(0,)]], siblings=siblings))
    busy = MODEL.predict(placement([[(0,)]], [Busy((1,))], siblings=siblings))
    assert busy.proxy_kappa[0] == pytest.approx(KAPPA * 1.3)
    assert busy.aggregate == pytest.approx(idle.aggregate / 1.3)


def test_cpu_taken_by_other_jobs_is_not_shared():
    # another job took 0.7 of CPU 0: the proxy there gets the 0.3 left, crowded by it
    pred = MODEL.predict(placement([[(0,)]], reserved={0: 0.7}))
    assert pred.proxy_cpu == [pytest.approx(0.3)]
    assert pred.proxy_kappa == [pytest.approx(KAPPA * (1 + 0.2 * 0.3))]
    # an unpinned one goes to the CPU nobody else uses
    pred = MODEL.predict(placement([[None]], reserved={0: 0.7}))
    assert pred.aggregate == pytest.approx(0.6 / KAPPA)


def test_bad_affinity_is_refused():
    with pytest.raises(ValueError, match="not within"):
        MODEL.predict(placement([[(5,)]]))


def test_placement_and_model_round_trip_json(tmp_path):
    pl = placement([[(0,), None]], [Busy((1,), 0.5)], siblings={0: (1,)}, net_rate=1e9, reserved={1: 0.25})
    again = Placement.from_json(json.loads(json.dumps(pl.to_json())))
    assert again == pl
    path = tmp_path / "model.json"
    MODEL.save(str(path))
    loaded = PlacementModel.load(str(path))
    assert loaded == MODEL
    assert loaded.predict(pl).aggregate == MODEL.predict(pl).aggregate


# -- fitting -------------------------------------------------------------------------------------------

FIT_PLACEMENTS = [
    placement([[(0,), (1,)]]),
    placement([[(0,), (0,)]]),
    placement([[(0,), (1,)]] * 2),
    placement([[(0,), (1,)]], [Busy((0,))]),
    placement([[(0,), (1,)]] * 4),
    placement([[(0,), (0,)]], [Busy((0,))]),  # the pair with a third thread: identifies delta
]


def synthetic(model, placements, noise=()):
    out = []
    for i, pl in enumerate(placements):
        rates = model.predict(pl).lane_rates
        factor = noise[i % len(noise)] if noise else 1.0
        out.append((pl, {lane: r * factor for lane, r in rates.items()}))
    return out


def test_fit_recovers_known_parameters():
    truth = PlacementModel(kappa=0.8e-9, eta=0.55, gamma=0.25)
    fitted = PlacementModel.fit(synthetic(truth, FIT_PLACEMENTS))
    assert fitted.kappa == pytest.approx(truth.kappa, rel=0.02)
    assert fitted.eta == pytest.approx(truth.eta, abs=0.01)
    assert fitted.gamma == pytest.approx(truth.gamma, abs=0.02)
    assert fitted.fit_info["rms_log_error"] < 1e-3


def test_fit_from_cpu_per_byte_recovers_multipliers():
    # a loopback rig: the peer on the same CPU saves 15% per byte, each co-runner costs 10% more
    truth = PlacementModel(kappa=0.6e-9, eta=0.65, gamma=0.1, delta=0.15)
    rates = synthetic(truth, FIT_PLACEMENTS)
    cpu = [(pl, truth.predict(pl).proxy_kappa) for pl in FIT_PLACEMENTS]
    fitted = PlacementModel.fit(rates, cpu_samples=cpu)
    assert fitted.gamma == pytest.approx(0.1, abs=0.01)
    assert fitted.delta == pytest.approx(0.15, abs=0.01)
    assert fitted.eta == pytest.approx(0.65, abs=0.01)
    assert fitted.kappa == pytest.approx(0.6e-9, rel=0.02)
    assert fitted.fit_info["cpu_per_byte_alone"] == pytest.approx(0.6e-9, rel=0.01)


SHARED = {0: (1,), 1: (0,)}  # two CPUs described as SMT siblings of one core


def test_fit_recovers_beta_and_gamma_busy_from_cpu_per_byte():
    # the fit set of benchmarks/placement.py with the CPUs as one shared core: the pair with a busy
    # sibling (compute on the other CPU) separates beta from delta
    pls = [dataclasses.replace(pl, siblings=SHARED) for pl in FIT_PLACEMENTS + [
        placement([[(1,), (1,)]], [Busy((0,))])]]
    truth = PlacementModel(kappa=0.3e-9, eta=0.9, gamma=0.5, gamma_busy=0.15, beta=0.6, delta=0.05)
    rates = synthetic(truth, pls)
    cpu = [(pl, truth.predict(pl).proxy_kappa) for pl in pls]
    fitted = PlacementModel.fit(rates, cpu_samples=cpu, fit_beta=True)
    assert fitted.beta_measured
    assert fitted.beta == pytest.approx(0.6, abs=0.01)
    assert fitted.gamma == pytest.approx(0.5, abs=0.01)
    assert fitted.gamma_busy == pytest.approx(0.15, abs=0.01)
    assert fitted.delta == pytest.approx(0.05, abs=0.01)
    assert fitted.eta == pytest.approx(0.9, abs=0.01)
    assert fitted.kappa == pytest.approx(0.3e-9, rel=0.02)


def test_peer_on_the_same_cpu_saves_delta_when_a_third_thread_is_there():
    model = PlacementModel(kappa=KAPPA, eta=0.6, gamma=0.2, delta=0.1, beta=0.0)
    alone = model.predict(placement([[(0,), (0,)]]))
    assert alone.proxy_peer == [pytest.approx(1.0)] * 2
    assert alone.proxy_kappa == [pytest.approx(KAPPA)] * 2  # hand-overs only: nothing to save or pay
    crowded = model.predict(placement([[(0,), (0,)]], [Busy((0,))]))
    # clustered 60% of the time (the compute, against its own 0.6): c = 0.6
    assert crowded.proxy_kappa[0] == pytest.approx(KAPPA * (1 + (0.2 - 0.1) * 0.6))
    apart = model.predict(placement([[(0,), (1,)]], [Busy((0,))]))
    assert apart.proxy_peer == [0.0, 0.0]
    assert apart.proxy_peer_clustered == [0.0, 0.0]


def test_fit_with_noise_predicts_unseen_placements():
    truth = PlacementModel(kappa=0.4e-9, eta=0.7, gamma=0.1)
    fitted = PlacementModel.fit(synthetic(truth, FIT_PLACEMENTS, noise=(1.03, 0.97, 1.0, 1.02, 0.98)))
    for pl in (placement([[(0,), (0,)], [(1,), (1,)]]), placement([[(0,), (1,)]], [Busy((0,), 0.5)]),
               placement([[None, None]] * 2)):
        assert fitted.predict(pl).aggregate == pytest.approx(truth.predict(pl).aggregate, rel=0.05)


def test_fit_refuses_capped_or_empty_samples():
    with pytest.raises(ValueError):
        PlacementModel.fit([])
    with pytest.raises(ValueError, match="CPU-bound"):
        PlacementModel.fit([(placement([[(0,)]], net_rate=1e6), {0: 1e6})])


# -- planning ------------------------------------------------------------------------------------------


def topo(n, smt=False):
    if smt:  # cores (i, i + n/2)
        half = n // 2
        core_of = {c: (c % half, c % half + half) for c in range(n)}
    else:
        core_of = {c: (c,) for c in range(n)}
    return Topology(tuple(range(n)), core_of, {c: 0 for c in range(n)})


def test_plan_network_bound_needs_one_proxy():
    p = plan(topo(8), compute_cpus=2, net_rate=100e6, model=MODEL)
    assert p.k == 1
    assert p.rate == pytest.approx(100e6)
    assert "network-bound" in p.reason


def test_plan_k_never_exceeds_what_helps():
    # 4 spare CPUs, network 3 proxies' worth: no 4th proxy
    alone = MODEL.alone_rate()
    p = plan(topo(6), compute_cpus=2, net_rate=2.9 * alone, model=MODEL)
    assert p.k == 3
    assert p.rate == pytest.approx(2.9 * alone)
    for row in p.candidates:  # nothing with more proxies predicts more than 5% above the choice
        assert row["rate"] <= p.rate * 1.05 + 1e-6 or row["compute_share"] < 0.95


def test_plan_keeps_proxies_off_the_compute_cpu():
    # one CPU of compute on a 2-CPU host: the proxies go to CPU 1 and the compute to CPU 0
    p = plan(topo(2), compute_cpus=1, net_rate=None, model=MODEL)
    assert p.proxy_cpus is not None and all(cs == (1,) for cs in p.proxy_cpus)
    assert p.worker_cpus == (0,)
    assert p.compute_share == pytest.approx(1.0)


def test_plan_with_no_spare_cpu_reduces_k():
    # the compute wants every CPU: one proxy, and the reason says what the compute loses
    p = plan(topo(2), compute_cpus=2, net_rate=None, model=MODEL)
    assert p.k == 1
    assert "compute keeps only" in p.reason


def test_plan_prefers_separate_physical_cores():
    # 4 cores x 2 threads, compute wants 4 CPUs: unpinned, 5.2 busy threads on 4 cores would share
    # cores; two proxies get cores of their own, and the compute the two other cores
    t = topo(8, smt=True)
    p = plan(t, compute_cpus=4, net_rate=2 * MODEL.alone_rate(), model=MODEL)
    assert p.k == 2
    cores = [t.core_of[cs[0]] for cs in p.proxy_cpus]
    assert len(set(cores)) == 2
    assert not set(c for core in cores for c in core) & set(p.worker_cpus)


def test_unpinned_on_smt_takes_separate_cores():
    # two single-proxy lanes unpinned on 2 idle cores x 2 threads: the balancer spreads them over
    # the cores (8 states), never onto one CPU or two siblings of one core
    siblings = {0: (2,), 2: (0,), 1: (3,), 3: (1,)}
    cpus = (0, 1, 2, 3)
    pred = MODEL.predict(placement([[None], [None]], cpus=cpus, siblings=siblings))
    assert pred.states == 8
    apart = MODEL.predict(placement([[(0,)], [(1,)]], cpus=cpus, siblings=siblings)).aggregate
    assert apart == pytest.approx(2 * 0.6 / KAPPA)
    assert pred.aggregate == pytest.approx(apart)
    # with a compute thread on core (0, 2), they take the idle core's two CPUs (0.6 + 0.6 > 1:
    # one on the compute's core would leave its own core less busy than the other by < 0.6)
    pl = placement([[None], [None]], [Busy((0,))], cpus=cpus, siblings=siblings)
    for _, st in placement_module._states(pl, KAPPA, 0.6):
        assert placement_module._unsettled([p.cpus[0] for p in st.proxies], [0, 1], [cpus, cpus], [0.6, 0.6],
                                           {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0},
                                           placement_module._cores(pl, cpus)) is None


def test_sampled_states_are_settled():
    # beyond STATE_LIMIT the seeded random assignments are settled by the balancer's moves
    cpus = tuple(range(8))
    pl = placement([[None, None]] * 4, [Busy((0,))], cpus=cpus)  # 8**8 assignments: sampled
    states = placement_module._states(pl, KAPPA, 0.6)
    assert len(states) == placement_module.STATE_SAMPLES
    for _, st in states:
        per_cpu = [sum(p.cpus == (c,) for p in st.proxies) * 0.6 + (c == 0) for c in cpus]
        assert max(per_cpu) - min(per_cpu) <= 0.6 + 1e-9 or max(per_cpu) == 1.0


def test_many_states_are_sampled_deterministically():
    cpus = tuple(range(8))
    pl = placement([[None]] * 6, [Busy()], cpus=cpus)  # 8**6 states: sampled
    a, b = MODEL.predict(pl), MODEL.predict(pl)
    assert a.states == placement_module.STATE_SAMPLES
    assert a.aggregate == b.aggregate


def test_clustered_penalty_is_paid_once():
    # SCP's clustered state: sharing a CPU with one busy proxy or with three costs the same per byte
    model = PlacementModel(kappa=KAPPA, eta=1.0, gamma=0.4, beta=0.0)
    two = model.predict(placement([[(0,), (1,)]] * 2))
    four = model.predict(placement([[(0,), (1,)]] * 4))
    assert two.proxy_kappa == [pytest.approx(KAPPA * 1.4)] * 4
    assert four.proxy_kappa == [pytest.approx(KAPPA * 1.4)] * 8
    assert four.aggregate == pytest.approx(two.aggregate)


def test_a_busy_co_runner_costs_gamma_busy():
    model = PlacementModel(kappa=KAPPA, eta=1.0, gamma=0.4, gamma_busy=0.1, beta=0.0)
    with_compute = model.predict(placement([[(0,)]], [Busy((0,))]))
    assert with_compute.proxy_clustered_busy == [pytest.approx(1.0)]
    assert with_compute.proxy_kappa == [pytest.approx(KAPPA * 1.1)]
    assert with_compute.aggregate == pytest.approx(0.5 / (KAPPA * 1.1))
    with_proxy = model.predict(placement([[(0,)], [(0,)]]))
    assert with_proxy.proxy_kappa == [pytest.approx(KAPPA * 1.4)] * 2
    # without gamma_busy, a compute co-runner costs gamma
    same = PlacementModel(kappa=KAPPA, eta=1.0, gamma=0.4, beta=0.0).predict(placement([[(0,)]], [Busy((0,))]))
    assert same.proxy_kappa == [pytest.approx(KAPPA * 1.4)]


def test_plan_json():
    p = plan(topo(2), compute_cpus=1, net_rate=None, model=MODEL)
    d = json.loads(json.dumps(p.to_json()))
    assert d["k"] == p.k and d["reason"] == p.reason
