"""Allreduce sweep: latency and bus bandwidth of a float32 allreduce, per message size and backend.

The driver runs every backend in turn as a separate job of N ranks (see _common.py for the
backends and their launchers) and puts the results side by side. Each rank, for each size:

  * builds a distinct input: element i of rank r is (r + 1) * (i mod 1021 + 1), so the exact
    result is known (integers that float32 holds exactly, whatever the reduction order);
  * runs ``--warmup`` untimed and then ``--iters`` timed iterations of: copy the input into the
    work buffer, barrier, start the clock, in-place allreduce (Sum, or Average = Sum scaled by 1/N),
    stop the clock, compare the whole buffer with the expected result. A mismatch stops the job with
    an error naming the rank, size, iteration and first wrong element;
  * the latency of an iteration is the slowest rank's; median and 90th percentile are reported,
    with the bus bandwidth 2(N-1)/N * bytes / median latency (the traffic a bandwidth-optimal ring
    puts on each link, comparable across N).

The in-place call of each library is timed: ``hvd.allreduce_``, ``torch.distributed.all_reduce``,
``MPI.Allreduce(MPI.IN_PLACE, ...)`` (for Average, the two peers without it divide by N inside the
timed region, as Horovod does). Rank 0 also records how many established TCP connections each
rank's processes hold after the sweep (control connections included), which shows how many flows a
backend really opened.

The driver runs the list of backends ``--rounds`` times, interleaved (A B C A B C ...), so that
drift in the machine hits every backend alike, and reports per backend and size the median over the
rounds of their median latencies with the spread (min-max over the rounds). With ``--ceiling``
every round starts with the raw-TCP ring ceiling (iperf3 between the emulated hosts the ranks run
on, as ``sweep.py`` and ``python -m fasthorovod.netem check --ring`` measure it); the table gives
each backend's fraction of it and the plot draws it as a line.

With ``--collective reducescatter`` every iteration is a reduce-scatter of the buffer instead
(``hvd.reducescatter``, the Horovod-API backends only): each rank checks its rows of the exact sum
(Horovod's split of the first dimension), and the bus bandwidth is (N-1)/N * bytes / latency, as
nccl-tests defines it for a reduce-scatter of `bytes` in all. With ``--collective allgather`` it is
an allgather (``hvd.allgather``, the Horovod-API backends only) whose result holds `bytes` in all,
each rank giving 1/N of them; the result is checked bit for bit against every rank's rows, and the
bus bandwidth is (N-1)/N * bytes / latency, nccl-tests' definition for an allgather. With
``--collective alltoall`` it is Horovod's alltoall of the buffer in equal splits (each rank sends
1/N of its `bytes` to every rank), checked bit for bit, with the same bus bandwidth; its ceiling is
raw TCP in the alltoall's pattern, every host sending to every other at once.

With ``--batch N`` an iteration instead posts N async allreduces of the size, in a different
random order on every rank, and waits for all of them (the Horovod-API backends only: the others
cannot match collectives issued in different orders); the bus bandwidth counts the whole batch.

    python benchmarks/allreduce.py --np 4 --backends horovod-gloo,fasthorovod:4,mpi4py:4 \\
        --out results/allreduce.json --plot results/allreduce.png
"""
import argparse
import importlib
import os
import random
import sys
import time

import numpy as np
import psutil
import torch

import _common as common

DEFAULT_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB"
DEFAULT_BACKENDS = ("horovod-gloo,horovod-mpi,fasthorovod:1,fasthorovod:2,fasthorovod:4,"
                    "fasthorovod:8,torch-gloo,mpi4py:1,mpi4py:4")
# Period of the position pattern in the inputs: a prime, so that shards or segments delivered to
# the wrong offset show up as mismatches.
PATTERN_PERIOD = 1021


def parse_sizes(text):
    sizes = [common.parse_size(s) for s in text.split(",") if s.strip()]
    bad = [s for s in sizes if s <= 0 or s % 4]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes must be positive multiples of 4 bytes: {bad}")
    return sizes


def parse_threshold(text):
    """A size, or 'default' (None: FASTHOROVOD_PROXY_THRESHOLD_BYTES is not set)."""
    return None if text.strip().lower() == "default" else common.parse_size(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Allreduce latency and bus bandwidth per size, for several backends side by "
                    "side. Prints a table (rows: sizes; columns: backends; cells: bus bandwidth in "
                    "Gbit/s and median latency in ms), writes JSON and a PNG.")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS,
                        help="comma-separated: horovod-gloo (or horovod), horovod-mpi, "
                             "fasthorovod[:PROXIES], torch-gloo, mpi4py[:TCP_LINKS] "
                             "(default: %(default)s)")
    parser.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                        help="comma-separated message sizes, each a multiple of 4 bytes: bytes or "
                             "e.g. 64KiB, 16MiB (KiB/MiB/GiB are 1024^n, kB/MB/GB 1000^n) "
                             "(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations before them (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1,
                        help="per timed iteration, post this many async allreduces of each size in a "
                             "different random order on every rank and then wait for all (Horovod-API "
                             "backends only; bus bandwidth counts the whole batch) (default: %(default)s)")
    parser.add_argument("--collective", choices=("allreduce", "reducescatter", "allgather", "alltoall"), default="allreduce",
                        help="what each iteration runs: an in-place allreduce, or a reduce-scatter of the "
                             "buffer (Horovod-API backends only; see the module docstring) (default: %(default)s)")
    parser.add_argument("--op", choices=("sum", "average"), default="sum",
                        help="reduction (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of backends this many times, one after another "
                             "(A B C A B C ...), and report per backend and size the median of the "
                             "rounds' medians with their spread (min-max); every round is kept in "
                             "the JSON. Use it on a noisy machine (default: %(default)s)")
    parser.add_argument("--ceiling", action="store_true",
                        help="start every round with the raw-TCP ring ceiling: iperf3 between the "
                             "emulated hosts of the ranks (needs a --launcher-prefix with "
                             "--emulate-cloud; skipped elsewhere), shown as a line in the plot and "
                             "as each backend's fraction in the table")
    common.add_ring_arguments(parser)
    parser.add_argument("--proxy-threshold", type=parse_threshold, default="64KiB",
                        help="FASTHOROVOD_PROXY_THRESHOLD_BYTES for fasthorovod backends: tensors "
                             "this large or larger go through the proxies; 'default' sets nothing "
                             "(FastHorovod's own: 1 MiB across hosts, 8 MiB on one) "
                             "(default: %(default)s)")
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.collective != "allreduce" and args.batch > 1:
        parser.error(f"--batch runs allreduces: leave it out with --collective {args.collective}")
    if args.iters < 1 or args.warmup < 0 or args.np < 1 or args.rounds < 1 or args.batch < 1:
        parser.error("need --iters >= 1, --warmup >= 0, --np >= 1, --rounds >= 1 and --batch >= 1")
    if (args.ring_flows is not None and args.ring_flows < 1) or args.ring_seconds <= 0:
        parser.error("need --ring-flows >= 1 and --ring-seconds > 0")
    if args.threads is None:
        args.threads = common.default_threads(args.np)
    return args


# --------------------------------------------------------------------------------------------
# Worker: one rank. Each communicator offers the same four operations.


class HorovodComm:
    """horovod.torch or fasthorovod.torch (the same API)."""

    def __init__(self, module, compression=None):
        self.hvd = importlib.import_module(module)
        self.hvd.init()
        self.rank, self.size = self.hvd.rank(), self.hvd.size()
        # "fp16" or "bf16", hvd.Compression's: Horovod's allreduce_ takes no compressor, its allreduce does
        self.compression = compression

    def barrier(self):
        self.hvd.barrier()

    def allreduce(self, buf, op, name):
        """The reduced tensor: `buf` itself, or with a compressor the new tensor Horovod's
        out-of-place allreduce returns (its in-place allreduce_ takes no compressor)."""
        op = self.hvd.Sum if op == "sum" else self.hvd.Average
        if self.compression:
            return self.hvd.allreduce(buf, op=op, name=name, compression=getattr(self.hvd.Compression, self.compression))
        self.hvd.allreduce_(buf, op=op, name=name)
        return buf

    def reducescatter(self, buf, op, name):
        op = self.hvd.Sum if op == "sum" else self.hvd.Average
        compression = getattr(self.hvd.Compression, self.compression or "none")
        return self.hvd.reducescatter(buf, op=op, name=name, compression=compression)

    def allgather(self, buf, name):
        return self.hvd.allgather(buf, name=name)

    def alltoall(self, buf, name):
        return self.hvd.alltoall(buf, name=name)

    def allreduce_async_(self, buf, op, name):
        if self.compression:
            raise ValueError(f"+{self.compression} backends run one allreduce at a time (Horovod's async allreduce "
                             "takes no compressor): leave out --batch")
        return self.hvd.allreduce_async_(buf, op=self.hvd.Sum if op == "sum" else self.hvd.Average, name=name)

    def synchronize(self, handle):
        self.hvd.synchronize(handle)

    def allgather_object(self, obj):
        return self.hvd.allgather_object(obj)

    def close(self):
        self.hvd.shutdown()


class TorchComm:
    """torch.distributed (common.TorchWorld: Gloo, on several devices for torch-gloo:D, or
    FastHorovod's backend); rank and size come from the launcher's env."""

    def __init__(self, backend, rendezvous):
        self.world = common.TorchWorld(backend, rendezvous)
        self.dist = self.world.dist
        self.rank, self.size = self.world.rank(), self.world.size()

    def barrier(self):
        self.dist.barrier()

    def allreduce(self, buf, op, name):
        self.dist.all_reduce(buf, op=self.dist.ReduceOp.SUM)
        if op == "average":  # gloo has no AVG
            buf.div_(self.size)
        return buf

    def allgather_object(self, obj):
        return self.world.allgather_object(obj)

    def close(self):
        self.world.shutdown()


class MpiComm:
    """mpi4py on MPI_COMM_WORLD; buffers are the tensors' memory, shared with numpy."""

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def allreduce(self, buf, op, name):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf.numpy(), op=self.MPI.SUM)
        if op == "average":
            buf.div_(self.size)
        return buf

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def close(self):
        pass  # mpi4py finalizes MPI at exit


def open_comm(backend, rendezvous):
    if backend.kind in common.HVD_MODULES:
        return HorovodComm(common.HVD_MODULES[backend.kind], backend.compression)
    if backend.kind in common.TORCH_BACKENDS:
        return TorchComm(backend, rendezvous)
    return MpiComm()


def make_inputs(count, rank, size, op):
    """This rank's input and the exact allreduce result (see the module docstring)."""
    pattern = (torch.arange(count, dtype=torch.int32) % PATTERN_PERIOD + 1).float()
    total = size * (size + 1) / 2  # sum over ranks of (r + 1)
    expected = pattern * (total if op == "sum" else total / size)
    return pattern.mul_(rank + 1), expected


# Mantissa bits (with the implicit one) of each compression's wire type.
WIRE_BITS = {"fp16": 11, "bf16": 8}


def check(buf, expected, op, rank, nbytes, iteration, compression=None, collective="allreduce"):
    """Raise if ``buf`` is not the expected result (bitwise for Sum; 1e-6 relative for Average,
    whose 1/N scaling need not be exact; with fp16 compression 16 x 2^-11 relative (bf16: 2^-8): the
    rounding of a 16-bit partial sum at each hop of a ring of up to 16 ranks)."""
    if compression:
        ok = torch.allclose(buf, expected, rtol=2.0 ** -WIRE_BITS[compression] * 16, atol=0)
    elif op == "sum":
        ok = torch.equal(buf, expected)
    else:
        ok = torch.allclose(buf, expected, rtol=1e-6, atol=0)
    if not ok:
        if op == "sum":
            differs = buf != expected
        else:
            differs = ~torch.isclose(buf, expected, rtol=1e-6, atol=0)
        wrong = differs.nonzero().flatten()
        first = int(wrong[0])
        raise RuntimeError(
            f"rank {rank}: wrong {op} {collective} of {common.format_size(nbytes)} at iteration "
            f"{iteration}: element {first} is {buf[first].item()}, expected "
            f"{expected[first].item()} ({len(wrong)} of {buf.numel()} elements differ)")


def bus_bandwidth_gbps(nbytes, seconds, size, collective="allreduce"):
    """nccl-tests' bus bandwidth: what each link carries per second in a bandwidth-optimal ring."""
    factor = 2 * (size - 1) / size if collective == "allreduce" else (size - 1) / size
    return factor * nbytes * 8 / seconds / 1e9


def measure(comm, nbytes, args):
    """Time ``args.iters`` verified allreduces of ``nbytes``; the same result on every rank."""
    x, expected = make_inputs(nbytes // 4, comm.rank, comm.size, args.op)
    scatter, gather, exchange = (args.collective == c for c in ("reducescatter", "allgather", "alltoall"))
    if scatter:  # this rank's rows of the sum: Horovod's split, the first count % size ranks one more
        count, size = x.numel(), comm.size
        first = comm.rank * (count // size) + min(comm.rank, count % size)
        expected = expected[first:first + count // size + (comm.rank < count % size)]
    if gather:  # this rank gives 1/N of the result; every rank's rows, in rank order, come back
        rows = (torch.arange(x.numel() // comm.size, dtype=torch.int32) % PATTERN_PERIOD + 1).float()
        x, expected = rows * (comm.rank + 1), torch.cat([rows * (r + 1) for r in range(comm.size)])
    if exchange:  # rank s sends block r of its buffer to rank r: rank r gets block r of every rank's
        block = x.numel() // comm.size
        pattern = (torch.arange(block * comm.size, dtype=torch.int32) % PATTERN_PERIOD + 1).float()
        mine = pattern[comm.rank * block:(comm.rank + 1) * block]
        x, expected = pattern * (comm.rank + 1), torch.cat([mine * (s + 1) for s in range(comm.size)])
    buf = torch.empty_like(x)
    times = []
    for iteration in range(args.warmup + args.iters):
        buf.copy_(x)
        comm.barrier()
        start = time.perf_counter()
        if scatter:
            out = comm.reducescatter(buf, args.op, f"reducescatter.{nbytes}")
        elif gather:
            out = comm.allgather(buf, f"allgather.{nbytes}")
        elif exchange:
            out = comm.alltoall(buf, f"alltoall.{nbytes}")
        else:
            out = comm.allreduce(buf, args.op, f"allreduce.{nbytes}")
        elapsed = time.perf_counter() - start
        exact = gather or exchange  # nothing is reduced: bit for bit
        check(out, expected, "sum" if exact else args.op, comm.rank, nbytes, iteration,
              None if exact else getattr(comm, "compression", None), args.collective)
        if iteration >= args.warmup:
            times.append(elapsed)
    slowest = np.max(comm.allgather_object(times), axis=0)  # per iteration, the slowest rank
    median = float(np.median(slowest))
    return {"bytes": nbytes, "iters": args.iters, "median_s": median,
            "p90_s": float(np.percentile(slowest, 90)),
            "busbw_gbps": bus_bandwidth_gbps(nbytes, median, comm.size, args.collective),
            "verified": True}


def measure_batch(comm, nbytes, args):
    """Time ``args.iters`` verified batches of ``args.batch`` async allreduces of ``nbytes`` each,
    posted in a different random order on every rank (and every iteration), then all waited for:
    what a training step's gradient buckets look like when hooks fire in rank-dependent orders.
    Bus bandwidth counts the whole batch."""
    x, expected = make_inputs(nbytes // 4, comm.rank, comm.size, args.op)
    bufs = [torch.empty_like(x) for _ in range(args.batch)]
    times = []
    for iteration in range(args.warmup + args.iters):
        for buf in bufs:
            buf.copy_(x)
        order = list(range(args.batch))
        random.Random(f"{comm.rank}.{iteration}").shuffle(order)
        comm.barrier()
        start = time.perf_counter()
        handles = [comm.allreduce_async_(bufs[i], args.op, f"batch.{nbytes}.{i}") for i in order]
        for handle in handles:
            comm.synchronize(handle)
        elapsed = time.perf_counter() - start
        for buf in bufs:
            check(buf, expected, args.op, comm.rank, nbytes, iteration, getattr(comm, "compression", None))
        if iteration >= args.warmup:
            times.append(elapsed)
    slowest = np.max(comm.allgather_object(times), axis=0)
    median = float(np.median(slowest))
    return {"bytes": nbytes, "batch": args.batch, "order": "random per rank", "iters": args.iters,
            "median_s": median, "p90_s": float(np.percentile(slowest, 90)),
            "busbw_gbps": bus_bandwidth_gbps(nbytes * args.batch, median, comm.size), "verified": True}


def tcp_connections():
    """Established TCP connections of this process and its children (e.g. proxy processes)."""
    me = psutil.Process()
    count = 0
    for proc in [me] + me.children(recursive=True):
        try:
            count += sum(1 for c in proc.net_connections(kind="tcp")
                         if c.status == psutil.CONN_ESTABLISHED)
        except psutil.NoSuchProcess:
            pass
    return count


def worker(args):
    if args.backend == common.RING:
        common.ring_worker(args)
        return
    backend = common.parse_backend(args.backend)
    torch.set_num_threads(args.threads)
    comm = open_comm(backend, args.rendezvous)
    results = []
    if args.collective != "allreduce" and not hasattr(comm, args.collective):
        if comm.rank == 0:
            common.write_json(args.result_file, {"skipped": f"{backend.kind} runs no {args.collective} here"})
        comm.close()
        return
    if args.batch > 1 and not hasattr(comm, "allreduce_async_"):
        if comm.rank == 0:
            common.write_json(args.result_file, {"skipped": f"--batch posts in a different order on every "
                                                            f"rank, which {backend.kind} cannot negotiate"})
        comm.close()
        return
    for nbytes in args.sizes:
        results.append(measure_batch(comm, nbytes, args) if args.batch > 1 else measure(comm, nbytes, args))
        if comm.rank == 0:
            r = results[-1]
            print(f"{backend.spec}: {common.format_size(nbytes)} {r['busbw_gbps']:.2f} Gbit/s "
                  f"{r['median_s'] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    connections = comm.allgather_object(tcp_connections())
    if comm.rank == 0:
        plane = (common.data_plane(comm.hvd) if isinstance(comm, HorovodComm)
                 else common.data_plane(comm.world) if isinstance(comm, TorchComm) else None)
        common.write_json(args.result_file, {"np": comm.size, "op": args.op, "collective": args.collective,
                                             "threads": args.threads,
                                             "tcp_connections": connections, "data_plane": plane,
                                             "results": results})
    comm.close()


# --------------------------------------------------------------------------------------------
# Driver


def worker_argv(backend, args):
    return [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--backend", backend.spec,
            "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--op", args.op, "--collective", args.collective,
            "--threads", str(args.threads),
            "--batch", str(args.batch)]


def merge_rounds(rounds):
    """One entry per backend from several rounds: per size, the median over the rounds of their
    median and p90 latencies (bus bandwidth from that median), and the spread over the rounds:
    the fastest and slowest round's median latency (``min_s``, ``max_s``) and the bus bandwidths
    they give (``busbw_max_gbps``, ``busbw_min_gbps``), every round's median latency and bus
    bandwidth; the rounds' own entries are kept under "rounds". A backend that failed or was
    skipped in any round is reported as that round's entry."""
    merged = []
    for first, entries, bad in common.backend_rounds(rounds):
        if bad is not None:
            merged.append(dict(bad, rounds=entries))
            continue
        size = entries[0]["result"]["np"]
        collective = entries[0]["result"].get("collective", "allreduce")
        results = []
        for per_size in zip(*(e["result"]["results"] for e in entries)):
            medians = [r["median_s"] for r in per_size]
            median = float(np.median(medians))
            nbytes = per_size[0]["bytes"] * per_size[0].get("batch", 1)
            results.append({"bytes": per_size[0]["bytes"], "iters": per_size[0]["iters"],
                            "rounds": len(per_size), "median_s": median,
                            "min_s": min(medians), "max_s": max(medians),
                            "p90_s": float(np.median([r["p90_s"] for r in per_size])),
                            "busbw_gbps": bus_bandwidth_gbps(nbytes, median, size, collective),
                            "busbw_min_gbps": bus_bandwidth_gbps(nbytes, max(medians), size, collective),
                            "busbw_max_gbps": bus_bandwidth_gbps(nbytes, min(medians), size, collective),
                            "round_medians_s": medians,
                            "round_busbw_gbps": [bus_bandwidth_gbps(nbytes, t, size, collective) for t in medians],
                            "verified": all(r["verified"] for r in per_size)})
            if "batch" in per_size[0]:
                results[-1].update(batch=per_size[0]["batch"], order=per_size[0]["order"])
        result = dict(entries[0]["result"], results=results)
        merged.append(dict(first, result=result, rounds=entries,
                           seconds=round(sum(e.get("seconds", 0) for e in entries), 1)))
    return merged


def summarize(entries, ceiling, ceiling_rounds=()):
    """Per size, every ok backend against the ceiling and against the first ok backend: the ratio
    of the medians and the spread of the round-by-round ratios (each round's bus bandwidth over the
    same round's ceiling, or the first backend's). {size: {backend: {...}}}."""
    ok = [e for e in entries if e["status"] == "ok"]
    ceiling_gbps = ceiling.get("mean_gbps") if ceiling and ceiling.get("status") == "ok" else None
    summary = {}
    if not ok:
        return summary
    for index, size in enumerate(r["bytes"] for r in ok[0]["result"]["results"]):
        first = ok[0]["result"]["results"][index]
        per_backend = {}
        for entry in ok:
            result = entry["result"]["results"][index]
            rounds = result.get("round_busbw_gbps", [result["busbw_gbps"]])
            per_backend[entry["backend"]] = {
                "busbw": common.spread(rounds),
                "of_ceiling": (result["busbw_gbps"] / ceiling_gbps) if ceiling_gbps else None,
                "of_ceiling_rounds": common.spread(common.paired_ratios(rounds, list(ceiling_rounds))),
                "vs_first": result["busbw_gbps"] / first["busbw_gbps"],
                "vs_first_rounds": common.spread(common.paired_ratios(
                    rounds, first.get("round_busbw_gbps", [first["busbw_gbps"]])))}
        summary[size] = per_backend
    return summary


def ratio_cell(median, rounds, suffix="x"):
    """'0.87x [0.80-0.90]': a ratio of medians and the spread of the round-by-round ratios."""
    if median is None:
        return "-"
    if rounds is None or rounds["n"] < 2:
        return f"{median:.2f}{suffix}"
    return f"{median:.2f}{suffix} [{rounds['min']:.2f}-{rounds['max']:.2f}]"


def print_table(entries, sizes, ceiling=None, summary=None, proxy_threshold=None):
    ok = [e for e in entries if e["status"] == "ok"]
    if ceiling is not None:
        print(common.ceiling_line(ceiling))
    if ok:
        rounds = max(len(e.get("rounds", [e])) for e in ok)
        print(f"bus bandwidth Gbit/s and latency ms: median [min-max] over {rounds} round"
              f"{'s' if rounds != 1 else ''} of each job's median")
        summary = summary if summary is not None else summarize(ok, ceiling)
        first = ok[0]["backend"]
        rows = []
        for index, size in enumerate(sizes):
            for entry in ok:
                r = entry["result"]["results"][index]
                s = summary[r["bytes"]][entry["backend"]]
                latency = common.spread([t * 1e3 for t in r.get("round_medians_s", [r["median_s"]])])
                rows.append([common.format_size(size), entry["backend"],
                             common.data_plane_label(entry["result"].get("data_plane")),
                             common.format_spread(dict(s["busbw"], median=r["busbw_gbps"]), 2),
                             common.format_spread(dict(latency, median=r["median_s"] * 1e3), 1),
                             ratio_cell(s["of_ceiling"], s["of_ceiling_rounds"]),
                             ratio_cell(s["vs_first"], s["vs_first_rounds"]),
                             max(entry["result"]["tcp_connections"])])
        print(common.format_table(["size", "backend", "data plane", "busbw Gbit/s", "latency ms",
                                   "x ceiling", f"vs {first}", "TCP conns/rank"], rows))
        note = common.settings_note((e["backend"] for e in ok), proxy_threshold)
        if note:
            print(note)
    common.print_problems(entries)


def plot_data(entries, ceiling=None):
    """What the plot draws: per ok backend its sizes, median bus bandwidth and latency with their
    spread over the rounds (as error bars), and the ceiling line (Gbit/s, None when not measured)."""
    series = []
    for entry in entries:
        if entry["status"] != "ok":
            continue
        results = entry["result"]["results"]
        series.append({
            "label": entry["backend"], "x": [r["bytes"] for r in results],
            "busbw": [r["busbw_gbps"] for r in results],
            "busbw_err": [[r["busbw_gbps"] - r.get("busbw_min_gbps", r["busbw_gbps"]) for r in results],
                          [r.get("busbw_max_gbps", r["busbw_gbps"]) - r["busbw_gbps"] for r in results]],
            "latency_ms": [r["median_s"] * 1e3 for r in results],
            "latency_err": [[(r["median_s"] - r.get("min_s", r["median_s"])) * 1e3 for r in results],
                            [(r.get("max_s", r["median_s"]) - r["median_s"]) * 1e3 for r in results]]})
    ceiling_gbps = ceiling.get("mean_gbps") if ceiling and ceiling.get("status") == "ok" else None
    return {"series": series, "ceiling_gbps": ceiling_gbps}


def plot(entries, args, path, ceiling=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(13, 5))
    sizes = args.sizes
    data = plot_data(entries, ceiling)
    for series in data["series"]:
        bw_ax.errorbar(series["x"], series["busbw"], yerr=series["busbw_err"], marker="o", capsize=4,
                       label=series["label"])
        lat_ax.errorbar(series["x"], series["latency_ms"], yerr=series["latency_err"], marker="o",
                        capsize=4, label=series["label"])
    if data["ceiling_gbps"]:
        bw_ax.axhline(data["ceiling_gbps"], color="tab:red", linestyle="--",
                      label=f"raw-TCP ring ceiling {data['ceiling_gbps']:.2f}")
    for ax in (bw_ax, lat_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [common.format_size(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
    rounds = args.rounds
    bw_ax.set_ylabel("bus bandwidth (Gbit/s)")
    bw_ax.set_ylim(bottom=0)
    bw_ax.set_title(f"allreduce bus bandwidth, median of {rounds} round{'s' if rounds != 1 else ''}"
                    + (" (bars: min-max)" if rounds > 1 else ""))
    lat_ax.set_yscale("log")
    lat_ax.set_ylabel("median latency (ms)")
    lat_ax.set_title("allreduce latency")
    if data["series"] or data["ceiling_gbps"]:
        bw_ax.legend(fontsize="small")
    fig.tight_layout()
    common.save_figure(fig, path)


def job_line(entry):
    """A finished job in one line (progress)."""
    if entry["backend"] == common.RING:
        return common.ring_line(entry)
    return ", ".join(f"{common.format_size(r['bytes'])} {r['busbw_gbps']:.2f} Gbit/s ({r['median_s'] * 1e3:.0f} ms)"
                     for r in entry["result"]["results"])


def driver(args):
    try:
        backends = common.parse_backends(args.backends)
    except ValueError as err:
        sys.exit(f"error: {err}")
    common.warn_inherited_fasthorovod_env()
    start = time.monotonic()
    plan = ([(common.RING_BACKEND, common.ring_worker_argv(__file__, args))] if args.ceiling else []) \
        + [(backend, worker_argv(backend, args)) for backend in backends]
    rounds = common.run_rounds("allreduce", plan, args, job_line, args.proxy_threshold)
    ring = [e for r in rounds for e in r if e["backend"] == common.RING]
    entries = merge_rounds([[e for e in r if e["backend"] != common.RING] for r in rounds])
    ceiling = common.merge_ring(ring) if args.ceiling else None
    summary = summarize(entries, ceiling, common.round_ceilings(ring))
    print()
    print_table(entries, args.sizes, ceiling, summary, args.proxy_threshold)
    seconds = time.monotonic() - start
    print(f"{len(plan) * args.rounds} jobs in {common.clock(seconds)}")
    if args.out:
        doc = common.report("allreduce", args, entries)
        doc.update(ceiling=ceiling, seconds=round(seconds, 1),
                   summary={common.format_size(size): per for size, per in summary.items()},
                   settings=common.settings_note((b.spec for b in backends), args.proxy_threshold))
        common.write_json(args.out, doc)
    if args.plot:
        plot(entries, args, args.plot, ceiling)
    failed = any(e["status"] == "failed" for e in entries + ring)
    return 1 if failed else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv)


if __name__ == "__main__":
    sys.exit(main())
