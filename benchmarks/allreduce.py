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
                        help="comma-separated message sizes in bytes, KiB, MiB or GiB, each a "
                             "multiple of 4 (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations per size (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations before them (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1,
                        help="per timed iteration, post this many async allreduces of each size in a "
                             "different random order on every rank and then wait for all (Horovod-API "
                             "backends only; bus bandwidth counts the whole batch) (default: %(default)s)")
    parser.add_argument("--op", choices=("sum", "average"), default="sum",
                        help="reduction (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of backends this many times, one after another "
                             "(A B C A B C ...), and report per backend and size the median of the "
                             "rounds' medians; every round is kept in the JSON. Use it on a noisy "
                             "machine (default: %(default)s)")
    parser.add_argument("--proxy-threshold", type=common.parse_size, default="64KiB",
                        help="FASTHOROVOD_PROXY_THRESHOLD_BYTES for fasthorovod backends: tensors "
                             "this large or larger go through the proxies (default: %(default)s)")
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0 or args.np < 1 or args.rounds < 1 or args.batch < 1:
        parser.error("need --iters >= 1, --warmup >= 0, --np >= 1, --rounds >= 1 and --batch >= 1")
    if args.threads is None:
        args.threads = common.default_threads(args.np)
    return args


# --------------------------------------------------------------------------------------------
# Worker: one rank. Each communicator offers the same four operations.


class HorovodComm:
    """horovod.torch or fasthorovod.torch (the same API)."""

    def __init__(self, module):
        self.hvd = importlib.import_module(module)
        self.hvd.init()
        self.rank, self.size = self.hvd.rank(), self.hvd.size()

    def barrier(self):
        self.hvd.barrier()

    def allreduce_(self, buf, op, name):
        self.hvd.allreduce_(buf, op=self.hvd.Sum if op == "sum" else self.hvd.Average, name=name)

    def allreduce_async_(self, buf, op, name):
        return self.hvd.allreduce_async_(buf, op=self.hvd.Sum if op == "sum" else self.hvd.Average, name=name)

    def synchronize(self, handle):
        self.hvd.synchronize(handle)

    def allgather_object(self, obj):
        return self.hvd.allgather_object(obj)

    def close(self):
        self.hvd.shutdown()


class TorchGlooComm:
    """torch.distributed with the gloo backend; rank and size come from the launcher's env."""

    def __init__(self, rendezvous):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.size = rank_from_env()
        dist.init_process_group("gloo", init_method=rendezvous, rank=self.rank,
                                world_size=self.size)

    def barrier(self):
        self.dist.barrier()

    def allreduce_(self, buf, op, name):
        self.dist.all_reduce(buf, op=self.dist.ReduceOp.SUM)
        if op == "average":  # gloo has no AVG
            buf.div_(self.size)

    def allgather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def close(self):
        self.dist.destroy_process_group()


class MpiComm:
    """mpi4py on MPI_COMM_WORLD; buffers are the tensors' memory, shared with numpy."""

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def allreduce_(self, buf, op, name):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf.numpy(), op=self.MPI.SUM)
        if op == "average":
            buf.div_(self.size)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def close(self):
        pass  # mpi4py finalizes MPI at exit


def rank_from_env():
    """(rank, size) from whichever launcher started this process."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("no RANK, HOROVOD_RANK or OMPI_COMM_WORLD_RANK in the environment")


def open_comm(backend, rendezvous):
    if backend.kind in common.HVD_MODULES:
        return HorovodComm(common.HVD_MODULES[backend.kind])
    if backend.kind == "torch-gloo":
        return TorchGlooComm(rendezvous)
    return MpiComm()


def make_inputs(count, rank, size, op):
    """This rank's input and the exact allreduce result (see the module docstring)."""
    pattern = (torch.arange(count, dtype=torch.int32) % PATTERN_PERIOD + 1).float()
    total = size * (size + 1) / 2  # sum over ranks of (r + 1)
    expected = pattern * (total if op == "sum" else total / size)
    return pattern.mul_(rank + 1), expected


def check(buf, expected, op, rank, nbytes, iteration):
    """Raise if ``buf`` is not the expected result (bitwise for Sum; 1e-6 relative for Average,
    whose 1/N scaling need not be exact)."""
    if op == "sum":
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
            f"rank {rank}: wrong {op} allreduce of {common.format_size(nbytes)} at iteration "
            f"{iteration}: element {first} is {buf[first].item()}, expected "
            f"{expected[first].item()} ({len(wrong)} of {buf.numel()} elements differ)")


def bus_bandwidth_gbps(nbytes, seconds, size):
    return 2 * (size - 1) / size * nbytes * 8 / seconds / 1e9


def measure(comm, nbytes, args):
    """Time ``args.iters`` verified allreduces of ``nbytes``; the same result on every rank."""
    x, expected = make_inputs(nbytes // 4, comm.rank, comm.size, args.op)
    buf = torch.empty_like(x)
    times = []
    for iteration in range(args.warmup + args.iters):
        buf.copy_(x)
        comm.barrier()
        start = time.perf_counter()
        comm.allreduce_(buf, args.op, f"allreduce.{nbytes}")
        elapsed = time.perf_counter() - start
        check(buf, expected, args.op, comm.rank, nbytes, iteration)
        if iteration >= args.warmup:
            times.append(elapsed)
    slowest = np.max(comm.allgather_object(times), axis=0)  # per iteration, the slowest rank
    median = float(np.median(slowest))
    return {"bytes": nbytes, "iters": args.iters, "median_s": median,
            "p90_s": float(np.percentile(slowest, 90)),
            "busbw_gbps": bus_bandwidth_gbps(nbytes, median, comm.size),
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
            check(buf, expected, args.op, comm.rank, nbytes, iteration)
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
    backend = common.parse_backend(args.backend)
    torch.set_num_threads(args.threads)
    comm = open_comm(backend, args.rendezvous)
    results = []
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
        plane = common.data_plane(comm.hvd) if isinstance(comm, HorovodComm) else None
        common.write_json(args.result_file, {"np": comm.size, "op": args.op,
                                             "threads": args.threads,
                                             "tcp_connections": connections, "data_plane": plane,
                                             "results": results})
    comm.close()


# --------------------------------------------------------------------------------------------
# Driver


def worker_argv(backend, args):
    return [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--backend", backend.spec,
            "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--op", args.op, "--threads", str(args.threads),
            "--batch", str(args.batch)]


def merge_rounds(rounds):
    """One entry per backend from several rounds: per size, the median over the rounds of their
    median and p90 latencies (bus bandwidth from that median); the rounds' own entries are kept
    under "rounds". A backend that failed or was skipped in any round is reported as that round's
    entry."""
    merged = []
    for index, first in enumerate(rounds[0]):
        entries = [r[index] for r in rounds]
        bad = next((e for e in entries if e["status"] != "ok"), None)
        if bad is not None:
            merged.append(dict(bad, rounds=entries))
            continue
        size = entries[0]["result"]["np"]
        results = []
        for per_size in zip(*(e["result"]["results"] for e in entries)):
            medians = [r["median_s"] for r in per_size]
            median = float(np.median(medians))
            results.append({"bytes": per_size[0]["bytes"], "iters": per_size[0]["iters"],
                            "rounds": len(per_size), "median_s": median,
                            "p90_s": float(np.median([r["p90_s"] for r in per_size])),
                            "busbw_gbps": bus_bandwidth_gbps(per_size[0]["bytes"], median, size),
                            "round_medians_s": medians,
                            "verified": all(r["verified"] for r in per_size)})
        result = dict(entries[0]["result"], results=results)
        merged.append(dict(first, result=result, rounds=entries,
                           seconds=round(sum(e.get("seconds", 0) for e in entries), 1)))
    return merged


def cell(result):
    return f"{result['busbw_gbps']:.2f} ({result['median_s'] * 1e3:.3f})"


def print_table(entries, sizes):
    ok = [e for e in entries if e["status"] == "ok"]
    if ok:
        print("bus bandwidth Gbit/s (median latency ms)")
        by_size = [{r["bytes"]: r for r in e["result"]["results"]} for e in ok]
        rows = [[common.format_size(size)] + [cell(r[size]) for r in by_size] for size in sizes]
        rows.append(["TCP conns/rank"]
                    + [max(e["result"]["tcp_connections"]) for e in ok])
        if any(e["result"].get("data_plane") for e in ok):  # FastHorovod: lanes x sockets (source)
            rows.append(["data plane"] + [common.data_plane_label(e["result"].get("data_plane")) for e in ok])
        print(common.format_table(["size"] + [e["backend"] for e in ok], rows))
    common.print_problems(entries)


def plot(entries, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (bw_ax, lat_ax) = plt.subplots(1, 2, figsize=(13, 5))
    sizes = args.sizes
    for entry in entries:
        if entry["status"] != "ok":
            continue
        results = entry["result"]["results"]
        x = [r["bytes"] for r in results]
        bw_ax.plot(x, [r["busbw_gbps"] for r in results], marker="o", label=entry["backend"])
        lat_ax.plot(x, [r["median_s"] * 1e3 for r in results], marker="o", label=entry["backend"])
    for ax in (bw_ax, lat_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [common.format_size(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
    bw_ax.set_ylabel("bus bandwidth (Gbit/s)")
    bw_ax.set_title("allreduce bus bandwidth, 2(n-1)/n * bytes / median time")
    lat_ax.set_yscale("log")
    lat_ax.set_ylabel("median latency (ms)")
    lat_ax.set_title("allreduce latency")
    if bw_ax.lines:
        bw_ax.legend(fontsize="small")
    fig.tight_layout()
    common.save_figure(fig, path)


def driver(args):
    try:
        backends = common.parse_backends(args.backends)
    except ValueError as err:
        sys.exit(f"error: {err}")
    rounds = []
    trace_root = args.trace_root or "traces"
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"== round {number + 1}/{args.rounds}", file=sys.stderr, flush=True)
            args.trace_root = os.path.join(trace_root, f"round{number + 1}")  # each round's traces kept
        rounds.append(common.run_backends("allreduce", backends, args, worker_argv))
    entries = merge_rounds(rounds) if args.rounds > 1 else rounds[0]
    print_table(entries, args.sizes)
    if args.out:
        common.write_json(args.out, common.report("allreduce", args, entries))
    if args.plot:
        plot(entries, args, args.plot)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv)


if __name__ == "__main__":
    sys.exit(main())
