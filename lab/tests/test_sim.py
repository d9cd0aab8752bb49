"""The performance model (lab.sim, lab/scale.md): each piece against a closed form, the
training policies against hand-computed schedules, the fit on synthetic measurements, and the CLI
end to end on a tiny calibration (no jobs: observations reused from a file)."""
import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from lab.sim import cli
from lab.sim import fit as fitting
from lab.sim import model as m
from lab.sim import runs
from lab.sim import training as tr

MiB = 1 << 20


def ideal(**kw):
    """No latency, no fixed costs, TCP at the configured rates, free copies."""
    base = dict(alpha_fh=0.0, t0_fh=0.0, alpha_hvd=0.0, t0_hvd=0.0, goodput=1.0, hvd_eff=1.0,
                copy_cost=0.0, kappa_net=0.0)
    base.update(kw)
    return m.Params(**base)


def cluster(**kw):
    base = dict(hosts=2, nic_bps=8e9, flow_bps=8e8, rtt_s=0.0, cores=1000.0)
    base.update(kw)
    return m.Cluster(**base)


# -- closed forms ------------------------------------------------------------------------------


def test_one_flow_one_hop_is_bytes_over_rate():
    # n = 2: each rank sends M/2 in the reduce-scatter and M/2 in the allgather: M over the flow
    assert m.ring_bytes(100.0, 2) == 100.0
    assert m.ring_time(100.0, 2, rate=10.0, alpha=0.0) == pytest.approx(10.0)
    assert m.ring_time(100.0, 2, rate=10.0, alpha=0.5) == pytest.approx(11.0)  # 2(n-1) = 2 steps
    assert m.busbw(100.0, 10.0, 2) == pytest.approx(10.0)
    assert m.ring_time(100.0, 1, 10.0, 1.0) == 0.0


def test_ring_of_n_ranks():
    n, M, r, a = 8, 64 * MiB, 1e9, 1e-4
    assert m.ring_time(M, n, r, a) == pytest.approx(2 * 7 * a + 2 * 7 / 8 * M / r)
    assert m.busbw(M, 2 * 7 / 8 * M / r, n) == pytest.approx(r)


def test_horovod_two_ranks_is_one_capped_flow():
    c = cluster()
    p = ideal(kappa_gloo=1e-15)
    out = m.horovod_allreduce(64 * MiB, c, p)
    assert out["seconds"] == pytest.approx(64 * MiB / c.flow_Bps)
    assert out["busbw"] == pytest.approx(c.flow_Bps)
    assert out["bound"] == "network"


def test_horovod_cpu_bound_by_gloo_thread():
    c = cluster(flow_bps=1e12, nic_bps=1e12)
    out = m.horovod_allreduce(MiB, c, ideal(kappa_gloo=1e-9))
    assert out["bound"] == "cpu" and out["rate"] == pytest.approx(1e9)


def test_per_flow_capped_versus_link_capped():
    p = ideal()
    c = cluster(nic_bps=8e9, flow_bps=8e8)  # 1 GB/s link, 0.1 GB/s per flow
    assert m.network_rate(c, k=2, S=2, p=p) == pytest.approx(4 * 1e8)     # 4 flows: per-flow capped
    assert m.network_rate(c, k=4, S=4, p=p) == pytest.approx(1e9)         # 16 flows: link capped
    assert m.network_rate(c, k=1, S=1, p=dataclasses.replace(p, goodput=0.95)) == pytest.approx(0.95e8)


def test_flow_buckets():
    assert m.distinct_buckets(5, None) == 5
    assert m.distinct_buckets(1, 16) == pytest.approx(1.0)
    assert m.distinct_buckets(2, 16) == pytest.approx(2 - 1 / 16)
    assert m.distinct_buckets(1000, 16) == pytest.approx(16, rel=1e-3)


def test_port_buckets_closed_forms():
    # one socket: one bucket; two: Linux steps the second port 1..8 buckets on, never 16: always 2
    assert m.port_buckets(1)[1] == pytest.approx(1.0)
    assert m.port_buckets(2)[2] == pytest.approx(1.0)
    # three: only steps 8 + 8 bring the third back onto the first bucket: P(D = 2) = 1/64
    d3 = m.port_buckets(3)
    assert d3[2] == pytest.approx(1 / 64) and d3[3] == pytest.approx(63 / 64)
    # uniform hashing (step None): the occupancy law, whose mean is distinct_buckets
    u = m.port_buckets(2, 16, None)
    assert u[1] == pytest.approx(1 / 16) and u[2] == pytest.approx(15 / 16)
    u5 = m.port_buckets(5, 16, None)
    assert sum(d * x for d, x in enumerate(u5)) == pytest.approx(m.distinct_buckets(5, 16))
    for S in (4, 8, 20):
        assert sum(m.port_buckets(S)) == pytest.approx(1.0)
    # small steps crowd the buckets less than uniform hashing for a few sockets (a step never repeats one)
    assert sum(d * x for d, x in enumerate(m.port_buckets(4))) > m.distinct_buckets(4, 16)


def test_lane_flows_min_over_hops_and_active_sockets():
    assert m.lane_flows(4, 4, 6, None) == 4.0          # a real cloud: every flow its own cap
    assert m.lane_flows(4, 1, 6, None) == 1.0          # one frame at a time: one socket busy
    assert m.lane_flows(2, 2, 9, 16) == pytest.approx(2.0)
    # three sockets on two hops: E[min] = 3 − P(some hop has only 2 buckets)
    assert m.lane_flows(3, 3, 2, 16) == pytest.approx(3 - (1 - (63 / 64) ** 2))
    assert m.lane_flows(3, 1.5, 2, 16) == pytest.approx(1.5)  # fewer frames than buckets in any case
    assert m.lane_flows(3, 3, 4, 16) < m.lane_flows(3, 3, 2, 16)


def test_unlucky_ports_probability():
    emu = m.Cluster.emulated("4:1gbit:200mbit")
    # 1 MiB on 4 lanes x 4 ranks: chunks of 64 KiB, one frame, 1 busy flow per lane: 6 cross-lane
    # pairs on each of 4 hops, each 1/256
    assert m.unlucky_ports_probability(emu, m.Plane(k=4, S=2), 1 * MiB) == pytest.approx(1 - (255 / 256) ** 24)
    # 8 MiB: chunks of 0.5 MiB cut into 2 frames, 2 busy flows per lane: 28 pairs, 4 of them within
    # a lane (the allocator keeps those apart); before the striping change that was one busy flow
    assert m.unlucky_ports_probability(emu, m.Plane(k=4, S=2), 8 * MiB) == pytest.approx(1 - (255 / 256) ** 96)
    old = m.Plane(k=4, S=2, striping="first-free")
    assert m.unlucky_ports_probability(emu, old, 8 * MiB) == pytest.approx(1 - (255 / 256) ** 24)
    assert m.unlucky_ports_probability(emu, m.Plane(k=4, S=2), 64 * MiB) == pytest.approx(1 - (255 / 256) ** 96)
    assert m.unlucky_ports_probability(emu, m.Plane(k=1, S=4), 64 * MiB) == 0.0
    assert m.unlucky_ports_probability(cluster(hosts=4), m.Plane(k=4, S=2), 64 * MiB) == 0.0  # own caps


KiB = 1 << 10


def test_ring_segment_is_cut_for_every_socket():
    # RingSegmentElements (csrc/collectives/ring.cc): min(segment, max(chunk/S, 64 KiB)) for S > 1
    assert m.ring_segment_bytes(512 * KiB, 2) == 256 * KiB
    assert m.ring_segment_bytes(100 * KiB, 2) == 64 * KiB       # not below 64 KiB
    assert m.ring_segment_bytes(32 * KiB, 4) == 64 * KiB        # one frame, shorter than a segment
    assert m.ring_segment_bytes(4 * MiB, 2) == 1 * MiB          # never above FASTHOROVOD_SEGMENT_BYTES
    assert m.ring_segment_bytes(512 * KiB, 1) == 1 * MiB        # one socket: the segment as configured
    assert m.ring_segment_bytes(512 * KiB, 2, 128 * KiB) == 128 * KiB


def test_active_frames_least_left_striping():
    # a chunk of M/(k·n): 8 MiB on 4 lanes x 4 ranks is 0.5 MiB, two frames of 256 KiB, one per socket
    assert m.active_frames(8 * MiB, 4, 4, 2) == 2.0
    assert m.active_frames(96 * KiB * 16, 4, 4, 2) == pytest.approx(1.5)   # 64 + 32 KiB: the 64 KiB chain
    assert m.active_frames(32 * KiB * 16, 4, 4, 2) == 1.0                  # one frame below 64 KiB
    assert m.active_frames(192 * KiB * 16, 4, 4, 4) == pytest.approx(3.0)  # 3 frames of 64 KiB on 4
    assert m.active_frames(3 * 4 * 2 * MiB, 4, 2, 2) == 2.0                # 3 MiB: 3 chains keep 2 busy
    assert m.active_frames(None, 4, 4, 3) == 3.0
    assert m.active_frames(8 * MiB, 4, 4, 1) == 1.0
    # the data plane before 636c542, as the model described it: whole 1 MiB frames, a step waiting
    # for its busiest socket
    old = dict(striping="first-free")
    assert m.active_frames(8 * MiB, 4, 4, 2, **old) == 1.0
    assert m.active_frames(64 * MiB, 4, 4, 2, **old) == 2.0
    assert m.active_frames(3 * 4 * 2 * MiB, 4, 2, 2, **old) == 1.5
    assert m.active_frames(1.6 * 20 * MiB, 4, 5, 2, **old) == pytest.approx(1.6)
    with pytest.raises(ValueError):
        m.active_frames(8 * MiB, 4, 4, 2, striping="round-robin")
    # so a 2 MiB allreduce on 4 lanes x 2 sockets now has 8 flows; before, 4; 256 KiB (32 KiB chunks) 4
    c = cluster(nic_bps=8e12, flow_bps=8e8)
    p = ideal()
    assert m.network_rate(c, 4, 2, p, nbytes=2 * MiB, ring=2) == pytest.approx(8 * 1e8)
    assert m.network_rate(c, 4, 2, p, nbytes=2 * MiB, ring=2, striping="first-free") == pytest.approx(4 * 1e8)
    assert m.network_rate(c, 4, 2, p, nbytes=256 * KiB, ring=2) == pytest.approx(4 * 1e8)
    assert m.network_rate(c, 4, 2, p, nbytes=64 * MiB, ring=2) == pytest.approx(8 * 1e8)


def simulate_lane(chunk: float, sockets: int, steps: int, segment: float) -> float:
    """Time one lane of a symmetric ring takes for `steps` steps on `sockets` sockets of rate 1:
    frames ready in order go each to the socket that will have the least left to send (it frees
    first); segment i of step t+1 is ready when segment i of step t has arrived (every rank alike,
    so when this rank's own send of it ended). No latency."""
    sizes = [segment] * int(chunk // segment) + ([chunk % segment] if chunk % segment > 1e-9 else [])
    free = [0.0] * sockets
    ready = [(0.0, i) for i in range(len(sizes))]  # (ready time, segment) of the current step's frames
    end = 0.0
    for _ in range(steps):
        done = []
        for t, i in sorted(ready):
            j = min(range(sockets), key=lambda x: max(free[x], t))
            free[j] = max(free[j], t) + sizes[i]
            done.append((free[j], i))
            end = max(end, free[j])
        ready = done
    return end


@pytest.mark.parametrize("chunk_kib,S", [(512, 2), (96, 2), (3 * 1024, 2), (2.5 * 1024, 2), (192, 4), (5 * 1024, 4)])
def test_active_frames_against_a_frame_by_frame_lane(chunk_kib, S):
    # the closed form (the sockets' bytes or the longest chain) against frames scheduled one by one:
    # no faster, and slower by at most the fill and drain of one frame per chain
    chunk, steps = chunk_kib * KiB, 10
    seg = m.ring_segment_bytes(chunk, S)
    a = m.active_frames(chunk, 1, 1, S)
    closed = steps * chunk / a
    t = simulate_lane(chunk, S, steps, seg)
    assert closed - 1e-6 <= t <= closed + min(seg, chunk) + 1e-6
    # the per-step barrier of the old model would have been slower wherever the frames do not divide evenly
    old = steps * chunk / m.active_frames(chunk, 1, 1, S, striping="first-free")
    assert t <= old + 1e-6



# -- rings as chains of frames: one chain's wait overlaps the others' bytes ----------------------------


def _next_event(left: dict, waking: dict, rates, now: float):
    """One event of chains on a path shared equally among the frames in transfer (rates[j − 1] bytes/s
    in all with j): the time of the next frame's end or wait's end, whichever comes first, with
    `left` (chain -> bytes left of its frame) advanced to it; True when a frame ends."""
    j = len(left)
    per = rates[j - 1] / j if j else 0.0
    t_sent = now + min(left.values()) / per if j else math.inf
    t_wake = min(waking.values()) if waking else math.inf
    t = min(t_sent, t_wake)
    for c in left:
        left[c] -= per * (t - now)
    return t, t_sent <= t_wake


def simulate_chains(chains: int, frame: float, wait: float, rates, frames: int = 60000, seed: int = 7) -> float:
    """Frames per second of `chains` chains, event by event: each sends a frame of `frame` bytes on a
    path shared equally among the frames in transfer (rates[j − 1] bytes/s in all with j), then waits an
    exponential time of mean `wait`. Independent of the product form computed in the model."""
    import random

    rng = random.Random(seed)
    now, done = 0.0, 0
    left = {}                                                   # chain -> bytes left of its frame
    waking = {c: rng.expovariate(1.0 / wait) for c in range(chains)}  # chain -> time its wait ends
    while done < frames:
        now, sent_first = _next_event(left, waking, rates, now)
        if sent_first:
            c = min(left, key=left.get)
            del left[c]
            waking[c] = now + rng.expovariate(1.0 / wait)
            done += 1
        else:
            c = min(waking, key=waking.get)
            del waking[c]
            left[c] = frame
    return done / now


def test_one_chain_is_latency_and_bytes_in_series():
    # one chain: 1 / (wait + frame / rate), the old model's 2(n−1)·α + bytes / rate
    assert m.chains_throughput(1, 100.0, 2.0, (10.0,)) == pytest.approx(1.0 / (2.0 + 10.0))
    pipe = m.Pipeline(frames=10, chains=1, frame_bytes=100.0, rates=(10.0,))
    assert m.pipeline_seconds(pipe, 2.0) == pytest.approx(10 * 12.0)
    # no wait: the bytes only, whatever the chains
    assert m.chains_throughput(4, 100.0, 0.0, (5.0, 10.0, 15.0, 20.0)) == pytest.approx(20.0 / 100.0)


def test_two_chains_on_one_flow_closed_form():
    # machine repairman with two customers: P(j) ∝ W²/2, W·D, D² (D = frame / rate); X = (1 − P0) / D
    W, D = 3.0, 2.0
    p0, p1, p2 = W * W / 2, W * D, D * D
    expect = (p1 + p2) / (p0 + p1 + p2) / D
    assert m.chains_throughput(2, 20.0, W, (10.0, 10.0)) == pytest.approx(expect)
    # between the asymptotes: slower than the bytes alone, faster than latency and bytes in series
    assert 1.0 / (W + D) < expect < 1.0 / D


def test_many_chains_hide_the_latency():
    # the path's rate once enough chains are in flight: 64 chains, each alone 1/8 of the path
    rates = tuple(min(8.0, j * 1.0) for j in range(1, 65))
    x = m.chains_throughput(64, 1.0, 0.5, rates)
    assert x == pytest.approx(8.0, rel=1e-6)
    # and never more than either bound: the path, or each chain alone (wait + its own frame time)
    x = m.chains_throughput(4, 1.0, 2.0, tuple(min(8.0, j * 1.0) for j in range(1, 5)))
    assert x <= min(8.0, 4 / (2.0 + 1.0)) + 1e-12


@pytest.mark.parametrize("chains,wait,cap,link", [(2, 1.0, 1.0, 1.0), (8, 0.5, 1.0, 5.0), (8, 2.0, 1.0, 5.0),
                                                  (3, 1.0, 2.0, 3.0)])
def test_chains_against_an_event_by_event_simulation(chains, wait, cap, link):
    rates = tuple(min(link, j * cap) for j in range(1, chains + 1))
    model = m.chains_throughput(chains, 1.0, wait, rates)
    assert simulate_chains(chains, 1.0, wait, rates) == pytest.approx(model, rel=0.02)


# -- a ring's chains from their common start (2026-12-03) -------------------------------------------------


def simulate_ring_from_start(chains: int, steps: int, frame: float, wait: float, rates, runs: int = 3000,
                             seed: int = 11) -> float:
    """Mean time of `chains` chains of `steps` frames that all start transferring at once, each frame
    followed by an exponential wait of mean `wait`, on a path shared equally among the frames in
    transfer (rates[j − 1] in all with j); the ring ends with its slowest chain. One run at a time,
    event by event, with Python's own generator: independent of the model's vectorised estimate."""
    import random

    rng = random.Random(seed)
    total = 0.0
    for _ in range(runs):
        now = 0.0
        left = {c: frame for c in range(chains)}
        waking, sent, end = {}, {c: 0 for c in range(chains)}, 0.0
        while left or waking:
            now, sent_first = _next_event(left, waking, rates, now)
            if sent_first:
                c = min(left, key=left.get)
                del left[c]
                sent[c] += 1
                waking[c] = now + rng.expovariate(1.0 / wait)
            else:
                c = min(waking, key=waking.get)
                del waking[c]
                if sent[c] == steps:
                    end = max(end, now)
                else:
                    left[c] = frame
        total += end
    return total / runs


def test_ring_from_start_closed_forms():
    rates = tuple(min(5.0, j * 1.0) for j in range(1, 9))  # 8 chains of 1 byte/s each, a path of 5
    pipe = m.Pipeline(frames=8 * 10, chains=8, frame_bytes=2.0, rates=rates)
    # every wait its mean: the chains stay in lockstep, steps × (the step's bytes over the path + a wait)
    assert m.ring_seconds(pipe, 3.0, cv=0.0) == pytest.approx(10 * (8 * 2.0 / 5.0 + 3.0))
    # no wait: the bytes over the path, whatever the draws
    assert m.ring_seconds(pipe, 0.0) == pytest.approx(80 * 2.0 / 5.0)
    # one chain: steps × (wait + frame / its rate), the series form, in expectation
    one = m.Pipeline(frames=10, chains=1, frame_bytes=2.0, rates=(1.0,))
    assert m.ring_seconds(one, 3.0, cv=0.0) == pytest.approx(10 * 5.0)
    assert m.ring_seconds(one, 3.0, cv=1.0, draws=4000) == pytest.approx(10 * 5.0, rel=0.03)
    # random waits let one chain's wait overlap another's bytes, but the start in lockstep and the slowest
    # chain at the end make a ring of 10 steps slower than the closed network's steady state
    start = m.ring_seconds(pipe, 3.0, cv=1.0)
    assert m.pipeline_seconds(pipe, 3.0) < start
    # longer waits, longer rings
    assert m.ring_seconds(pipe, 1.0) < m.ring_seconds(pipe, 2.0) < start


def test_ring_from_start_tends_to_the_steady_state_per_step():
    # two chains on one flow: per step, the ring from its start approaches the closed network's step
    rates = (1.0, 1.0)
    short = m.Pipeline(frames=2 * 4, chains=2, frame_bytes=1.0, rates=rates)
    long = m.Pipeline(frames=2 * 1000, chains=2, frame_bytes=1.0, rates=rates)
    steady_step = m.pipeline_seconds(long, 1.0) / 1000
    assert m.ring_seconds(long, 1.0, draws=64) / 1000 == pytest.approx(steady_step, rel=0.03)
    assert m.ring_seconds(short, 1.0) / 4 > 1.1 * steady_step  # a short ring pays its start and end


@pytest.mark.parametrize("chains,steps,wait,cap,link", [(8, 10, 3.0, 1.0, 5.0), (4, 2, 1.0, 1.0, 2.0),
                                                        (2, 6, 2.0, 1.0, 1.0)])
def test_ring_from_start_against_an_event_by_event_simulation(chains, steps, wait, cap, link):
    rates = tuple(min(link, j * cap) for j in range(1, chains + 1))
    pipe = m.Pipeline(frames=chains * steps, chains=chains, frame_bytes=2.0, rates=rates)
    model = m.ring_seconds(pipe, wait, cv=1.0, draws=2000)
    assert model == pytest.approx(simulate_ring_from_start(chains, steps, 2.0, wait, rates), rel=0.03)


def test_ring_on_sockets_closed_forms():
    c = 1.0
    # one chain on its lane: it always finds an empty socket, steps × (wait + frame / c) as ring_seconds
    assert m._ring_on_sockets(1, 1, 2, 10, 2.0, (c, 2 * c), 3.0, 0.0, 100.0, 4) == pytest.approx(10 * 5.0)
    # two chains, two sockets, no wait, lockstep: frames bigger than what the network holds are seen,
    # so the second chain takes the other socket (both at c): steps × frame / c ...
    assert m._ring_on_sockets(1, 2, 2, 6, 2.0, (c, 2 * c), 0.0, 0.0, 1.0, 2) == pytest.approx(6 * 2.0)
    # ... frames the network holds whole are not: after the first step (spread by the lane's own count)
    # both go to the first socket, one behind the other: frame / c + (steps − 1) × 2 frames / c
    assert m._ring_on_sockets(1, 2, 2, 6, 2.0, (c, 2 * c), 0.0, 0.0, 4.0, 2) == pytest.approx(2.0 + 5 * 4.0)
    # nothing held: a busy socket always shows unsent bytes, so chains ≤ sockets never share one and the
    # ring is ring_seconds' chains from their common start (independent draws: within their noise)
    rates = tuple(min(3.0, j * c) for j in range(1, 9))
    pipe = m.Pipeline(frames=8 * 6, chains=8, frame_bytes=2.0, rates=tuple(min(3.0, j * c) for j in range(1, 9)))
    sockets = m._ring_on_sockets(4, 2, 2, 6, 2.0, rates, 1.5, 1.0, 0.0, 400)
    assert sockets == pytest.approx(m.ring_seconds(pipe, 1.5, cv=1.0, draws=2000), rel=0.04)


def test_socket_ring_is_used_where_the_networks_hold_is_known():
    c = m.Cluster.emulated("6:1gbit:200mbit")
    p = m.Params(queue_bytes=128 * KiB, alpha_fh=1e-3, wait_cv=1.0)
    plane = m.Plane(k=4, S=2, threshold=0)
    held = m.fasthorovod_allreduce(4 * MiB, c, plane, p)["seconds"]
    seen = m.fasthorovod_allreduce(4 * MiB, c, plane, dataclasses.replace(p, queue_bytes=0.0))["seconds"]
    assert held > seen  # 85 KiB frames behind each other on the lanes' first sockets
    # no hold known (the projection): the chains alone, with no queue term
    free = m.fasthorovod_allreduce(4 * MiB, c, plane, dataclasses.replace(p, queue_bytes=None))["seconds"]
    rate = m.fasthorovod_rate(c, plane, p, 4 * MiB)["rate"]
    pipe = m.fasthorovod_pipeline(c, plane, p, 4 * MiB, rate)
    assert free == pytest.approx(p.t0_fh + c.rtt_s + m.stage_seconds(4 * MiB, c, p)
                                 + m.ring_seconds(pipe, m.step_latency(c, 1e-3), 1.0))
    # the lane before 636c542 ("first-free") keeps the chains' form
    old = dataclasses.replace(plane, striping="first-free")
    assert m.fasthorovod_ring_seconds(c, old, p, 4 * MiB, rate, 1e-3) == pytest.approx(
        m.ring_seconds(m.fasthorovod_pipeline(c, old, p, 4 * MiB, rate), 1e-3, 1.0))


def test_chain_wait_queues_behind_the_lanes_other_chains():
    c = m.Cluster(hosts=6, nic_bps=1e9, flow_bps=2e8, rtt_s=1e-4, cores=1000.0)
    p = m.Params(alpha_fh=1e-3, goodput=1.0, queue_frames=0.5, queue_bytes=None)
    two = m.Plane(k=4, S=2, threshold=0)                           # 4 MiB on 6 hosts: two chains per lane
    frame = 4 * MiB / 24 / 2
    assert m.chain_wait(c, two, p, 4 * MiB) == pytest.approx(1e-3 + 5e-5 + 0.5 * frame / c.flow_Bps)
    # the network's hold known: the socket-by-socket ring has the queueing in it, the wait is α + RTT/2
    held = dataclasses.replace(p, queue_bytes=128 * KiB)
    assert m.chain_wait(c, two, held, 4 * MiB) == pytest.approx(m.step_latency(c, 1e-3))
    # one chain per lane (a chunk of one segment): nothing to wait behind, α + RTT/2 as before
    assert m.chain_wait(c, m.Plane(k=4, S=1, threshold=0), p, 4 * MiB) == pytest.approx(m.step_latency(c, 1e-3))
    assert m.chain_wait(c, two, dataclasses.replace(p, queue_frames=0.0), 4 * MiB) == \
        pytest.approx(m.step_latency(c, 1e-3))


def test_fit_waits_recovers_the_queue_from_frames():
    from lab.sim import waits

    flow = 25e6
    rows = []
    for i in range(400):  # delay = 0.3 ms + min(0.8 · frame, 128 KiB) / flow, exactly, with and without chains
        f = (32 + (i % 16) * 32) * KiB
        several = i % 4 != 0
        d = 3e-4 + (min(0.8 * f, 128 * KiB) / flow if several else 0.0)
        rows.append({"bytes": f, "chains_per_lane": 2 if several else 1, "delay_s": d})
    got = waits.fit_waits(rows, flow)
    assert got["q"] == pytest.approx(0.8) and got["queue_bytes"] == pytest.approx(128 * KiB)
    assert got["a_s"] == pytest.approx(3e-4, abs=1e-6) and got["cv"] < 1e-6
    assert got["mean_delay_s"]["one chain"] == pytest.approx(3e-4)


def test_horovod_ring_is_two_gloo_segments_in_flight():
    # Gloo: segments of min(M / 2n, 1 MiB), two in flight on one flow
    c = cluster(hosts=6)
    p = ideal(kappa_gloo=1e-15)
    rate = m.horovod_rate(c, p)["rate"]
    small = m.horovod_pipeline(4 * MiB, c, p)
    assert small.frame_bytes == pytest.approx(4 * MiB / 12) and small.frames == pytest.approx(4 * 5)
    assert small.chains == 2 and small.rates == (rate, rate)
    big = m.horovod_pipeline(64 * MiB, c, p)
    assert big.frame_bytes == MiB and big.frames == pytest.approx(2 * 5 / 6 * 64)
    # latency only (a fast flow): 2(n−1) waits, as before; bytes only: V / R
    fast = m.horovod_pipeline(4 * MiB, c, p, rate=1e18)
    assert m.pipeline_seconds(fast, 1e-3) == pytest.approx(2 * 5 * 1e-3, rel=1e-6)
    assert m.pipeline_seconds(big, 0.0) == pytest.approx(m.ring_bytes(64 * MiB, 6) / rate)
    # the whole allreduce: fixed costs plus the two chains
    q = dataclasses.replace(p, alpha_hvd=5e-3, t0_hvd=1e-3)
    out = m.horovod_allreduce(4 * MiB, c, q)
    W, D = 5e-3, 4 * MiB / 12 / rate
    x = (W * D + D * D) / (W * W / 2 + W * D + D * D) / D
    assert out["seconds"] == pytest.approx(1e-3 + 20 / x)


def test_fasthorovod_ring_is_the_lanes_chains():
    # 6 hosts, 4 x 2, 4 MiB: chunks of 4/24 MiB cut into 2 segments: 8 chains of 10 steps
    c = m.Cluster(hosts=6, nic_bps=1e9, flow_bps=2e8, rtt_s=0.0, cores=1000.0)
    p = ideal(kappa=1e-15)
    plane = m.Plane(k=4, S=2, threshold=0)
    rate = m.fasthorovod_rate(c, plane, p, 4 * MiB)["rate"]
    assert rate == pytest.approx(c.nic_Bps)  # 8 flows of 25 MB/s on a 125 MB/s link
    pipe = m.fasthorovod_pipeline(c, plane, p, 4 * MiB)
    assert pipe.chains == 8 and pipe.frames == 8 * 10
    assert pipe.frame_bytes == pytest.approx(4 * MiB / 24 / 2)
    assert pipe.rates[0] == pytest.approx(c.flow_Bps) and pipe.rates[4] == pytest.approx(c.nic_Bps)
    # no wait: the old ring time; a wait: between the overlapped and the serial bound
    assert m.pipeline_seconds(pipe, 0.0) == pytest.approx(m.ring_time(4 * MiB, 6, rate, 0.0))
    wait = 4e-3
    serial = m.ring_time(4 * MiB, 6, rate, wait)
    overlapped = 10 * max(4 * MiB / 6 / rate, wait + pipe.frame_bytes / c.flow_Bps)
    t = m.pipeline_seconds(pipe, wait)
    assert overlapped < t < serial
    # one lane of one socket and one segment: nothing to overlap, the old form exactly
    one = m.Plane(k=1, S=1, threshold=0)
    r1 = m.fasthorovod_rate(c, one, p, 4 * MiB)["rate"]
    assert m.pipeline_seconds(m.fasthorovod_pipeline(c, one, p, 4 * MiB), wait) == \
        pytest.approx(m.ring_time(4 * MiB, 6, r1, wait))
    assert m.lane_chains(3 * MiB, 2) == 3 and m.lane_chains(100 * KiB, 2) == 2
    assert m.lane_chains(3 * MiB, 2, striping="first-free") == 1


def test_striping_follows_the_date_of_a_measurement(tmp_path):
    assert m.striping_at(None) == "least-left"
    assert m.striping_at("2026-12-02T06:25:01+00:00") == "first-free"
    assert m.striping_at("2026-12-02T16:31:50Z") == "first-free"
    assert m.striping_at("2026-12-02T17:00:00+00:00") == "least-left"
    # a saved sweep of the morning is predicted with the lane as it ran then
    cfg = {"backend": "fasthorovod:4x2", "status": "ok",
           "result": {"data_plane": {"lanes": 4, "sockets_per_lane": 2},
                      "results": [{"bytes": 8 << 20, "median_s": 1.0}]}}
    for date, striping in (("2026-12-02T06:25:01+00:00", "first-free"), ("2026-12-02T18:00:00+00:00", "least-left")):
        path = tmp_path / f"sweep-{striping}.json"
        path.write_text(json.dumps({"date": date, "networks": [{"network": "4:1gbit:200mbit", "np": 4,
                                                                "configs": [cfg]}]}))
        rows = cli.sweep_rows(str(path))
        assert rows[0]["striping"] == striping
        assert fitting.plane_of(rows[0], 64 << 10).striping == striping


def test_lane_rate_closed_forms():
    net = 1e8
    # no load on the cores: the serial CPU simply adds to the wire time
    assert m.lane_rate(net, 2e-9, 0.0, 0.0, 2.0) == pytest.approx(1 / (1 / net + 2e-9))
    # no serial part: the smaller of the network and the cores' capacity (the hard ceiling)
    assert m.lane_rate(net, 0.0, 4e-8, 0.0, 2.0) == pytest.approx(min(net, 2.0 / 4e-8))
    assert m.lane_rate(1e12, 0.0, 4e-8, 0.0, 2.0) == pytest.approx(2.0 / 4e-8)
    # both: r solves 1/r = 1/net + s/(1 − ρ), ρ = (busy + load r)/cores, with ρ < 1
    s, load, busy, cores = 3e-9, 2e-8, 0.3, 2.0
    r = m.lane_rate(net, s, load, busy, cores)
    rho = (busy + load * r) / cores
    assert rho < 1
    assert 1 / r == pytest.approx(1 / net + s / (1 - rho))
    assert r < m.lane_rate(net, s, 0.0, busy, cores) < m.lane_rate(net, 0.0, 0.0, 0.0, cores)


def test_link_share_waits_for_the_slowest_hop():
    assert m.expected_max_normal(1) == 0.0
    assert m.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert m.expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-4)
    assert m.link_share(1, 0.3) == 1.0 and m.link_share(6, 0.0) == 1.0
    assert m.link_share(2, 0.2) == pytest.approx(1 / (1 + 0.2 / math.sqrt(math.pi)), rel=1e-4)


def test_hierarchical_local_phases_as_they_run():
    # P ranks per host, k proxies each: (P−1)/P · M/k of adds and of copies per proxy, all at once
    p = ideal(reduce_cost=1e-9, copy_cost=2e-9)
    c = cluster(hosts=2, ranks_per_host=4, cores=100.0)
    plane = m.Plane(k=2, S=1, hierarchical=True, threshold=0, local_overlap=False)
    assert m.local_phase_seconds(64.0, c, plane, p) == pytest.approx(3 / 4 * 64 / 2 * 3e-9)
    # overlapped with the ring (836aa67): only the first step's adds and last step's copies, 1/H
    overlapped = dataclasses.replace(plane, local_overlap=True)
    assert m.local_phase_seconds(64.0, c, overlapped, p) == pytest.approx(3 / 4 * 64 / 2 * 3e-9 / 2)
    # on 2 shared cores the 2·4·2 = 16 proxies take turns: 8x as long
    shared = cluster(hosts=2, ranks_per_host=4, cores=2.0, shared_cores=2.0)
    assert m.local_phase_seconds(64.0, shared, plane, p) == pytest.approx(8 * 3 / 4 * 64 / 2 * 3e-9)
    assert m.local_phase_seconds(64.0, c, dataclasses.replace(plane, hierarchical=False), p) == 0.0
    # the whole allreduce: the local phases, then one ring of the H hosts at the P·k lanes' rate
    out = m.fasthorovod_allreduce(64 * MiB, c, plane, p)
    rate = m.fasthorovod_rate(c, plane, p, 64 * MiB)["rate"]
    stage = 2 * 64 * MiB * 2e-9  # the copies into and out of the proxies' memory
    assert out["seconds"] == pytest.approx(stage + m.local_phase_seconds(64 * MiB, c, plane, p) + 64 * MiB / rate)
    assert rate == pytest.approx(8 * c.flow_Bps)  # all P·k = 8 lanes cross the NIC, one flow each


def test_fasthorovod_network_bound_two_ranks():
    c = cluster()
    out = m.fasthorovod_allreduce(64 * MiB, c, m.Plane(k=4, S=2, threshold=0), ideal(kappa=1e-15))
    assert out["path"] == "proxies" and out["bound"] == "network"
    assert out["seconds"] == pytest.approx(64 * MiB / (8 * c.flow_Bps))  # 8 flows x 0.1 GB/s
    out = m.fasthorovod_allreduce(64 * MiB, c, m.Plane(k=4, S=3, threshold=0), ideal(kappa=1e-15))
    assert out["seconds"] == pytest.approx(64 * MiB / c.nic_Bps)  # 12 flows: the 1 GB/s link


def test_below_threshold_goes_through_horovod():
    out = m.fasthorovod_allreduce(1000, cluster(), m.Plane(threshold=4096), ideal())
    assert out["path"] == "horovod"


def test_cpu_bound_regime_shares_the_cores():
    # 1 core per host, 4 proxies: CPU-bound; r = cores / (threads * kappa_m), kappa_m with m = 4
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.1)
    c = cluster(cores=1.0, nic_bps=1e12, flow_bps=1e12)
    plane = m.Plane(k=4, S=1, threshold=0)
    kap = 1e-9 * (1 + 0.1 * 3)
    rate = m.fasthorovod_rate(c, plane, p)
    assert rate["bound"] == "cpu"
    assert rate["cpu"] == pytest.approx(4 * 1.0 / (4 * kap))
    # alone on idle cores a proxy runs at eta / kappa
    big = cluster(cores=100.0, nic_bps=1e12, flow_bps=1e12)
    assert m.proxy_cpu_rate(big, m.Plane(k=1), ideal(kappa=1e-9, eta=0.9)) == pytest.approx(0.9e9)


def test_crowding_counts_the_proxies_that_want_a_core():
    # 6 emulated hosts x 4 proxies on 2 shared cores, each lane at 25 MB/s: the proxies mostly wait on
    # the network (r·kappa/(1 − ρ) ≈ 2% each), so they do not crowd the cores: kappa_m = kappa
    p = ideal(kappa=0.44e-9, kappa_net=2e-9, kappa_lane=3e-9, gamma=0.1, eta=1.0)
    c = cluster(hosts=6, cores=2.0, shared_cores=2.0, nic_bps=8e12, flow_bps=2e8)
    plane = m.Plane(k=4, S=1, threshold=0)
    lane = m.lane_rate(2.5e7, 3e-9, 6 * 4 * (0.44e-9 + 2e-9), 0.0, 2.0)
    assert m.fasthorovod_rate(c, plane, p)["rate"] == pytest.approx(4 * lane, rel=1e-6)
    # every one of the 24 counted as busy (12 per core) would have made it slower
    crowded = m.lane_rate(2.5e7, 3e-9, 6 * 4 * (0.44e-9 * (1 + 0.1 * 11) + 2e-9), 0.0, 2.0)
    assert crowded < 0.97 * lane


def test_shared_machine_and_network_stack_cost():
    # the emulated cloud: H hosts on the same cores; every NIC byte costs kappa_net more
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0, kappa_net=3e-9)
    c = cluster(hosts=4, cores=2.0, shared_cores=2.0, nic_bps=1e12, flow_bps=1e12)
    r = m.proxy_cpu_rate(c, m.Plane(k=2), p)
    # per host 2 lanes at pace x: 4 hosts * 2 * x * (1e-9 + 3e-9) = 2 cores
    x = 2.0 / (8 * 1e-9 + 8 * 3e-9)
    assert r == pytest.approx(2 * x)


def test_hierarchical_does_the_nic_work_once():
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0)
    c = cluster(hosts=2, ranks_per_host=8, cores=8.0, nic_bps=1e12, flow_bps=1e12)
    flat = m.proxy_cpu_rate(c, m.Plane(k=1), p)
    hier = m.proxy_cpu_rate(c, m.Plane(k=1, hierarchical=True), p)
    assert hier == pytest.approx(8 * flat)


def test_zero_configuration_rule_follows_the_probe_knee():
    p = m.Params(goodput=1.0)
    aws25 = m.Cluster(hosts=4, nic_bps=25e9, flow_bps=5e9, cores=48)
    aws100 = m.Cluster(hosts=4, nic_bps=100e9, flow_bps=5e9, cores=96)
    assert (m.zero_config_plane(aws25, p).k, m.zero_config_plane(aws25, p).S) == (4, 2)  # knee 8 flows over 4 lanes
    # knee 32 flows; 12.5 GB/s needs 13 lanes of probe.LANE_BYTES_PER_SECOND, and 96 cores allow them
    assert (m.zero_config_plane(aws100, p).k, m.zero_config_plane(aws100, p).S) == (13, 3)
    assert m.zero_config_plane(aws100, p, k=4).S == 8  # FASTHOROVOD_NUM_LANES=4: the knee over 4 lanes
    eight = dataclasses.replace(aws100, ranks_per_host=8)  # 8 rings share the link: 4 lanes each suffice
    assert (m.zero_config_plane(eight, p).k, m.zero_config_plane(eight, p).S) == (4, 8)
    emu = m.Cluster.emulated("4:1gbit:200mbit")
    assert (m.zero_config_plane(emu, p).k, m.zero_config_plane(emu, p).S) == (4, 2)  # as the probe chose there


def test_cpu_bound_k():
    p = ideal(kappa=1e-9, eta=1.0, gamma=0.0)
    c = cluster(nic_bps=8 * 4e9, flow_bps=8 * 4e9, cores=100.0)  # 4 GB/s link; one proxy carries 1 GB/s
    out = m.cpu_bound_k(c, p, S=1, max_k=8)
    assert out["k_fill"] == 4 and out["k_cpu"] == 1


# -- training ----------------------------------------------------------------------------------


def profile(buckets, fwd=1.0, bwd=2.0, upd=0.5):
    return tr.Profile(fwd, bwd, upd, buckets, batch_per_rank=10)


def test_ssgd_hides_what_fits_under_backward():
    prof = profile([(100.0, 0.5), (100.0, 1.0)])
    out = tr.ssgd_step(prof, lambda b: b / 200.0)  # each allreduce 0.5 s
    assert out["step_s"] == pytest.approx(3.5)      # both end by 1.5 < backward's 2.0
    slow = tr.ssgd_step(prof, lambda b: b / 50.0)   # 2 s each: 0.5..2.5, 2.5..4.5
    assert slow["step_s"] == pytest.approx(1.0 + 4.5 + 0.5)
    assert tr.images_per_s(slow["step_s"], prof, n=4) == pytest.approx(40 / 6.0)


def test_od_sgd_steady_state_is_max_of_compute_and_comm():
    prof = profile([(100.0, 0.0)])
    assert tr.delayed_period(prof, lambda t: prof.buckets, lambda b: 1.0)["step_s"] == pytest.approx(3.5)
    assert tr.delayed_period(prof, lambda t: prof.buckets, lambda b: 6.0)["step_s"] == pytest.approx(6.0)


def test_ssd_sgd_and_cd_sgd():
    prof = profile([(160.0, 2.0)])
    algos = tr.policies(prof, allreduce=lambda b: b / 10.0, allgather=lambda b: b / 10.0, n=4, period=4,
                        correction=1000)
    # SSD-SGD: one 16 s allreduce per 4 steps of 3.5 s: max(14, 16) / 4
    assert algos["ssd-sgd"]["step_s"] == pytest.approx(4.0, rel=0.02)
    # CD-SGD: payload 160/16 = 10 B -> 1 s allgather, hidden behind the next step
    assert algos["cd-sgd"]["step_s"] == pytest.approx(3.5, rel=0.01)
    assert algos["ssgd"]["step_s"] == pytest.approx(1 + 2 + 16 + 0.5)


def test_profile_from_trace(tmp_path):
    lines = [{"format": "fasthorovod-trace", "version": 1, "kind": "worker", "rank": 0, "size": 2}]
    for step in range(3):
        t = step * 10_000_000_000
        lines += [{"k": "forward", "n": "", "t": t, "d": 1_000_000_000, "step": step},
                  {"k": "backward", "n": "", "t": t + 1_000_000_000, "d": 2_000_000_000, "step": step},
                  {"k": "request", "n": "b0", "t": t + 1_500_000_000, "step": step, "bytes": 4000, "proxied": True},
                  {"k": "request", "n": "b1", "t": t + 3_000_000_000, "step": step, "bytes": 8000, "proxied": True},
                  {"k": "update", "n": "", "t": t + 4_000_000_000, "d": 500_000_000, "step": step}]
    (tmp_path / "rank0.worker.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    prof = tr.profile_from_trace(str(tmp_path), skip=1, batch_per_rank=16)
    assert (prof.forward_s, prof.backward_s, prof.update_s) == pytest.approx((1.0, 2.0, 0.5))
    assert prof.buckets == [(4000.0, pytest.approx(0.5)), (8000.0, pytest.approx(2.0))]


def test_profile_from_trace_is_the_slowest_rank(tmp_path):
    # a collective starts once every rank asked for it: rank 1 (clock 5 s ahead, backward 1 s
    # longer, its first bucket 0.8 s later) decides the buckets' ready times and backward's end;
    # forward and update are the ranks' medians
    def rank_lines(r, offset, fwd, bwd, first, upd):
        lines = [{"format": "fasthorovod-trace", "version": 1, "kind": "worker", "rank": r, "size": 2}]
        for step in range(3):
            t = offset + step * 10_000_000_000
            lines += [{"k": "forward", "n": "", "t": t, "d": fwd, "step": step},
                      {"k": "backward", "n": "", "t": t + fwd, "d": bwd, "step": step},
                      {"k": "request", "n": "b0", "t": t + fwd + first, "step": step, "bytes": 4000},
                      {"k": "request", "n": "b1", "t": t + fwd + bwd, "step": step, "bytes": 8000},
                      {"k": "update", "n": "", "t": t + fwd + bwd + 100, "d": upd, "step": step}]
        return "\n".join(json.dumps(x) for x in lines) + "\n"

    (tmp_path / "rank0.worker.jsonl").write_text(rank_lines(0, 0, 1_000_000_000, 2_000_000_000, 500_000_000,
                                                            400_000_000))
    (tmp_path / "rank1.worker.jsonl").write_text(rank_lines(1, 5_000_000_000, 1_200_000_000, 3_000_000_000,
                                                            1_300_000_000, 600_000_000))
    prof = tr.profile_from_trace(str(tmp_path), skip=1)
    assert prof.forward_s == pytest.approx(1.1) and prof.update_s == pytest.approx(0.5)
    # from the ranks' forward starts: rank 1's backward ends at 4.2 s, its b0 at 2.5 s; less forward 1.1
    assert prof.backward_s == pytest.approx(3.1)
    assert prof.buckets == [(4000.0, pytest.approx(1.4)), (8000.0, pytest.approx(3.1))]
    alone = tr.profile_from_trace(str(tmp_path), skip=1, rank=0)
    assert alone.backward_s == pytest.approx(2.0) and alone.buckets[0][1] == pytest.approx(0.5)


def test_published_profiles_are_whole_models():
    for name, w in tr.WORKLOADS.items():
        prof = tr.published_profile(name)
        assert prof.gradient_bytes == pytest.approx(4 * w["params"], rel=0.02)
        assert prof.compute_s == pytest.approx(w["compute_s"])
        assert all(b <= 25 * MiB or len(prof.buckets) >= 1 for b, _ in prof.buckets)


# -- fitting and the CLI -------------------------------------------------------------------------


TRUTH = dict(t0_fh=3e-3, alpha_fh=1e-3, kappa_net=2e-9, kappa_lane=1.5e-9, t0_hvd=5e-3, alpha_hvd=2e-3,
             hvd_eff=0.9, goodput=0.95, link_goodput=0.9)


def synthetic_observations():
    p = m.Params(**TRUTH)
    rows = []
    for spec, k, S in (("2:1gbit:200mbit", 4, 2), ("3:1gbit:200mbit", 4, 2), ("4:1gbit:200mbit", 4, 2),
                       ("4:1gbit:200mbit", 8, 1), ("5:500mbit:100mbit", 4, 2), ("5:1gbit:200mbit", 8, 2)):
        c = m.Cluster.emulated(spec, background_cores=0.2)
        for size in (2 * MiB, 8 * MiB, 32 * MiB):
            for backend in ("horovod", f"fasthorovod:{k}x{S}"):
                if backend == "horovod":
                    if k != 4 or spec.startswith("5"):
                        continue
                    t = m.horovod_allreduce(size, c, p)["seconds"]
                else:
                    t = m.fasthorovod_allreduce(size, c, m.Plane(k=k, S=S, threshold=64 << 10), p)["seconds"]
                rows.append({"spec": spec, "hosts": c.hosts, "backend": backend, "bytes": size, "seconds": t,
                             "k": k, "S": S, "background_cores": 0.2,
                             "probe_one_flow_Bps": 0.95 * c.flow_Bps,
                             "ceiling_Bps": 0.9 * c.nic_Bps if k == 4 else None})
    return rows


def test_fit_recovers_the_parameters_that_made_the_data():
    p = fitting.fit(synthetic_observations(), m.Params())
    assert p.goodput == pytest.approx(0.95)
    assert p.link_goodput == pytest.approx(0.9)
    assert p.hvd_eff == pytest.approx(0.9, rel=0.02)
    assert p.alpha_hvd == pytest.approx(2e-3, rel=0.1) and p.alpha_fh == pytest.approx(1e-3, rel=0.25)
    assert p.kappa_lane == pytest.approx(1.5e-9, rel=0.15)
    assert p.kappa_net == pytest.approx(2e-9, rel=0.25)
    res = fitting.residuals(synthetic_observations(), p, 2.0, 64 << 10)
    assert fitting.summary(res)["max_abs"] < 0.05  # the CPU costs on a grid of 24 per decade


def test_cli_end_to_end_on_a_tiny_calibration(tmp_path, capsys):
    reuse = tmp_path / "old.json"
    reuse.write_text(json.dumps({"observations": synthetic_observations()}))
    model = tmp_path / "model.json"
    assert cli.main(["calibrate", "--clouds", "--skip-micro", "--reuse", str(reuse), "--out", str(model)]) == 0
    doc = json.loads(model.read_text())
    assert doc["residuals"] and doc["residual_summary"]["fasthorovod"]["max_abs"] < 0.05
    capsys.readouterr()
    assert cli.main(["predict", "--model", str(model), "--emulated", "4:1gbit:200mbit", "--size", "16MiB",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["allreduce"][0]
    assert row["fasthorovod"]["busbw"] > row["horovod"]["busbw"] > 0
    # the lane before 636c542: 16 MiB on 4 hosts (1 MiB chunks, one frame each) used one socket per lane
    assert cli.main(["predict", "--model", str(model), "--emulated", "4:1gbit:200mbit", "--size", "16MiB",
                     "-k", "4", "-S", "2", "--striping", "first-free", "--json"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert old["plane"]["striping"] == "first-free"
    assert old["allreduce"][0]["fasthorovod"]["network_rate"] < row["fasthorovod"]["network_rate"]
    proj = tmp_path / "proj.json"
    assert cli.main(["project", "--model", str(model), "--workloads", "resnet50", "--gpus", "16", "256",
                     "--nics", "25gbit", "--cores", "48", "--out", str(proj)]) == 0
    rows = json.loads(proj.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [16, 256]
    for r in rows:
        assert r["fasthorovod ssgd"]["low"] <= r["fasthorovod ssgd"]["images_per_s"] <= r["fasthorovod ssgd"]["high"]
        assert r["fasthorovod ssgd"]["images_per_s"] <= r["ideal"] * 1.0001


def test_cli_sizes_and_rates_follow_the_package_units(capsys):
    """fasthorovod/units.py: KiB/MiB binary, kB/MB decimal, a bare M refused as ambiguous."""
    assert cli.parse_size("16MiB") == 16 * MiB and cli.parse_size("1MB") == 10**6
    assert cli.parse_size("1.5MiB") == 3 * MiB // 2 and cli.parse_rate("25gbit") == 25e9
    with pytest.raises(SystemExit):
        cli.main(["predict", "--emulated", "4:1gbit:200mbit", "--size", "16M"])
    assert "byte count '16M' is ambiguous" in capsys.readouterr().err


def test_predict_help_documents_the_inputs():
    out = subprocess.run([sys.executable, "-m", "lab.sim", "predict", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--hosts", "--ranks-per-host", "--nic", "--per-flow", "--rtt", "--cores", "--lanes",
                 "--sockets", "--hierarchical", "--size", "--trace", "--striping"):
        assert flag in out.stdout


def test_a_saved_sweep_with_an_uneven_cloud_is_checked_on_its_even_clouds(tmp_path, capsys):
    from lab.sim import cli

    def network(spec):
        cfg = {"backend": "fasthorovod:4x2", "status": "ok",
               "result": {"data_plane": {"lanes": 4, "sockets_per_lane": 2},
                          "results": [{"bytes": 64 << 20, "median_s": 1.0}]}}
        return {"network": spec, "np": 4, "configs": [cfg]}

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"networks": [network("4:1gbit:200mbit"), network("4:1gbit:200mbit,host1=100mbit")]}))
    rows = cli.sweep_check(str(path), m.Params(), 2.0, 64 << 10)
    assert [r["spec"] for r in rows] == ["4:1gbit:200mbit"]
    assert "4:1gbit:200mbit,host1=100mbit left out (the model takes even clouds only)" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_background_cpu_leaves_out_processes_of_the_job_in_other_network_namespaces():
    """Ranks launched over ssh on emulated hosts are no children of the job: their CPU is the job's,
    not another job's. A busy loop in its own network namespace, orphaned (so not our
    descendant), stands in for them."""
    from lab.sim import runs

    busy = ["unshare", "--net", "sh", "-c", "(timeout 3 sh -c 'while :; do :; done' &) ; exit 0"]
    job = ["sh", "-c", f"{shlex.join(busy)}; sleep 3.5"]
    # what other jobs on this machine take anyway (CI on a quiet machine: ~0; a loaded one: more)
    baseline = runs.run_measured(["sleep", "3.5"], timeout=30)["background_cores"]
    measured = runs.run_measured(job, timeout=30)
    assert measured["rc"] == 0
    # the busy loop took ~0.85 of a core: counted as the job's, it adds nothing to the background
    assert measured["background_cores"] < baseline + 0.35, (baseline, measured)


def _round(lanes, sockets, medians):
    return {"status": "ok", "result": {"data_plane": {"lanes": lanes, "sockets_per_lane": sockets},
                                       "results": [{"bytes": b, "median_s": t} for b, t in medians]}}


def test_rounds_that_ran_different_planes_are_rows_of_their_own():
    """Each round is a job with its own probe: a round whose probe chose 4 x 8 is predicted as 4 x 8,
    and the 4 x 2 rounds' median is not pulled by it."""
    rounds = [_round(4, 2, [(4 * MiB, 0.090)]), _round(4, 8, [(4 * MiB, 0.114)]), _round(4, 2, [(4 * MiB, 0.094)])]
    merged = {"backend": "fasthorovod", "status": "ok", "rounds": rounds,
              "result": dict(rounds[0]["result"], results=[{"bytes": 4 * MiB, "median_s": 0.094, "busbw_gbps": 0.595,
                                                            "round_medians_s": [0.090, 0.114, 0.094]}])}
    job = {"spec": "6:1gbit:200mbit", "hosts": 6, "report": {"backends": [merged]},
           "measure": {"background_cores": 0.1}}
    rows = runs.observations(job)
    assert [(r["k"], r["S"], r["rounds"]) for r in rows] == [(4, 2, 2), (4, 8, 1)]
    assert rows[0]["seconds"] == pytest.approx(0.092) and rows[0]["round_seconds"] == [0.090, 0.094]
    assert rows[1]["seconds"] == pytest.approx(0.114)
    assert rows[0]["busbw_gbps"] == pytest.approx(0.595 * 0.094 / 0.092)
    res = fitting.residuals(rows, m.Params(), 2.0, 64 << 10)
    assert [(r["k"], r["S"], r["rounds"]) for r in res] == [(4, 2, 2), (4, 8, 1)]
    assert res[0]["predicted_s"] != res[1]["predicted_s"]  # each with its own plane
    assert "4x8 (1)" in cli.residual_table(res)
    # one round (no "rounds" list): one row, as measured
    single = dict(rounds[0], backend="fasthorovod")
    rows = runs.observations({"spec": "6:1gbit:200mbit", "hosts": 6, "report": {"backends": [
        dict(single, result=dict(single["result"], results=[{"bytes": 4 * MiB, "median_s": 0.09, "busbw_gbps": 0.62}]))]},
        "measure": {"background_cores": 0.0}})
    assert [(r["k"], r["S"], r["rounds"], r["seconds"]) for r in rows] == [(4, 2, 1, 0.09)]


def test_rounds_without_their_own_times_stay_one_row_with_the_first_plane():
    rounds = [_round(4, 2, [(4 * MiB, 0.090)]), _round(4, 8, [(4 * MiB, 0.114)])]
    merged = {"backend": "fasthorovod", "status": "ok", "rounds": rounds,
              "result": dict(rounds[0]["result"], results=[{"bytes": 4 * MiB, "median_s": 0.1, "busbw_gbps": 0.56}])}
    rows = runs.observations({"spec": "6:1gbit:200mbit", "hosts": 6, "report": {"backends": [merged]},
                              "measure": {"background_cores": 0.0}})
    assert [(r["k"], r["S"], r["seconds"]) for r in rows] == [(4, 2, 0.1)]
