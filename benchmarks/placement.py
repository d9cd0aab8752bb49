"""Calibrates and validates the CPU placement model (lab/placement.py) on this host.

What it measures is the real data plane: two local ranks, each a ProxyGroup with k real proxy
processes (``python -m fasthorovod.proxy``), lane j of rank 0 and lane j of rank 1 forming a ring
over loopback TCP with one socket per lane. The rendezvous Horovod would do (broadcast the token,
allgather the ports) is done by this driver through pipes. Every rank allreduces (Average) a
32 MiB float32 tensor that lives in the proxies' shared memory (no staging copies, as with
DistributedOptimizer's buckets) and checks the result after every window (rank r holds r+1, so
every element must be 1.5).

For each *placement* the driver pins every proxy (all of its threads) with
``os.sched_setaffinity`` to the CPUs the placement names (or leaves it on every usable CPU), and
starts or stops a *compute* thread: one process running a single-threaded torch matmul loop,
pinned to a CPU, busy all the time or a duty cycle of each 10 ms. The workers stay unpinned; the
CPU they use (submitting, waiting, checking) is measured and given to the model as unpinned busy
threads. Then:

  1. a short run with the previous weights measures each lane's pace (bytes sent per busy
     second) and sets the lane weights in proportion, as the default rebalancing would;
  2. ``--windows`` windows of about ``--seconds`` each run the allreduces; each lane's rate is its
     wire bytes sent over the window (the lanes finish together, so this is the rate it carries
     concurrently), and the aggregate is their sum.

Every window also records each of our processes' CPU time (``/proc/PID/task/*/schedstat``,
nanoseconds), so the proxies' own CPU-seconds per byte are known, and each CPU's busy time from
``/proc/stat``. This host is shared: what other jobs took of each CPU (busy time, less softirq,
less our threads pinned there, less a share of our unpinned ones) is given to the model as
``Placement.reserved``, and their runnable threads (sampled ``procs_running`` less our own demand)
are printed, so a disturbed window is visible for what it is.

Unit costs are measured first, on one pinned CPU, with thread CPU time: float32 reduction (the
proxies' ``reduce_sum``, 1 MiB segments into a 64 MiB shard), memcpy (64 MiB), and loopback TCP
(one byte sent by one thread and received by another, the CPU time charged to the two threads;
the softirq time /proc/stat shows on that CPU meanwhile is kept apart, ``socket_softirq``, since
on a shared host it includes other jobs' traffic).

Every window is one sample. The model is fitted on the windows of the placements marked "fit"
(gamma and delta from the proxies' CPU per byte, eta and kappa from the lane rates) and asked to
predict every window of the others; the table shows per placement the median measured and
predicted aggregate, the median error and the mean |error| over its windows. With the default 4
windows of 0.3 s a run takes about a minute on 2 CPUs. Results go to ``--out``.

    PYTHONPATH=. .venv/bin/python benchmarks/placement.py --out results/placement.json
"""
import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
# fasthorovod_testing (make testing-module): the unit costs time the proxies' reduce kernel through it
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests" / "native"))

from lab.placement import (  # noqa: E402
    Busy, Placement, PlacementModel, ProxySpec, cpu_times, measure_unit_costs, per_cpu_seconds, plan,
    read_topology)

MIB = 1 << 20
EXPECTED = 1.5  # mean of rank 0's 1.0 and rank 1's 2.0


# -- /proc helpers ----------------------------------------------------------------------------------


def tids(pid):
    try:
        return [thread.id for thread in psutil.Process(pid).threads()]
    except psutil.Error:
        return []


def cpu_ns(pid):
    """(CPU time, time runnable but waiting for a CPU) of every thread of `pid`, nanoseconds
    (schedstat's first two fields). Read directly: psutil's per-thread times are in clock ticks
    and it does not report the time spent waiting for a CPU."""
    run = wait = 0
    for tid in tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            run += int(fields[0])
            wait += int(fields[1])
        except (OSError, IndexError, ValueError):
            pass
    return run, wait


def procs_running():
    """The host's runnable threads now (/proc/stat's procs_running, which psutil does not report)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1])
    return 0


class RunnableSampler:
    """Samples the host's runnable threads (/proc/stat procs_running) every 20 ms in a thread;
    ``mean()`` excludes the sampler itself. Minus our own threads' demand (run + wait time from
    their schedstat), it is how many threads of *other* jobs wanted a CPU on average."""

    def __init__(self):
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.samples.append(procs_running() - 1)
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mean(self):
        return statistics.mean(self.samples) if self.samples else 0.0


def pin(pid, cpus):
    """Pins every thread of `pid` to `cpus`."""
    for tid in tids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


proc_stat = cpu_times  # {cpu: (busy_seconds, softirq_seconds)}


def steal_seconds():
    """{cpu: seconds the hypervisor ran something else while this vCPU wanted to run} (/proc/stat's
    8th field): a busy neighbour on the physical host, which nothing else here can see."""
    return {cpu: v[7] for cpu, v in per_cpu_seconds().items()}


# -- processes --------------------------------------------------------------------------------------


def rank_main(rank, k, count, conn):
    """One rank: a ProxyGroup of k real proxies; serves the driver's commands."""
    import torch

    torch.set_num_threads(1)
    from fasthorovod.config import Config
    from fasthorovod.proxy.group import ProxyGroup

    def broadcast_object(obj, root, name=None):
        conn.send(("bcast", obj))
        return conn.recv()

    def allgather_object(obj, name=None):
        conn.send(("gather", obj))
        return conn.recv()

    # The model is of proxies on a TCP ring: on one host the default (hierarchical) allreduce would
    # carry everything through shared memory instead, and no lane would send a byte.
    cfg = Config(num_lanes=k, sockets_per_lane=1, probe="0", iface="lo", timeout_seconds=60.0,
                 rebalance_every=0, hierarchical="0")
    group = ProxyGroup.start(cfg, rank, 2, broadcast_object, allgather_object)
    tensor = group.alloc(count, torch.float32)
    tensor.fill_(rank + 1.0)
    conn.send(("ready", [p.pid for p in group.processes]))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "run":
                _, iters, weights = cmd
                group.set_lane_weights(weights)
                before = group.lane_stats()
                t0 = time.perf_counter()
                for _ in range(iters):
                    group.allreduce([tensor], [tensor], "placement", True, 1.0, 1.0).wait()
                dt = time.perf_counter() - t0
                after = group.lane_stats()
                ok = bool((tensor == EXPECTED).all())
                conn.send(("done", dt, [a["bytes_sent"] - b["bytes_sent"] for a, b in zip(after, before)],
                           [a["busy_ns"] - b["busy_ns"] for a, b in zip(after, before)], ok))
            elif cmd[0] == "close":
                break
    finally:
        group.close()
        conn.send(("closed",))


def hog_main(duty, stop):
    """The compute: a single-threaded float32 matmul loop, busy `duty` of every 10 ms (0: sleeps)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    b = torch.randn(192, 192)
    period = 0.010
    while not stop.is_set():
        d = duty.value
        if d <= 0:
            time.sleep(0.005)
            continue
        start = time.perf_counter()
        while time.perf_counter() - start < d * period:
            a = torch.mm(a, b)
            a.mul_(1e-3)
        rest = period - (time.perf_counter() - start)
        if d < 1.0 and rest > 0:
            time.sleep(rest)


class LoopbackRing:
    """Two local ranks with k lanes each, started through pipes instead of Horovod."""

    def __init__(self, ctx, k, count):
        self.k = k
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(rank, k, count, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.proxy_pids = None
        while self.proxy_pids is None:
            msgs = [self._recv(c) for c in self.conns]
            kind = msgs[0][0]
            if kind == "bcast":
                for c in self.conns:
                    c.send(msgs[0][1])
            elif kind == "gather":
                for c in self.conns:
                    c.send([m[1] for m in msgs])
            elif kind == "ready":
                self.proxy_pids = [m[1] for m in msgs]  # [rank][lane]
        self.worker_pids = [p.pid for p in self.procs]

    @staticmethod
    def _recv(conn, timeout=120.0):
        if not conn.poll(timeout):
            raise TimeoutError("a rank did not answer")
        return conn.recv()

    def run(self, iters, weights):
        for c in self.conns:
            c.send(("run", iters, weights))
        res = [self._recv(c) for c in self.conns]
        if not all(r[4] for r in res):
            raise RuntimeError("allreduce result is wrong (expected every element == 1.5)")
        return res

    def close(self):
        for c in self.conns:
            c.send(("close",))
        for c in self.conns:
            try:
                self._recv(c, 30.0)
            except Exception:
                pass
        for p in self.procs:
            p.join(10)


# -- unit costs -------------------------------------------------------------------------------------


def unit_costs(cpu):
    """CPU-seconds per byte of reduce, memcpy and loopback TCP on one pinned CPU."""
    return measure_unit_costs(cpu, shard_bytes=64 * MIB, socket_bytes=256 * MIB)


# -- placements -------------------------------------------------------------------------------------

# name, role, lanes [(rank 0's CPUs, rank 1's CPUs) per lane; None = unpinned], compute (CPUs, duty) or None
PLACEMENTS = [
    ("k1 separated", "fit", [((0,), (1,))], None),
    ("k1 clustered", "fit", [((0,), (0,))], None),
    ("k2 two per CPU", "fit", [((0,), (1,))] * 2, None),
    ("k1 separated, compute on 0", "fit", [((0,), (1,))], ((0,), 1.0)),
    ("k4 four per CPU", "fit", [((0,), (1,))] * 4, None),
    ("k2 a lane per CPU", "validate", [((0,), (0,)), ((1,), (1,))], None),
    ("k2 all on CPU 0", "validate", [((0,), (0,))] * 2, None),
    ("k3 three per CPU", "validate", [((0,), (1,))] * 3, None),
    ("k1 separated, compute 50% on 0", "validate", [((0,), (1,))], ((0,), 0.5)),
    ("k2 two per CPU, compute on 1", "validate", [((0,), (1,))] * 2, ((1,), 1.0)),
    ("k1 clustered on 1, compute on 0", "fit", [((1,), (1,))], ((0,), 1.0)),
    ("k1 clustered with compute on 0", "fit", [((0,), (0,))], ((0,), 1.0)),
    ("k1 unpinned", "validate", [(None, None)], None),
    ("k2 unpinned", "validate", [(None, None)] * 2, None),
    ("k2 unpinned, compute on 0", "validate", [(None, None)] * 2, ((0,), 1.0)),
    ("k1 one end unpinned", "validate", [((0,), None)], None),
    ("k3 unpinned", "validate", [(None, None)] * 3, None),
    ("k2 a lane per CPU, compute 50% on 1", "validate", [((0,), (0,)), ((1,), (1,))], ((1,), 0.5)),
    ("k1 clustered, compute 50% on 0", "validate", [((0,), (0,))], ((0,), 0.5)),
]


def model_placement(cpus, lanes, compute, shared_core=False):
    """The model's view of a placement: both ranks' proxies of every lane and the compute thread.
    With `shared_core`, the CPUs are described as SMT siblings of one core (what a VM's vCPUs may be
    without showing it); the fitted beta then says how much a busy other CPU costs per byte."""
    proxies = tuple(ProxySpec(j, c) for j, ends in enumerate(lanes) for c in ends)
    busy = (Busy(compute[0], compute[1]),) if compute else ()
    siblings = {c: tuple(x for x in cpus if x != c) for c in cpus} if shared_core else {}
    return Placement(tuple(cpus), proxies, busy, siblings)


def measure(ring, cpus, lanes, compute, hog, seconds, weights, windows):
    """Pins, balances the lanes as the rebalancing would, then measures `windows` windows of about
    `seconds` each. Returns the windows and the weights."""
    allcpus = set(cpus)
    affinity = {}
    for j, ends in enumerate(lanes):
        for rank in range(2):
            cs = set(ends[rank]) if ends[rank] is not None else allcpus
            pin(ring.proxy_pids[rank][j], cs)
            affinity[ring.proxy_pids[rank][j]] = cs
    hog_proc, duty = hog
    if compute:
        pin(hog_proc.pid, set(compute[0]))
        affinity[hog_proc.pid] = set(compute[0])
        duty.value = compute[1]
    else:
        pin(hog_proc.pid, allcpus)
        duty.value = 0.0
    time.sleep(0.05)
    res = ring.run(3, weights)
    paces = [b / max(ns, 1) for b, ns in zip(res[0][2], res[0][3])]
    weights = [p / sum(paces) for p in paces]
    n = max(2, int(0.25 / (res[0][1] / 3)))
    res = ring.run(n, weights)
    paces = [b / max(ns, 1) for b, ns in zip(res[0][2], res[0][3])]
    weights = [p / sum(paces) for p in paces]
    iters = max(3, int(seconds / (res[0][1] / n)))
    return [window(ring, cpus, hog_proc, iters, weights, affinity) for _ in range(windows)], weights


def window(ring, cpus, hog_proc, iters, weights, affinity):
    """One measured window: rates, every process's CPU, and what other jobs took of each CPU
    (its busy time in /proc/stat, less softirq, less our threads pinned to it, less a share of
    our unpinned threads), and how many of their threads were runnable."""
    pids = [p for r in ring.proxy_pids for p in r]
    ours_pids = pids + ring.worker_pids + [hog_proc.pid, os.getpid()]
    both0 = {p: cpu_ns(p) for p in ours_pids}
    st0 = proc_stat()
    steal0 = steal_seconds()
    t0 = time.perf_counter()
    with RunnableSampler() as sampler:
        res = ring.run(iters, weights)
    wall = time.perf_counter() - t0
    st1 = proc_stat()
    steal1 = steal_seconds()
    both1 = {p: cpu_ns(p) for p in ours_pids}
    cpu = {p: (both1[p][0] - both0[p][0]) / 1e9 for p in ours_pids}
    dt = max(r[1] for r in res)
    lane_bytes = res[0][2]
    ours_demand = sum(sum(both1[p]) - sum(both0[p]) for p in ours_pids) / 1e9 / wall
    raw = {}
    for c in cpus:
        busy = st1[c][0] - st0[c][0] - (st1[c][1] - st0[c][1])
        raw[c] = busy - sum(cpu[p] for p in ours_pids if affinity.get(p) == {c})
    unpinned = sum(cpu[p] for p in ours_pids if p not in affinity or len(affinity[p]) > 1)
    total_raw = sum(max(0.0, v) for v in raw.values())
    other = {c: max(0.0, v - unpinned * max(0.0, v) / total_raw) / wall if total_raw > 0 else 0.0
             for c, v in raw.items()}
    return {
        "seconds": dt, "iterations": iters, "weights": weights,
        "lane_rates": [b / dt for b in lane_bytes],
        "aggregate": sum(lane_bytes) / dt,
        "proxy_cpu": [[cpu[p] / wall for p in r] for r in ring.proxy_pids],
        "proxy_cpu_per_byte": [[cpu[p] / max(1, res[rank][2][j]) for j, p in enumerate(r)]
                               for rank, r in enumerate(ring.proxy_pids)],
        "worker_cpu": [cpu[p] / wall for p in ring.worker_pids],
        "compute_cpu": cpu[hog_proc.pid] / wall,
        "softirq_cpu": sum(st1[c][1] - st0[c][1] for c in cpus) / wall,
        "other_cpu": other,
        "other_runnable": max(0.0, sampler.mean() - ours_demand),
        "steal_cpu": sum(steal1.get(c, 0.0) - steal0.get(c, 0.0) for c in cpus) / wall,
    }


def measure_all(args, topo, cpus2, placements, count):
    """Unit costs, then every placement's windows: ({cost: s/B}, {name: [window]})."""
    print(f"[placement] {topo.describe()}; using CPUs {list(cpus2)}", flush=True)
    components = unit_costs(cpus2[0])
    print("[placement] unit costs (ns per byte): " +
          ", ".join(f"{k} {v * 1e9:.3f}" for k, v in components.items()), flush=True)

    ctx = mp.get_context("spawn")
    duty = ctx.Value("d", 0.0)
    stop = ctx.Event()
    hog_proc = ctx.Process(target=hog_main, args=(duty, stop), daemon=True)
    hog_proc.start()
    runs = {name: [] for name, _, _, _ in placements}
    try:
        for p in range(args.passes):
            order = placements if p % 2 == 0 else list(reversed(placements))
            by_k = {}
            for item in order:
                by_k.setdefault(len(item[2]), []).append(item)
            for k, items in by_k.items():
                ring = LoopbackRing(ctx, k, count)
                weights = [1.0] * k
                try:
                    for name, role, lanes, compute in items:
                        ws, weights = measure(ring, cpus2, lanes, compute, (hog_proc, duty), args.seconds,
                                              weights, args.windows)
                        runs[name].extend(ws)
                        rates = " ".join(f"{w['aggregate'] / 1e6:5.0f}" for w in ws)
                        others = " ".join(f"{sum(w['other_cpu'].values()):.2f}" for w in ws)
                        steal = " ".join(f"{w['steal_cpu']:.2f}" for w in ws)
                        print(f"[placement] pass {p + 1} {name:34s} {rates} MB/s; other jobs took {others} CPU "
                              f"(of which steal {steal})", flush=True)
                finally:
                    ring.close()
    finally:
        stop.set()
        hog_proc.join(5)
    return components, runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/placement.json")
    parser.add_argument("--seconds", type=float, default=0.3, help="one measured window")
    parser.add_argument("--windows", type=int, default=4, help="windows per placement and pass")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    parser.add_argument("--reanalyse", metavar="JSON", help="fit and validate the windows of a saved run "
                        "instead of measuring")
    parser.add_argument("--mib", type=int, default=32, help="allreduce size, MiB")
    parser.add_argument("--passes", type=int, default=1, help="passes over the placements (even ones reversed)")
    parser.add_argument("--only", default="", help="|-separated placement names (development)")
    parser.add_argument("--no-shared-core", dest="shared_core", action="store_false",
                        help="do not describe the two CPUs as siblings of one core (beta not fitted)")
    parser.add_argument("--no-account-other", dest="account_other", action="store_false",
                        help="do not tell the model how much CPU other jobs took")
    args = parser.parse_args(argv)

    topo = read_topology()
    cpus = list(topo.cpus)
    if len(cpus) < 2:
        sys.exit("needs at least 2 usable CPUs")
    if cpus[:2] != [0, 1]:  # the placements name CPUs 0 and 1: map them onto the first two usable
        remap = {0: cpus[0], 1: cpus[1]}
    else:
        remap = {0: 0, 1: 1}
    cpus2 = (remap[0], remap[1])

    def rm(cs):
        return None if cs is None else tuple(remap[c] for c in cs)

    chosen = [p for p in PLACEMENTS if not args.only or p[0] in args.only.split("|")]
    placements = [(name, role, [(rm(a), rm(b)) for a, b in lanes], (rm(c[0]), c[1]) if c else None)
                  for name, role, lanes, c in chosen]
    started = time.monotonic()
    count = args.mib * MIB // 4
    if args.reanalyse:
        with open(args.reanalyse) as f:
            saved = json.load(f)
        components = saved["components"]
        count = saved["allreduce_bytes"] // 4
        runs = {r["name"]: r["windows"] for r in saved["placements"]}
        placements = [p for p in placements if p[0] in runs]
        print(f"[placement] re-analysing the windows measured on {saved['date']} ({args.reanalyse})")
    else:
        components, runs = measure_all(args, topo, cpus2, placements, count)

    # -- fit and validate: every window is a sample, with the CPU other jobs took as measured --
    def window_placement(lanes, compute, w):
        pl = model_placement(cpus2, lanes, compute, args.shared_core)
        pl = dataclasses.replace(pl, busy=pl.busy + tuple(Busy(None, min(1.0, u)) for u in w["worker_cpu"]))
        if args.account_other:
            pl = dataclasses.replace(pl, reserved={int(c): v for c, v in w["other_cpu"].items()})
        return pl

    samples = [(window_placement(lanes, compute, w), dict(enumerate(w["lane_rates"])))
               for name, role, lanes, compute in placements if role == "fit" for w in runs[name]]
    cpu_samples = [(window_placement(lanes, compute, w),
                    [w["proxy_cpu_per_byte"][rank][j] for j in range(len(lanes)) for rank in range(2)])
                   for name, role, lanes, compute in placements if role == "fit" for w in runs[name]]
    model = PlacementModel.fit(samples, cpu_samples=cpu_samples, components=components, fit_beta=args.shared_core)
    proc_kappa = [c for name, role, _, _ in placements if role == "fit" for w in runs[name]
                  for rank in w["proxy_cpu_per_byte"] for c in rank]
    model.fit_info["proxy_process_cpu_per_byte_median"] = statistics.median(proc_kappa)
    rows = []
    errors = {"fit": [], "validate": []}
    for name, role, lanes, compute in placements:
        ws = runs[name]
        for w in ws:
            pl = window_placement(lanes, compute, w)
            pred = model.predict(pl)
            w["placement"] = pl.to_json()
            w["predicted"] = pred.aggregate
            w["predicted_lanes"] = [pred.lane_rates[j] for j in sorted(pred.lane_rates)]
            w["predicted_compute_cpu"] = pred.busy_cpu[0] if compute else None
            w["error"] = (pred.aggregate - w["aggregate"]) / w["aggregate"]
        errs = [w["error"] for w in ws]
        row = {"name": name, "role": role, "lanes": lanes, "compute": compute,
               "measured": statistics.median(w["aggregate"] for w in ws),
               "predicted": statistics.median(w["predicted"] for w in ws),
               "error_median": statistics.median(errs), "abs_error_mean": statistics.mean(abs(e) for e in errs),
               "other_cpu": statistics.mean(sum(w["other_cpu"].values()) for w in ws),
               "other_runnable": statistics.mean(w["other_runnable"] for w in ws),
               "compute_cpu": statistics.mean(w["compute_cpu"] for w in ws),
               "predicted_compute_cpu": (statistics.mean(w["predicted_compute_cpu"] for w in ws)
                                         if compute else None),
               "proxy_cpu_per_byte": statistics.median(c for w in ws for r in w["proxy_cpu_per_byte"] for c in r),
               "windows": ws}
        rows.append(row)
        errors[role].extend(abs(e) for e in errs)

    print()
    print(f"model: kappa {model.kappa * 1e9:.3f} ns/B (alone {model.alone_rate() / 1e6:.0f} MB/s), "
          f"eta {model.eta:.3f}, gamma {model.gamma:.3f} (busy co-runner "
          f"{'as gamma' if model.gamma_busy is None else f'{model.gamma_busy:.3f}'}), delta {model.delta:.3f}, beta {model.beta:.3f} "
          f"({'fitted, the CPUs as one shared core' if model.beta_measured else 'prior, no SMT here'}); "
          f"bottom-up kappa {model.bottom_up_kappa() * 1e9:.3f} ns/B; proxy process CPU "
          f"{model.fit_info['proxy_process_cpu_per_byte_median'] * 1e9:.3f} ns/B; "
          f"fit rms log error {model.fit_info['rms_log_error']:.3f}")
    print(f"{'placement':36s} {'role':8s} {'measured':>8s} {'predicted':>9s} {'error':>7s} {'|err|':>6s} "
          f"{'ns/B':>5s} {'compute':>7s} {'(pred)':>6s} {'other':>5s} {'runnable':>8s}")
    for r in rows:
        pc = f"{r['predicted_compute_cpu']:.2f}" if r["predicted_compute_cpu"] is not None else "-"
        print(f"{r['name']:36s} {r['role']:8s} {r['measured'] / 1e6:8.0f} {r['predicted'] / 1e6:9.0f} "
              f"{r['error_median'] * 100:+6.1f}% {r['abs_error_mean'] * 100:5.1f}% "
              f"{r['proxy_cpu_per_byte'] * 1e9:5.2f} {r['compute_cpu']:7.2f} {pc:>6s} "
              f"{r['other_cpu']:5.2f} {r['other_runnable']:8.2f}")
    summary = {role: {"mean_abs_error": statistics.mean(e) if e else None,
                      "median_abs_error": statistics.median(e) if e else None,
                      "max_abs_error": max(e) if e else None, "windows": len(e)}
               for role, e in errors.items()}
    for role, label in (("validate", "validation windows (placements not fitted)"), ("fit", "fit windows")):
        if errors[role]:
            print(f"{label}: mean |error| {summary[role]['mean_abs_error'] * 100:.1f}%, median "
                  f"{summary[role]['median_abs_error'] * 100:.1f}%, max {summary[role]['max_abs_error'] * 100:.1f}% "
                  f"over {len(errors[role])} windows")

    if args.markdown:
        print()
        print("| placement | role | measured MB/s | predicted MB/s | median error | mean abs error | proxy CPU ns/B "
              "| compute CPU (pred.) | other jobs' CPU |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            pc = (f"{r['compute_cpu']:.2f} ({r['predicted_compute_cpu']:.2f})"
                  if r["predicted_compute_cpu"] is not None else "-")
            print(f"| {r['name']} | {r['role']} | {r['measured'] / 1e6:.0f} | {r['predicted'] / 1e6:.0f} | "
                  f"{r['error_median'] * 100:+.1f}% | {r['abs_error_mean'] * 100:.1f}% | "
                  f"{r['proxy_cpu_per_byte'] * 1e9:.2f} | {pc} | {r['other_cpu']:.2f} |")
        print()

    plans = {}
    for compute_cpus in (0, 1, 2):
        for net in (None, 125e6, 1.25e9):
            pl = plan(topo, compute_cpus, net, model)
            key = f"compute={compute_cpus} net={'none' if net is None else f'{net * 8 / 1e9:g}Gbit/s'}"
            plans[key] = {k: v for k, v in pl.to_json().items() if k != "candidates"}
            print(f"plan {key:30s} {pl.reason}")
    every = [w for r in rows for w in r["windows"]]
    other = [sum(w["other_cpu"].values()) for w in every]
    other_load = {"other_jobs_cpu_mean": statistics.mean(other), "other_jobs_cpu_max": max(other),
                  "windows_over_0.2_cpu": sum(x > 0.2 for x in other), "windows": len(other),
                  "other_runnable_mean": statistics.mean(w["other_runnable"] for w in every)}
    steal = [w["steal_cpu"] for w in every if "steal_cpu" in w]
    if steal:  # /proc/stat counts steal as busy, so it is inside other_cpu
        other_load.update({"steal_cpu_mean": statistics.mean(steal), "steal_cpu_max": max(steal)})
    print(f"other jobs' CPU over all {len(other)} windows: mean {other_load['other_jobs_cpu_mean']:.2f}, "
          f"max {other_load['other_jobs_cpu_max']:.2f} of {len(cpus2)} CPUs, {other_load['windows_over_0.2_cpu']} "
          f"windows above 0.2; their runnable threads {other_load['other_runnable_mean']:.2f} on average")
    try:
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except OSError:
        commit = None
    out = {"date": datetime.date.today().isoformat(),
           "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "reanalysed": args.reanalyse, "other_load": other_load,
           "topology": topo.describe(), "cpus_used": list(cpus2),
           "allreduce_bytes": count * 4, "seconds_per_window": args.seconds, "passes": args.passes,
           "components": components, "model": model.to_json(), "errors": summary, "placements": rows,
           "plans": plans, "wall_seconds": time.monotonic() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"[placement] wrote {args.out} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
