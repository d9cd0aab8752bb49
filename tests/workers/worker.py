"""Test workloads, run as Horovod ranks by tests/multiproc (``python worker.py SCENARIO [ARGS]``).

Every scenario verifies its own results and exits non-zero on the first wrong value, so a test
passes only if every rank computed exactly what it should.
"""
import argparse
import hashlib
import math
import os
import time
import subprocess
import sys

import torch

import fasthorovod.torch as hvd
import lanes  # tests/workers/, this script's directory
from file_barrier import file_barrier
from rendezvous import complete_uncleared_scopes
from scatter_cases import allgather_cases, alltoall_cases, reducescatter_cases

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
}


def rank_input(count: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Small distinct integers per rank: exact in every dtype, so sums can be checked exactly."""
    base = torch.arange(count, dtype=torch.int64) % 5
    return (base + rank).to(dtype)


def expected_sum(count: int, dtype: torch.dtype, size: int) -> torch.Tensor:
    base = torch.arange(count, dtype=torch.int64) % 5
    return (base * size + size * (size - 1) // 2).to(dtype)


def scenario_matrix(args):
    """Exact allreduce results for sizes × dtypes × ops × in-place/out-of-place × grouped."""
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    assert group is not None and len(group.processes) == args.lanes, "proxies must be running"
    for count in [int(c) for c in args.counts.split(",")]:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            x = rank_input(count, dtype, rank)
            exp = expected_sum(count, dtype, size)
            out = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{count}.{name}")
            assert torch.equal(out, exp), f"sum {count} {name}: {out[:8]} != {exp[:8]}"
            assert torch.equal(x, rank_input(count, dtype, rank)), "allreduce must not modify its input"
            if dtype.is_floating_point:
                avg = hvd.allreduce(x, op=hvd.Average, name=f"avg.{count}.{name}")
                assert torch.allclose(avg.double(), exp.double() / size, rtol=1e-2, atol=1e-2), f"avg {count} {name}"
                # 3 x 0.5 = 1.5: a result that dropped either factor (or both) is wrong. The values
                # (multiples of 0.5 below 200) are exact in every floating dtype.
                scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5, name=f"sc.{count}.{name}")
                assert torch.equal(scaled, (exp.double() * 1.5).to(dtype)), f"scaled {count} {name}: {scaled[:8]}"
            y = x.clone()
            hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{count}.{name}")
            assert torch.equal(y, exp), f"in-place {count} {name}"
        # Mixed dtypes: Horovod carries the group (the proxies fuse one dtype per request).
        g = [rank_input(count, torch.float32, rank), rank_input(count + 3, torch.float64, rank)]
        outs = hvd.grouped_allreduce(g, op=hvd.Sum, name=f"grouped.{count}")
        assert torch.equal(outs[0], expected_sum(count, torch.float32, size))
        assert torch.equal(outs[1], expected_sum(count + 3, torch.float64, size))
        # One dtype: the group is fused into one request of the proxies (every lane runs one more
        # collective; with threshold 0 nothing may go to Horovod instead).
        g = [rank_input(count, torch.float32, rank), rank_input(count + 3, torch.float32, rank),
             rank_input(2 * count + 1, torch.float32, rank)]
        before = [s["collectives"] for s in group.lane_stats()]
        outs = hvd.grouped_allreduce(g, op=hvd.Sum, name=f"grouped.same.{count}")
        for out, c in zip(outs, (count, count + 3, 2 * count + 1)):
            assert torch.equal(out, expected_sum(c, torch.float32, size)), f"grouped same-dtype {count}"
        if group.plan.threshold_bytes == 0:
            after = [s["collectives"] for s in group.lane_stats()]
            assert all(a == b + 1 for a, b in zip(after, before)), f"grouped {count}: lanes ran {before} -> {after}"
    stats = group.lane_stats()
    assert all(s["collectives"] > 0 and s["state"] == 2 for s in stats), stats
    if args.ranks_per_host:
        hierarchical = group.describe()["hierarchical"]
        if args.ranks_per_host == 1:
            assert hierarchical is None, hierarchical
        else:
            assert hierarchical is not None and hierarchical["ranks_per_host"] == args.ranks_per_host, hierarchical
    print(f"rank {rank}: matrix ok, lanes {[s['collectives'] for s in stats]}", flush=True)


def scenario_async(args):
    """Many allreduces in flight at once, completed in reverse order, plus autograd. A proxy
    handle is its negotiation ticket; a name in flight is refused with Horovod's ValueError until
    its handle is synchronized, and can be used again at once after that."""
    from fasthorovod.torch.mpi_ops import _runtime

    rank, size = hvd.rank(), hvd.size()
    count = 400_000
    handles = [hvd.allreduce_async(torch.full((count,), float(rank + i)), op=hvd.Sum, name=f"async.{i}")
               for i in range(args.inflight)]
    assert all(_runtime.handles[h].request.ticket == h for h in handles), handles[:3]
    assert min(handles) >= 1 << 48 and len(set(handles)) == len(handles), handles[:3]  # never Horovod's
    assert sum(hvd.poll(h) for h in handles) <= len(handles)
    try:
        hvd.allreduce_async(torch.zeros(count), op=hvd.Sum, name="async.0")
    except ValueError as e:
        assert type(e) is ValueError, type(e)  # Horovod's class: not an error elastic would reset on
        assert str(e) == ("Requested to allreduce a tensor with the same name as another tensor that is "
                          "currently being processed: 'async.0'"), e
    else:
        raise AssertionError("a second allreduce of a name in flight must raise ValueError")
    for i, h in reversed(list(enumerate(handles))):
        out = hvd.synchronize(h)
        expected = float(size * i + size * (size - 1) // 2)
        assert torch.all(out == expected), (i, out[:4], expected)
    w = torch.ones(count, requires_grad=True)
    # async.0 was synchronized last: its name is free again at once (the autograd allreduce takes it)
    y = hvd.allreduce(w * (rank + 1), op=hvd.Sum, name="async.0")
    y.sum().backward()
    assert torch.all(w.grad == (rank + 1) * size), w.grad[:4]  # d/dw of Σ_ranks, times rank+1
    print(f"rank {rank}: async ok", flush=True)


def scenario_large(args):
    """One allreduce of at least 100 MB."""
    rank, size = hvd.rank(), hvd.size()
    count = args.mbytes * (1 << 20) // 4
    out = hvd.allreduce(torch.full((count,), float(rank + 1)), op=hvd.Average, name="large")
    assert torch.all(out == (size + 1) / 2), out[:4]
    print(f"rank {rank}: large ok ({args.mbytes} MB)", flush=True)


def scenario_rebalance(args):
    """Lane weights that differ from rank to rank (as rebalancing leaves them: each rank decides
    from its own counters): allreduces of odd sizes, several in flight, stay exact (the run order
    carries the lowest submitter's boundaries), and then a join while the weights keep changing
    still works."""
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    lanes = len(group.lane_weights)
    for i in range(args.count):
        group.set_lane_weights([1.0 + ((rank + 1) * (j + 1) * (i + 3)) % 5 for j in range(lanes)])
        counts = [100_003 + 7 * i, 3_001 + i]
        handles = [hvd.allreduce_async(rank_input(c, torch.float32, rank), op=hvd.Sum, name=f"rb.{i}.{j}")
                   for j, c in enumerate(counts)]
        for h, c in zip(handles, counts):
            assert torch.equal(hvd.synchronize(h), expected_sum(c, torch.float32, size)), (i, c)
    if rank == 0:
        hvd.join()  # joins early; the others' allreduces go on (with their own weights) while it zero-fills
    else:
        for i in range(8):
            group.set_lane_weights([1.0 + (i + j) % 3 for j in range(lanes)])
            out = hvd.allreduce(rank_input(200_001, torch.float32, rank), op=hvd.Sum, name=f"rb.joined.{i}")
            assert torch.equal(out, expected_sum(200_001, torch.float32, size) - rank_input(200_001, torch.float32, 0))
        hvd.join()
    print(f"rank {rank}: rebalance ok, weights {[round(w, 3) for w in group.lane_weights]}", flush=True)


def _shape_lanes(rates_mbit, ports_by_lane, first=False):
    """Rank 0, inside the test's own network namespace: each rank's incoming flows of each lane
    (TCP to that rank's listening ports of the lane, ``ports_by_lane[lane][rank]``) through an htb
    class of their own at the lane's rate, as if every rank had its own path; all other traffic
    (ACKs, Horovod, the coordinator) through an unlimited default class."""
    lines = []
    if first:
        lines += ["qdisc add dev lo root handle 1: htb default 10",
                  "class add dev lo parent 1: classid 1:1 htb rate 100gbit",
                  "class add dev lo parent 1:1 classid 1:10 htb rate 100gbit"]
    verb = "add" if first else "change"
    for lane, rate in enumerate(rates_mbit):
        for rank, lane_ports in enumerate(ports_by_lane[lane]):
            classid = f"1:{0x100 + lane * 0x10 + rank:x}"
            lines.append(f"class {verb} dev lo parent 1:1 classid {classid} htb rate {rate}mbit ceil {rate}mbit")
            if first:
                lines += [f"filter add dev lo parent 1: protocol ip prio 1 u32 match ip dport {port} 0xffff "
                          f"flowid {classid}" for port in lane_ports]
    subprocess.run(["tc", "-batch", "-"], input="\n".join(lines) + "\n", text=True, check=True, timeout=10)


def scenario_lane_slowdown(args):
    """Rebalancing against a real slowdown (run in a private network namespace, 2 ranks, 2 lanes
    of 1 flow each, every lane shaped to 200 Mbit/s by rank 0): on the steady network the weights
    stay put; when lane 0 drops to half, within 10 collectives the weights split the work so that
    the collectives can run at >= 90% of what the remaining capacity allows; and while rank 1 is in hvd.join() with lane 1 slowed,
    rank 0's weights still follow (nothing in the policy needs the other rank)."""
    from fasthorovod.torch.mpi_ops import _runtime
    rank, size = hvd.rank(), hvd.size()
    group, balancer = hvd.proxy_group(), _runtime.balancer
    assert balancer is not None and balancer.every == 1, "rebalancing must be on by default"
    ports = hvd.allgather_object(_ring_ports(group))
    ports_by_lane = [[p[lane] for p in ports] for lane in range(len(ports[0]))]
    if rank == 0:
        _shape_lanes([200, 200], ports_by_lane, first=True)
    hvd.barrier()
    small, big = rank_input(1 << 20, torch.float32, rank), rank_input(4 << 20, torch.float32, rank)

    def timed(x, name, expected=None):
        """One allreduce's wall time; its result checked (by default: every rank contributed)."""
        start = time.perf_counter()
        out = hvd.allreduce(x, op=hvd.Sum, name=name)
        elapsed = time.perf_counter() - start
        expected = expected_sum(x.numel(), torch.float32, size) if expected is None else expected
        assert torch.equal(out, expected), name
        return elapsed

    for i in range(args.count):  # steady: 4 MiB collectives
        timed(small, f"steady.{i}")
        spread = max(group.lane_weights) / min(group.lane_weights)
        assert spread <= 1.05, f"steady network, collective {i}: weights {group.lane_weights}"
    base = sorted(timed(big, f"base.{i}") for i in range(5))[2]  # printed, for the record
    if rank == 0:
        _shape_lanes([100, 200], ports_by_lane)
    times = [timed(big, f"slow.{i}") for i in range(10)]
    hvd.barrier()
    if rank == 0:
        # The bound is on the weights, not on wall times, which the machine's other load moves
        # between the base and the end. Lane j's shard of a collective takes w_j / r_j (tc sets
        # the rates: r = 100, 200 Mbit/s) and the collective lasts as long as the slower lane, so
        # the weights reach >= 90% of the remaining capacity's speed when
        # max(w_0 / 100, w_1 / 200) <= 1 / (0.9 * 300), i.e. 0.259 <= w_0 <= 0.370.
        w = group.lane_weights
        efficiency = (1 / 300) / max(w[0] / 100, w[1] / 200)
        assert efficiency >= 0.9, (f"no recovery: weights {w} reach {efficiency:.0%} of the remaining capacity; "
                                   f"collectives {[round(t, 3) for t in times]} s")
        print(f"rank 0: lane 0 halved: weights {[round(x, 3) for x in w]} ({efficiency:.0%} of the remaining "
              f"capacity); base {base:.3f} s, collectives {[round(t, 3) for t in times]} "
              f"(best possible {base / 0.75:.3f})", flush=True)
        _shape_lanes([200, 100], ports_by_lane)
        alone = rank_input(4 << 20, torch.float32, 0)  # rank 1 is in hvd.join(): it contributes zeros
        joined = [timed(alone, f"joined.{i}", expected=alone) for i in range(10)]
        assert group.lane_weights[1] < 0.4 < group.lane_weights[0], f"during join: {group.lane_weights}"
        print(f"rank 0: lane 1 halved while rank 1 is joined: collectives {[round(t, 3) for t in joined]}; "
              f"weights {[round(w, 3) for w in group.lane_weights]}", flush=True)
    hvd.join()
    print(f"rank {rank}: lane slowdown ok, {balancer.decisions} decisions, {balancer.changes} changes", flush=True)


def _ring_ports(group) -> list:
    """Per lane, the two ports its ring listens on (a re-hashed connection alternates between them)."""
    return [(s["port"], s["alt_port"]) for s in group.lane_stats()]


def _flows_to(group, ring_ports) -> list:
    """The source ports of this rank's proxies' connections to `ring_ports` (the next rank's lanes,
    as :func:`_ring_ports` gives them)."""
    import psutil

    ports = {port for lane in ring_ports for port in lane}
    return sorted(c.laddr.port for p in group.processes for c in psutil.Process(p.pid).net_connections("tcp")
                  if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in ports)


def scenario_flow_slowdown(args):
    """Re-hashing against a real per-flow slowdown (run in a private network namespace, 2 ranks, 2
    lanes of 2 sockets, the defaults otherwise): rank 0's four flows to rank 1 are shaped by their
    source ports, three to 100 Mbit/s and one to 40, as if it shared a per-flow cap. Rank 0 finds
    that flow and replaces its connection, whose new port is no longer shaped, and every result
    stays exact."""
    from fasthorovod.torch.mpi_ops import _runtime
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    assert _runtime.rehasher is not None, "re-hashing must be on by default"
    ports = hvd.allgather_object(_ring_ports(group))
    if rank == 0:
        flows = _flows_to(group, ports[1])
        assert len(flows) == 4, flows
        slow = flows[0]
        lines = ["qdisc add dev lo root handle 1: htb default 10",
                 "class add dev lo parent 1: classid 1:1 htb rate 100gbit",
                 "class add dev lo parent 1:1 classid 1:10 htb rate 100gbit"]
        for i, port in enumerate(flows):
            rate = 40 if port == slow else 100
            lines += [f"class add dev lo parent 1:1 classid 1:{0x100 + i:x} htb rate {rate}mbit ceil {rate}mbit",
                      f"filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport {port} 0xffff "
                      f"flowid 1:{0x100 + i:x}"]
        subprocess.run(["tc", "-batch", "-"], input="\n".join(lines) + "\n", text=True, check=True, timeout=10)
    hvd.barrier()
    x = rank_input(4 << 20, torch.float32, rank)
    expected = expected_sum(4 << 20, torch.float32, size)
    times = []
    for i in range(args.count):
        start = time.perf_counter()
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum, name=f"flows.{i}"), expected), f"collective {i}"
        times.append(time.perf_counter() - start)
    hvd.barrier()
    stats = group.lane_stats()
    replaced, pause = sum(s["rehashes"] for s in stats), sum(s["rehash_ns"] for s in stats) / 1e6
    if rank == 0:
        after = _flows_to(group, ports[1])
        assert replaced >= 1 and slow not in after, f"the slow flow {slow} was not replaced: {after}, {replaced}"
        print(f"rank 0: the slow flow replaced ({replaced} replaced, {pause:.1f} ms in all); "
              f"collectives {[round(t, 3) for t in times]} s", flush=True)
    print(f"rank {rank}: flow slowdown ok", flush=True)


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"--runs: a flag is 0 or 1, got {value!r}")
    return value == "1"


TRAIN_STEPS = 10  # tests/multiproc/test_dataplane.py counts the gradients' bytes from it
TRAIN_KEYS = {"passes": int, "fp16": _flag, "staged": _flag, "predivide": float, "horovod": _flag, "sparse": _flag}


def parse_train_runs(spec: str) -> list:
    """--runs "NAME:KEY=VALUE,...;NAME:..." (keys: passes, fp16, staged, predivide, horovod, sparse) into a
    list of (name, options): several trainings in one job, each from the same seed, instead of one
    job each. staged=1 with fp16=1: a subclass of Horovod's fp16 compressor, which the proxies do not
    take over (the worker compresses, as Horovod does), instead of Compression.fp16 itself. sparse=1:
    the MLP's input comes from an nn.Embedding(sparse=True), whose gradient travels as Horovod's
    sparse allreduce."""
    runs = []
    for item in filter(None, spec.split(";")):
        name, _, options = item.partition(":")
        parsed = {"passes": 1, "fp16": False, "staged": False, "predivide": 1.0, "horovod": False, "sparse": False}
        for pair in filter(None, options.split(",")):
            key, _, value = pair.partition("=")
            if key not in TRAIN_KEYS:
                raise ValueError(f"--runs: unknown key {key!r} in {item!r}; known: {', '.join(TRAIN_KEYS)}")
            parsed[key] = TRAIN_KEYS[key](value)
        runs.append((name, parsed))
    return runs


def scenario_train(args):
    """For each of --runs: TRAIN_STEPS steps of a small MLP with DistributedOptimizer (horovod=1:
    Horovod's own, the reference); rank 0 writes the final parameters to OUT/NAME.pt."""
    for name, options in parse_train_runs(args.runs):
        flat = train_once(**options)
        if hvd.rank() == 0:
            torch.save(flat, os.path.join(args.out, f"{name}.pt"))
    print(f"rank {hvd.rank()}: train ok, proxies={hvd.proxy_group() is not None}", flush=True)


def train_once(passes: int, fp16: bool, staged: bool, predivide: float, horovod: bool,
               sparse: bool) -> torch.Tensor:
    rank = hvd.rank()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(*([torch.nn.Embedding(256, 64, sparse=True)] if sparse else []),
                                torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    api = __import__("horovod.torch", fromlist=["torch"]) if horovod else hvd
    compression = api.Compression.fp16 if fp16 else api.Compression.none
    if fp16 and staged:
        compression = type("StagedFP16Compressor", (api.Compression.fp16,), {})
    opt = api.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=passes, op=api.Average,
                                   gradient_predivide_factor=predivide)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data_gen = torch.Generator().manual_seed(100 + rank)
    for step in range(TRAIN_STEPS):
        opt.zero_grad()
        for _ in range(passes):
            x = torch.randint(0, 256, (32,), generator=data_gen) if sparse else torch.randn(32, 64, generator=data_gen)
            y = torch.randint(0, 10, (32,), generator=data_gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(gathered[0], g) for g in gathered), "ranks hold different parameters"
    return flat


def scenario_mismatch(args):
    """Ranks describe one tensor name differently (size, dtype, op or prescale factor; --variant,
    several comma-separated run one after another): every rank must raise a CollectiveMismatchError
    naming the tensor, the field and both ranks, never hang or return a wrong sum; and the next
    allreduce must work (the lanes stay up)."""
    rank, size = hvd.rank(), hvd.size()
    for variant in args.variant.split(","):
        count, dtype, op, prescale = 300_000, torch.float32, hvd.Average, 1.0
        if variant == "size" and rank == 1:
            count += 1
        if variant == "dtype" and rank == 1:
            dtype = torch.float64
        if variant == "op" and rank == 1:
            op = hvd.Sum
        if variant == "prescale" and rank == 1:
            prescale = 2.0
        field = {"size": "shape", "dtype": "dtype", "op": "op", "prescale": "prescale factor"}[variant]
        name = f"mismatch.{variant}"
        try:
            hvd.allreduce(torch.ones(count, dtype=dtype), op=op, prescale_factor=prescale, name=name)
        except hvd.FastHorovodError as e:
            print(f"rank {rank}: {variant} mismatch raised {type(e).__name__}: {e}", flush=True)
            assert type(e) is hvd.CollectiveMismatchError, type(e)  # exactly the class of its kind
            message = str(e)
            assert "rank 0" in message and "rank 1" in message and f"'{name}'" in message, message
            assert f"disagree on its {field}" in message, message
        else:
            raise AssertionError(f"a {variant} mismatch must raise")
        out = hvd.allreduce(torch.ones(400_000), op=hvd.Sum, name=f"after.{name}")
        assert torch.all(out == size), "the collective after a mismatch must work"


def scenario_sockets(args):
    """The bytes really travel over the proxies' own TCP connections (checked with ss -tnp)."""
    rank = hvd.rank()
    pids = {p.pid for p in hvd.proxy_group().processes}
    hvd.allreduce(torch.ones(1 << 20), name="warm")
    hvd.barrier()  # nobody starts shutting its proxies down while others count
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    owned = [line for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]
    # Each proxy has S sockets to its next rank and S from its previous rank.
    expected = 2 * len(pids) * args.sockets
    hvd.barrier()
    assert len(owned) == expected, f"rank {rank}: {len(owned)} proxy sockets, expected {expected}\n{out}"
    print(f"rank {rank}: {len(owned)} established TCP connections owned by {len(pids)} proxies", flush=True)


def scenario_gather(args):
    """The proxies' sharded ring allgather (the scheduler's packed 2-bit payloads): every rank ends
    with every rank's words, in rank order, bit for bit, also when the ranks' lane weights differ
    (as rebalancing leaves them)."""
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    group.set_lane_weights([1.0 + (rank + j) % 3 for j in range(len(group.lane_weights))])
    for width in (0, 1, 7, 16_385, 1_000_003):
        rows = [torch.randint(-2**31, 2**31 - 1, (width,), dtype=torch.int32,
                              generator=torch.Generator().manual_seed(1000 * r + width)) for r in range(size)]
        requests = [group.allgather(rows[rank], f"gather.{width}.{i}") for i in range(2)]  # two in flight
        for request in requests:
            request.wait()
            assert request.output.shape == (size, width)
            assert torch.equal(request.output, torch.stack(rows)), (width, rank)
    print(f"rank {rank}: gather ok", flush=True)


def scenario_reducescatter(args):
    """Horovod's reducescatter and grouped_reducescatter through the proxies (reducescatter_cases):
    every rank's rows equal Horovod's own reducescatter of the same inputs (integer-valued, so sums
    are exact; averages to float precision), with prescale and postscale factors, and the gradient
    through autograd is Horovod's (an allgather); with Compression.fp16 the proxies return float16
    values in float32, close to the exact average."""
    import horovod.torch as horovod
    rank, size = hvd.rank(), hvd.size()
    cases = reducescatter_cases(size)
    ops = {"sum": (hvd.Sum, horovod.Sum), "average": (hvd.Average, horovod.Average)}

    def inputs(i, shape, dtype):
        return torch.randint(-50, 50, shape, generator=torch.Generator().manual_seed(100 * i + rank)).to(dtype)

    def same(a, b, what):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
        exact = not a.is_floating_point()
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-6), (what, (a - b).abs().max())

    for i, (shape, dtype, op) in enumerate(cases):
        x = inputs(i, shape, dtype)
        ours = hvd.reducescatter(x, op=ops[op][0], name=f"rs.{i}", prescale_factor=2.0, postscale_factor=0.5)
        theirs = horovod.reducescatter(x, op=ops[op][1], name=f"hrs.{i}", prescale_factor=2.0, postscale_factor=0.5)
        same(ours, theirs, f"reducescatter {shape} {dtype} {op}")
    xs = [inputs(i, shape, dtype) for i, (shape, dtype, _) in enumerate(cases) if dtype == torch.float32]
    ours = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="rs.grouped")
    theirs = horovod.grouped_reducescatter(xs, op=horovod.Sum, name="hrs.grouped")
    for a, b in zip(ours, theirs):
        same(a, b, "grouped_reducescatter")
    handles = [hvd.reducescatter_async(x, name=f"rs.async.{j}", op=hvd.Sum) for j, x in enumerate(xs)]
    for handle, b in zip(reversed(handles), reversed(theirs)):  # completed in reverse order
        same(hvd.synchronize(handle), b, "reducescatter_async")
    w = inputs(0, cases[0][0], torch.float32).requires_grad_()
    (hvd.reducescatter(w, op=hvd.Average, name="rs.autograd") * (rank + 1)).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    (horovod.reducescatter(w2, op=horovod.Average, name="hrs.autograd") * (rank + 1)).sum().backward()
    same(w.grad, w2.grad, "reducescatter's gradient")
    x = inputs(0, cases[0][0], torch.float32) / 7  # not integers: the wire's rounding shows
    exact = hvd.reducescatter(x.double(), op=hvd.Average, name="rs.exact")
    ours = hvd.reducescatter(x, op=hvd.Average, name="rs.fp16", compression=hvd.Compression.fp16)
    assert ours.dtype == torch.float32 and torch.equal(ours.half().float(), ours), "not float16 values"
    assert torch.allclose(ours.double(), exact, rtol=2e-3, atol=2e-3), (ours.double() - exact).abs().max()
    print(f"rank {rank}: reducescatter ok", flush=True)


def _rank_inputs(i, shape, dtype, rank):
    """Case i's tensor on `rank`: small integers, different on every rank and case."""
    return torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(100 * i + rank)).to(dtype)


def _same(a, b, what):
    """Bit for bit, with the shape and dtype."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a, b), what


def scenario_allgather(args):
    """Horovod's allgather family through the proxies (allgather_cases: first dimensions differ
    between ranks): every result equals Horovod's own allgather of the same inputs, bit for bit —
    one by one, grouped, asynchronous and synchronized in another order on each rank, through
    autograd (Horovod's gradient), in allgather_object and in sparse_allreduce_async; ranks that
    disagree on a tensor's other dimensions get a mismatch error naming them, and an allgather or
    reduce-scatter while a rank has joined gets Horovod's error."""
    import horovod.torch as horovod
    rank, size = hvd.rank(), hvd.size()
    cases = allgather_cases(size, rank)

    xs = [_rank_inputs(i, shape, dtype, rank) for i, (shape, dtype) in enumerate(cases)]
    theirs = [horovod.allgather(x, name=f"hag.{i}") for i, x in enumerate(xs)]
    for i, (x, b) in enumerate(zip(xs, theirs)):
        _same(hvd.allgather(x, name=f"ag.{i}"), b, f"allgather {cases[i]}")
    floats = [x for x in xs if x.dtype == torch.float32] + [_rank_inputs(9, (rank * 3, 4, 2), torch.float32, rank)]
    for a, b in zip(hvd.grouped_allgather(floats, name="ag.grouped"),
                    horovod.grouped_allgather(floats, name="hag.grouped")):
        _same(a, b, "grouped_allgather")
    handles = [hvd.allgather_async(x, name=f"ag.async.{j}") for j, x in enumerate(xs)]
    order = list(range(len(xs)))
    for j in (order[::-1] if rank % 2 else order):  # each rank synchronizes in an order of its own
        _same(hvd.synchronize(handles[j]), theirs[j], "allgather_async")
    w = xs[0].clone().requires_grad_()
    (hvd.allgather(w, name="ag.autograd") * (rank + 1)).sum().backward()
    w2 = xs[0].clone().requires_grad_()
    (horovod.allgather(w2, name="hag.autograd") * (rank + 1)).sum().backward()
    _same(w.grad, w2.grad, "allgather's gradient")
    objects = hvd.allgather_object({"rank": rank, "payload": list(range(rank * 100_000))})
    assert [o["rank"] for o in objects] == list(range(size)) and len(objects[-1]["payload"]) == (size - 1) * 100_000
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank, size + 1]]), torch.tensor([1.0, 2.0]), (size + 2,))
    dense = hvd.sparse_allreduce_async(sparse, "ag.sparse", hvd.Sum)().to_dense()
    _same(dense, horovod.sparse_allreduce_async(sparse, "hag.sparse", horovod.Sum)().to_dense(), "sparse allreduce")
    _name_in_flight_refused(lambda name: hvd.allgather_async(xs[0], name=name), "allgather")
    _mismatch_then_join(lambda: hvd.allgather(torch.zeros(3, rank + 1), name="ag.mismatch"),
                        ["ag.mismatch", f"rows of {rank + 1} "],
                        [("Allgather", lambda: hvd.allgather(xs[0], name="ag.join")),
                         ("Reducescatter", lambda: hvd.reducescatter(torch.ones(size * 300_000), name="rs.join"))])
    print(f"rank {rank}: allgather ok", flush=True)


def _name_in_flight_refused(post, verb):
    """A second `post(name)` while the first is in flight raises Horovod's ValueError and message,
    also once the first's heads (Horovod's own allgather, which then forgets the name) are in; the
    name is free again once the first is synchronized. So does a `post(name)` while an allreduce
    through the proxies has the name."""
    from fasthorovod.torch.mpi_ops import _runtime

    name = f"{verb}.in_flight"
    handle = post(name)
    deadline = time.monotonic() + 30
    while not _runtime.handles[handle].request.first_done():  # the heads are in: Horovod forgot the name
        assert time.monotonic() < deadline, "the heads never came"
        time.sleep(0.001)
    try:
        post(name)
        raise AssertionError(f"a second {verb} of a name in flight did not fail")
    except ValueError as e:
        assert type(e) is ValueError and str(e) == (f"Requested to {verb} a tensor with the same name as another "
                                                    f"tensor that is currently being processed: '{name}'"), e
    hvd.synchronize(handle)
    hvd.synchronize(post(name))
    # the name held by an allreduce through the proxies: refused at the call too, not at synchronize
    name = f"{verb}.held_by_an_allreduce"
    held = hvd.allreduce_async(torch.ones(1 << 20), name=name)
    assert held in _runtime.handles, "the allreduce must take the proxies"
    try:
        post(name)
        raise AssertionError(f"an {verb} of a name an allreduce has in flight did not fail")
    except ValueError as e:
        assert str(e) == (f"Requested to {verb} a tensor with the same name as another tensor that is currently "
                          f"being processed: '{name}'"), e
    hvd.synchronize(held)
    hvd.synchronize(post(name))


def _mismatch_then_join(mismatch, words, refused):
    """`mismatch()`, a collective whose shapes differ between ranks, raises CollectiveMismatchError
    naming `words`; then the last rank joins while the others call each of `refused` (KIND, call),
    which fails with Horovod's "KIND is not supported with Join" (a joined rank has no rows to
    give, on the proxies too), and join themselves."""
    try:
        mismatch()
        raise AssertionError("a collective of mismatched shapes did not fail")
    except hvd.CollectiveMismatchError as e:
        assert all(w in str(e) for w in words), str(e)
    if hvd.rank() != hvd.size() - 1:
        for kind, call in refused:
            try:
                call()
                raise AssertionError(f"{kind} with a joined rank did not fail")
            except hvd.HorovodInternalError as e:
                assert f"{kind} is not supported with Join" in str(e), str(e)
    hvd.join()


def scenario_alltoall(args):
    """Horovod's alltoall through the proxies' mesh (alltoall_cases: splits that differ between ranks
    and destinations): every result and received split equals Horovod's own alltoall of the same
    inputs, bit for bit — one by one, with splits as a list and as a tensor, asynchronous and
    synchronized in another order on each rank, through autograd (Horovod's gradient); ranks that
    disagree on a tensor's other dimensions get a mismatch error naming them, and an alltoall while
    a rank has joined gets Horovod's error."""
    import horovod.torch as horovod
    rank, size = hvd.rank(), hvd.size()
    cases = alltoall_cases(size, rank)

    xs = [_rank_inputs(i, shape, dtype, rank) for i, (shape, dtype, _) in enumerate(cases)]
    theirs = [horovod.alltoall(x, splits=torch.tensor(s, dtype=torch.int32) if s is not None else None,
                               name=f"ha2a.{i}") for i, (x, (_, _, s)) in enumerate(zip(xs, cases))]
    for i, (x, (_, _, splits), b) in enumerate(zip(xs, cases, theirs)):
        # the same names on every rank, whether this rank gives splits (a list, then a tensor) or not
        if splits is None:
            _same(hvd.alltoall(x, name=f"a2a.{i}"), b, f"alltoall {cases[i]}")
            _same(hvd.alltoall(x, name=f"a2a.again.{i}"), b, f"alltoall {cases[i]} again")
            continue
        out, received = hvd.alltoall(x, splits=splits, name=f"a2a.{i}")
        _same(out, b[0], f"alltoall {cases[i]}")
        _same(received, b[1], f"received splits {cases[i]}")
        out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), name=f"a2a.again.{i}")
        _same(out, b[0], f"alltoall {cases[i]}, splits as a tensor")
        _same(received, b[1], f"received splits {cases[i]}, splits as a tensor")
    handles = [hvd.alltoall_async(x, splits=s, name=f"a2a.async.{j}") for j, (x, (_, _, s)) in enumerate(zip(xs, cases))]
    order = list(range(len(xs)))
    for j in (order[::-1] if rank % 2 else order):  # each rank synchronizes in an order of its own
        out, received = hvd.synchronize(handles[j])  # Horovod's synchronize: both, splits or not
        _same(out, theirs[j][0] if cases[j][2] is not None else theirs[j], "alltoall_async")
    # Horovod's gradient: the received rows' gradient sent back, so each row sent to rank d gets d + 1
    # (not compared with Horovod's own autograd: its backward alltoall is unnamed, and Horovod names
    # it by a handle count that earlier scenarios' joins left different on each rank)
    splits = cases[0][2]  # every row sent: Horovod's gradient has the rows the input sent
    w = xs[0][:sum(splits)].clone().requires_grad_()
    (hvd.alltoall(w, splits=splits, name="a2a.autograd")[0] * (rank + 1)).sum().backward()
    expected = torch.repeat_interleave(torch.arange(1, size + 1, dtype=w.dtype), torch.tensor(splits))
    _same(w.grad, expected[:, None].expand_as(w).contiguous(), "alltoall's gradient")
    _name_in_flight_refused(lambda name: hvd.alltoall_async(xs[0], splits=cases[0][2], name=name), "alltoall")
    _mismatch_then_join(lambda: hvd.alltoall(torch.zeros(size * 70_000, rank + 1), name="a2a.mismatch"),
                        ["a2a.mismatch", f"alltoall of {rank + 1} "],
                        [("Alltoall", lambda: hvd.alltoall(xs[1], name="a2a.join"))])
    print(f"rank {rank}: alltoall ok", flush=True)


def scenario_lent(args):
    """New outputs of 1 MiB or more on the CPU are lent from the staging buffer the proxies wrote
    (an out-of-place allreduce, grouped, with fp16 on the wire, an alltoall's receive region): each
    lies in one of the pool's buffers, is no view, keeps its values while later collectives run,
    and gives the buffer back to the pool once it is gone; smaller outputs are copied out into
    memory of their own."""
    import gc
    rank, size = hvd.rank(), hvd.size()
    pool = hvd.proxy_group().pool
    count = 300_000  # 1.2 MB of float32

    def buffer_of(t):
        found = [b for b in pool._all.values() if b.address <= t.data_ptr() < b.address + b.nbytes]
        return found[0].id if found else None

    def full(value, n=count):
        return torch.full((n,), float(value))

    def free(buffer_id):
        return buffer_id in {b.id for buffers in pool._free.values() for b in buffers}

    kept = hvd.allreduce(full(rank + 1), op=hvd.Sum, name="lent.kept")
    lent = buffer_of(kept)
    assert lent is not None and kept._base is None, "an out-of-place result must be lent"
    for i in range(3):  # the kept result's buffer is not reused while it lives
        out = hvd.allreduce(full(rank + i), op=hvd.Sum, name=f"lent.next.{i}")
        assert torch.all(out == size * i + size * (size - 1) // 2), (i, out[:4])
        assert buffer_of(out) != buffer_of(kept)
        del out
    assert torch.all(kept == size * (size + 1) // 2), kept[:4]
    hvd.allreduce_(kept, op=hvd.Sum, name="lent.in_place")  # a lent output is an ordinary tensor
    assert torch.all(kept == size * size * (size + 1) // 2), kept[:4]
    row = kept.view(3, -1)[1]  # a view keeps the buffer too
    del kept
    gc.collect()
    assert not free(lent) and torch.all(row == size * size * (size + 1) // 2)
    del row
    assert free(lent), "a lent buffer whose tensors are gone goes back to the pool"

    a, b = hvd.grouped_allreduce([full(rank), full(1, count + 7)], op=hvd.Sum, name="lent.grouped")
    assert buffer_of(a) is not None and buffer_of(a) == buffer_of(b)
    assert torch.all(a == size * (size - 1) // 2) and torch.all(b == size) and b.shape == (count + 7,)
    half = hvd.allreduce(full(rank + 0.5), op=hvd.Average, name="lent.fp16", compression=hvd.Compression.fp16)
    assert buffer_of(half) is not None and half.dtype == torch.float32 and torch.all(half == rank_mean(size))
    small = hvd.allreduce(full(rank, 1000), op=hvd.Sum, name="lent.small")
    assert buffer_of(small) is None and torch.all(small == size * (size - 1) // 2)

    x = torch.arange(size * count, dtype=torch.int64) + 1_000_000 * rank  # 2.4 MB per block
    received = hvd.alltoall(x, name="lent.alltoall")
    assert buffer_of(received) is not None, "an alltoall's output must be its receive region, lent"
    block = count
    for s in range(size):
        assert torch.equal(received[s * block:(s + 1) * block],
                           torch.arange(rank * block, (rank + 1) * block) + 1_000_000 * s), s
    print(f"rank {rank}: lent ok", flush=True)


def scenario_asleep(args):
    """A wait on a collective that stays on Horovod (below the threshold) sleeps instead of
    spinning: rank 0 waits about a second for the others' late submission and uses far less than a
    second of CPU meanwhile (Horovod's own wait holds a core for as long). Its result, Horovod's
    answer to a handle waited twice and its error for a mismatch arrive as they would. So do
    hvd.barrier() and hvd.join() (Horovod's functions) while rank 0 waits for the others."""
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((1000,), float(rank))
    if rank != 0:
        time.sleep(1.0)
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="asleep")
    wall, cpu = time.monotonic(), time.process_time()
    out = hvd.synchronize(handle)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert torch.all(out == size * (size - 1) // 2), out[:4]
    if rank == 0:
        assert wall > 0.5 and cpu < 0.5 * wall, (wall, cpu)
    assert hvd.synchronize(handle) is None  # Horovod's answer for a handle already waited
    try:
        hvd.allreduce(torch.zeros(10 + rank), name="asleep.mismatch")
    except hvd.HorovodInternalError as e:
        assert "Mismatched ALLREDUCE tensor shapes" in str(e), e
    else:
        raise AssertionError("a shape mismatch must raise")
    waits = {"allreduce": (wall, cpu)}
    for name, wait in (("barrier", hvd.barrier), ("join", hvd.join)):  # Horovod's functions, waiting asleep
        if rank != 0:
            time.sleep(1.0)
        wall, cpu = time.monotonic(), time.process_time()
        returned = wait()
        waits[name] = wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        if rank == 0:
            assert wall > 0.5 and cpu < 0.5 * wall, (name, wall, cpu)
        if name == "join":
            assert 0 < returned < size, returned  # one of the ranks that joined late
    print(f"rank {rank}: asleep ok (" + ", ".join(f"{n} waited {w:.2f} s on {c:.2f} s of CPU"
                                                 for n, (w, c) in waits.items()) + ")", flush=True)


def rank_mean(size):
    """The average of rank + 0.5 over the ranks: exact in float16."""
    return sum(r + 0.5 for r in range(size)) / size


def scenario_wire(args):
    """Compression.fp16 and Compression.bf16 done by the proxies: hvd.allreduce and grouped_allreduce
    of float32 tensors (4 MiB, and one of 300 KiB, below the threshold: compression takes the
    proxies at any size) return float32 values that every rank holds alike, each a value of the
    wire type; the lanes send about half of what float32 needs; the error against the exact
    (float64) average is within the bound of docs/dataplane.md and, for fp16, no larger than that of
    Horovod's own fp16 compression of the same inputs; a DistributedOptimizer with either keeps its
    float32 gradients zero-copy in shared memory."""
    import horovod.torch as horovod
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()

    def inputs(count, seed):
        return [torch.randn(count, generator=torch.Generator().manual_seed(seed + r)) * (1 + r) for r in range(size)]

    for kind, wire, bits in (("fp16", torch.float16, 11), ("bf16", torch.bfloat16, 8)):
        for count in (1 << 20, 75_000):
            xs = inputs(count, 7 * count)
            exact = torch.stack([x.double() for x in xs]).sum(0) / size
            sent = sum(s["bytes_sent"] for s in group.lane_stats())
            ours = hvd.allreduce(xs[rank], name=f"wire.{kind}.{count}", compression=getattr(hvd.Compression, kind))
            sent = sum(s["bytes_sent"] for s in group.lane_stats()) - sent
            assert ours.dtype == torch.float32 and torch.equal(ours.to(wire).float(), ours), f"not {wire} values"
            digests = hvd.allgather_object(hashlib.sha256(ours.numpy().tobytes()).hexdigest())
            assert len(set(digests)) == 1, f"ranks hold different results: {digests}"
            float32_bytes = 2 * (size - 1) * count * 4 // size
            assert float32_bytes // 2 <= sent < 0.6 * float32_bytes, (count, sent, float32_bytes)
            ours_error = (ours.double() - exact).abs()
            # docs/dataplane.md: each hop rounds a partial sum (scaled by 1/n afterwards), then the average once
            magnitude = torch.stack([x.double().abs() for x in xs]).sum(0)
            bound = (size - 1) / size * 2.0 ** -bits * magnitude + 2.0 ** -bits * exact.abs() + 1e-7
            assert bool((ours_error <= bound).all()), (kind, (ours_error - bound).max().item())
            line = f"WIRE {kind} rank {rank} count {count}: error max {ours_error.max().item():.3g} mean " \
                   f"{ours_error.mean().item():.3g}"
            if kind == "fp16":  # no worse than Horovod's own fp16 compression of the same (seeded) inputs
                theirs = horovod.allreduce(xs[rank], name=f"horovod.{count}", compression=horovod.Compression.fp16)
                their_error = (theirs.double() - exact).abs()
                assert ours_error.max() <= their_error.max() and ours_error.mean() <= their_error.mean(), \
                    (ours_error.max().item(), their_error.max().item(), ours_error.mean().item(),
                     their_error.mean().item())
                line += f"; Horovod's fp16 max {their_error.max().item():.3g} mean {their_error.mean().item():.3g}"
            print(f"{line}; {sent} bytes sent (float32: {float32_bytes})", flush=True)
    grouped = hvd.grouped_allreduce([torch.full((1000,), 0.1 * (rank + 1)), torch.full((3000,), 1.0 / 3)],
                                    op=hvd.Sum, name="wire.grouped", compression=hvd.Compression.fp16)
    expected = [torch.tensor(0.1 * size * (size + 1) / 2).half().float(), torch.tensor(size / 3).half().float()]
    for out, value in zip(grouped, expected):
        assert out.dtype == torch.float32 and torch.allclose(out, value.expand_as(out), rtol=2e-3), (out[:3], value)
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        model = torch.nn.Linear(512, 1024)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=compression)
        model(torch.randn(8, 512)).sum().backward()
        opt.step()
        assert all(group.pool.locate(p.grad) is not None for p in model.parameters()), "gradients are not zero-copy"
    print(f"rank {rank}: wire ok", flush=True)


def scenario_salted(args):
    """Allreduces whose values depend on --seed (one value per job): several in flight, all exact.
    Two jobs with different seeds on one host cannot pass unless each sums only its own ranks."""
    rank, size = hvd.rank(), hvd.size()
    for i in range(args.count):
        salt = args.seed * 1000 + i
        counts = [300_001 + i, 70_000]
        handles = [hvd.allreduce_async(rank_input(c, torch.float64, rank) + salt, op=hvd.Sum, name=f"salted.{i}.{j}")
                   for j, c in enumerate(counts)]
        for h, c in zip(handles, counts):
            out = hvd.synchronize(h)
            assert torch.equal(out, expected_sum(c, torch.float64, size) + size * salt), (args.seed, i, c, out[:4])
    lanes = [s["collectives"] for s in hvd.proxy_group().lane_stats()]
    assert all(n == 2 * args.count for n in lanes), lanes  # every allreduce went through the proxies
    print(f"rank {rank}: salted job {args.seed} ok, {args.count} rounds, lanes {lanes}", flush=True)


def scenario_join(args):
    """Rank r runs r+1 large allreduces, then joins: joined ranks contribute zeros until all joined."""
    rank, size = hvd.rank(), hvd.size()
    count = 300_000
    for step in range(size):
        if step > rank:
            break
        active = size - step  # ranks r >= step still run this step
        out = hvd.allreduce(torch.full((count,), float(rank + 1)), op=hvd.Sum, name=f"join.{step}")
        expected = float(sum(r + 1 for r in range(step, size)))
        assert torch.all(out == expected), (rank, step, active, out[:4], expected)
    last = hvd.join()
    assert last == size - 1, last
    # After the join everything works as before.
    out = hvd.allreduce(torch.full((count,), 1.0), op=hvd.Sum, name="after.join")
    assert torch.all(out == size)
    print(f"rank {rank}: join ok, last joined {last}", flush=True)


def scenario_join_order(args):
    """Horovod's test_horovod_join_allreduce pattern, many times: one rank joins at once, the others
    allreduce (through the proxies, which zero-fill for the joined rank) and then join. hvd.join()
    must never name the first joiner, on any rank, even when Horovod's coordinator sees the JOINs
    out of order."""
    rank, size = hvd.rank(), hvd.size()
    corrected = 0
    for i in range(args.count):
        first = i % size
        if rank != first:
            a = hvd.allreduce_async(torch.full((125,), float(rank)), name="join.a", op=hvd.Average)
            b = hvd.allreduce_async(torch.full((4913,), float(rank)), name="join.b", op=hvd.Average)
            hvd.synchronize(a)
            hvd.synchronize(b)
        last = hvd.join()
        assert last != first, f"iteration {i}: hvd.join() returned the first joiner {first}"
        assert hvd.allgather_object(last, name=f"join.last.{i}") == [last] * size
    print(f"rank {rank}: join order ok over {args.count} joins", flush=True)


def scenario_bad_input(args):
    """Edge-case tensors work, unsupported ones fail like Horovod, non-finite values pass through."""
    rank, size = hvd.rank(), hvd.size()
    empty = hvd.allreduce(torch.zeros(0), op=hvd.Sum, name="empty")
    assert empty.shape == (0,)
    scalar = hvd.allreduce(torch.tensor(float(rank + 1)), op=hvd.Sum, name="scalar")
    assert scalar.shape == () and scalar.item() == size * (size + 1) / 2
    base = torch.arange(600_000, dtype=torch.float32).reshape(1000, 600) * (rank + 1)
    strided = base.t()  # non-contiguous
    out = hvd.allreduce(strided, op=hvd.Sum, name="strided")
    assert torch.equal(out, base.t() / (rank + 1) * (size * (size + 1) / 2))
    inplace = base.clone().t()
    hvd.allreduce_(inplace, op=hvd.Sum, name="strided.inplace")
    assert torch.equal(inplace, out)
    special = torch.zeros(400_000)
    special[0], special[1], special[2] = float("nan"), float("inf"), -float("inf") if rank == 0 else 1.0
    got = hvd.allreduce(special, op=hvd.Sum, name="nonfinite")
    assert torch.isnan(got[0]) and got[1] == float("inf") and got[2] == -float("inf"), got[:3]
    for dtype in (torch.bool, torch.complex64):
        try:
            hvd.allreduce(torch.zeros(400_000, dtype=dtype), name=f"unsupported.{dtype}")
        except ValueError as e:
            assert "not supported" in str(e), e
        else:
            raise AssertionError(f"{dtype} must raise like Horovod")
    print(f"rank {rank}: bad input ok", flush=True)


def scenario_huge(args):
    """A tensor of more than 2 GiB and more than 2**31 elements (uint8), in place and verified; the
    bytes and the element count both overflow 32 bits in every layer they cross."""
    rank, size = hvd.rank(), hvd.size()
    count = (1 << 31) + 4099
    x = torch.full((count,), rank + 1, dtype=torch.uint8)
    x[-1] = 7 * rank  # the tail past 2**31 carries its own value
    start = time.time()
    hvd.allreduce_(x, op=hvd.Sum, name="huge")
    seconds = time.time() - start
    total = size * (size + 1) // 2
    assert bool((x[:-1] == total).all()), "wrong values below the last element"
    assert int(x[-1]) == 7 * size * (size - 1) // 2, int(x[-1])
    print(f"rank {rank}: huge ok, {count} uint8 elements in {seconds:.1f} s", flush=True)


def scenario_restart(args):
    """hvd.shutdown() then hvd.init() in the same processes: fresh proxies, no leaks."""
    import psutil

    proc = psutil.Process()
    rank, size = hvd.rank(), hvd.size()
    repaired = []
    for cycle in range(args.cycles):
        if cycle:
            hvd.init()
        pids = [p.pid for p in hvd.proxy_group().processes]
        out = hvd.allreduce(torch.ones(500_000), op=hvd.Sum, name=f"restart.{cycle}")
        assert torch.all(out == hvd.size())
        if cycle == 1:
            fds, rss = proc.num_fds(), proc.memory_info().rss
        # every rank's rendezvous is over (the allreduce); the barrier keeps everyone from
        # initializing again before the scopes Horovod's server left uncleared are completed
        repaired += complete_uncleared_scopes()
        hvd.barrier()
        hvd.shutdown()
        file_barrier(args.sync_dir, f"shutdown.{cycle}", rank, size)
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in pids), "proxies must be gone after shutdown"
    grown = proc.num_fds() - fds
    assert grown <= 2, f"file descriptors grew by {grown} over {args.cycles - 2} restarts"
    print(f"rank {rank}: restart ok; fds +{grown}, "
          f"rss {(proc.memory_info().rss - rss) / 2**20:+.1f} MiB; "
          f"Horovod's uncleared rendezvous scopes completed: {repaired or 'none'}", flush=True)
    hvd.init()  # main() shuts down once more


def scenario_refused(args):
    """Strangers connecting to a running job's proxy ports are never taken in: the kernel holds
    their connections until the lanes next accept (a re-hash, asked for here), and then they are
    closed without a word, whatever they sent; the job is undisturbed."""
    import socket

    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    ring_ports = _ring_ports(group)
    ports = [port for lane in ring_ports for port in lane]  # both of each lane's ports
    strangers = []
    for port in ports:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
        strangers.append(s)
    hvd.barrier()  # every rank's strangers are in before anyone's lanes accept
    for lane in range(len(ring_ports)):
        group.request_rehash(lane, [0])
    out = hvd.allreduce(torch.full((1 << 20,), float(rank)), op=hvd.Sum, name="after.strangers")
    assert torch.all(out == size * (size - 1) / 2)
    out = hvd.allreduce(torch.full((1 << 20,), 1.0), op=hvd.Sum, name="after.rehash")  # on the new connections
    assert torch.all(out == size)
    turned_away = 0
    for s in strangers:
        try:
            turned_away += s.recv(1) == b""  # closed, not answered
        except ConnectionResetError:
            turned_away += 1
        s.close()
    assert turned_away == len(ports), f"{len(ports) - turned_away} strangers were answered or kept"
    print(f"rank {rank}: {turned_away} strangers turned away, job unaffected", flush=True)


def scenario_rehash(args):
    """Connections replaced between collectives, as the re-hashing policy asks for them (asked
    directly here): each rank has its lanes' send sockets replaced in turn, while two collectives
    are in flight, and every result stays exact; the lanes count the replacements."""
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    lanes, sockets = group.lanes, group.plan.sockets_per_lane
    before = sum(lane["rehashes"] for lane in group.lane_stats())
    x, expected = rank_input(1 << 20, torch.float32, rank), expected_sum(1 << 20, torch.float32, size)
    asked = 0
    for i in range(12):
        if i % 3 != 2:  # every rank, different sockets; one round in three nothing changes
            group.request_rehash(i % lanes, [(i // lanes + rank) % sockets])
            asked += 1
        handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"rehash.{i}.{j}") for j in range(2)]
        for h in handles:
            assert torch.equal(hvd.synchronize(h), expected), f"rehash round {i}"
    replaced = sum(lane["rehashes"] for lane in group.lane_stats()) - before
    assert replaced >= asked, f"asked for {asked} replacements, the lanes made {replaced}"
    print(f"rank {rank}: rehash ok, {replaced} connections replaced ({lanes} lanes x {sockets} sockets)", flush=True)


def scenario_soak(args):
    """Many allreduces of random sizes, dtypes and ops with async overlap; every result verified —
    the last ones in flight too — and counted: the SOAK line reports how many were compared and
    how many differed, and the scenario fails if any did or if any was left unverified."""
    import random

    import psutil

    rank, size = hvd.rank(), hvd.size()
    rng = random.Random(args.seed)  # same sequence on every rank
    dtypes = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.uint8]
    proc = psutil.Process()
    pending, verified, mismatches, examples = [], 0, 0, []
    baseline = None

    def verify(i, handle, c, d, o):
        nonlocal verified, mismatches
        out = hvd.synchronize(handle)
        exp = expected_sum(c, d, size)
        if o == hvd.Average:
            ok = torch.allclose(out.double(), exp.double() / size, rtol=1e-2, atol=1e-2)
        else:
            ok = torch.equal(out, exp)
        verified += 1
        if not ok:
            mismatches += 1
            if len(examples) < 3:
                examples.append(f"#{i}: {c} x {d}, {'average' if o == hvd.Average else 'sum'}: got {out[:4]}, "
                                f"expected {exp[:4]}")

    for i in range(args.count):
        nbytes = int(2 ** rng.uniform(0, math.log2(args.max_bytes)))
        dtype = rng.choice(dtypes)
        op = rng.choice([hvd.Sum, hvd.Average]) if dtype.is_floating_point else hvd.Sum
        count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        x = rank_input(count, dtype, rank)
        pending.append((i, hvd.allreduce_async(x, op=op, name=f"soak.{i}"), count, dtype, op))
        if len(pending) >= rng.randint(1, 4):
            for item in pending:
                verify(*item)
            pending.clear()
        if i == args.count // 10:
            baseline = (proc.num_fds(), proc.memory_info().rss)
    for item in pending:  # the last ones in flight
        verify(*item)
    fds, rss = proc.num_fds(), proc.memory_info().rss
    print(f"SOAK rank {rank}: {verified} allreduces verified, {mismatches} mismatches; fds {baseline[0]}->{fds}, "
          f"rss {baseline[1] / 2**20:.0f}->{rss / 2**20:.0f} MiB", flush=True)
    assert mismatches == 0, f"rank {rank}: {mismatches} of {verified} results wrong, e.g. {examples}"
    assert verified == args.count, f"rank {rank}: {verified} of {args.count} allreduces verified"
    assert fds - baseline[0] <= 2, f"fds grew from {baseline[0]} to {fds}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--counts", default="0,1,7,1000,65537")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=40)
    parser.add_argument("--mbytes", type=int, default=100)
    parser.add_argument("--runs", default="model:", help="train: NAME:KEY=VALUE,...;... (parse_train_runs)")
    parser.add_argument("--sockets", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--sync-dir", default="", help="restart: a directory every rank can write")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks-per-host", type=int, default=0,
                        help="matrix: check the data plane runs hierarchically with this many (1: flat)")
    parser.add_argument("--variant", default="size", help="mismatch: size, dtype, op or prescale (or several, a,b)")
    run_scenario(globals(), parser.parse_args())


def run_scenario(namespace: dict, args) -> None:
    """hvd.init(), the scenario function ``scenario_<name>`` of `namespace` for each name of
    ``args.scenario`` (several, comma-separated, run one after another in the same world), the
    lanes' counters once they have succeeded (lanes.py: what the harness checks the claimed path
    against; per scenario when there are several), and hvd.shutdown() whatever happened (shared
    with the other worker scripts)."""
    lanes.keep()
    hvd.init()
    try:
        names = args.scenario.split(",")
        for name in names:
            before = lanes.planes(hvd) if len(names) > 1 else None
            namespace[f"scenario_{name}"](args)
            if before is not None:
                lanes.report(hvd.rank(), hvd, scenario=name, before=before)
        lanes.report(hvd.rank(), hvd)
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
