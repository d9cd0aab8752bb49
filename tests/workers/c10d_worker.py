"""A torch.distributed program on the "fasthorovod" backend (fasthorovod/distributed), launched by
torchrun or by tests/multiproc/test_distributed.py (env:// rendezvous either way).

Every scenario checks its results against Gloo's, run in the same world on a Gloo group of its
own, and prints the proxies' collectives per lane before and after (the harness's claim that the
proxies carried them), then ``<scenario> ok``."""
import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import fasthorovod.distributed  # noqa: F401  (registers the backend)
from fasthorovod.exceptions import CollectiveMismatchError, FastHorovodError, FastHorovodTimeoutError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.int8]
SIZES = [1, 1000, 100_003]


def lanes_ran() -> list:
    """The collectives each lane of this process's proxies ran (none yet: zeros)."""
    from fasthorovod.distributed import backend
    running = backend._running
    return [lane["collectives"] for lane in running[0].lane_stats()] if running else [0]


def inputs(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers, so that every sum is exact in every dtype and any order."""
    high = 3 if dtype in (torch.uint8, torch.int8) else 20
    return torch.randint(0, high, (count,), generator=torch.Generator().manual_seed(seed * 31 + rank)).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what}: {a[:6]} != {b[:6]}"


def scenario_conformance(pg, gloo, rank, size):
    """Every collective the proxies take, for every dtype they carry and three sizes, equals
    Gloo's; AVG (which Gloo lacks) equals Gloo's sum over size; async works waited in reverse."""
    proxied = 0
    for d, dtype in enumerate(DTYPES):
        for count in SIZES:
            seed = 100 * d + count % 97
            x = inputs(rank, count, dtype, seed)
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=gloo)
            same(ours, theirs, f"all_reduce {dtype} {count}")
            root = count % size
            ours, theirs = x.clone(), x.clone()
            dist.broadcast(ours, src=root)
            dist.broadcast(theirs, src=root, group=gloo)
            same(ours, theirs, f"broadcast {dtype} {count}")
            ours, theirs = torch.empty(size * count, dtype=dtype), torch.empty(size * count, dtype=dtype)
            dist.all_gather_into_tensor(ours, x)
            dist.all_gather_into_tensor(theirs, x, group=gloo)
            same(ours, theirs, f"all_gather_into_tensor {dtype} {count}")
            ours = [torch.empty(count, dtype=dtype) for _ in range(size)]
            theirs = [torch.empty(count, dtype=dtype) for _ in range(size)]
            dist.all_gather(ours, x)
            dist.all_gather(theirs, x, group=gloo)
            for a, b in zip(ours, theirs):
                same(a, b, f"all_gather {dtype} {count}")
            big = inputs(rank, size * count, dtype, seed + 1)
            ours, theirs = torch.empty(count, dtype=dtype), big.clone()
            dist.reduce_scatter_tensor(ours, big)
            dist.all_reduce(theirs, group=gloo)  # Gloo's reduce-scatter is its allreduce's share
            same(ours, theirs[rank * count:(rank + 1) * count], f"reduce_scatter_tensor {dtype} {count}")
            ours = torch.empty(count, dtype=dtype)
            dist.reduce_scatter(ours, list(big.view(size, count)))
            same(ours, theirs[rank * count:(rank + 1) * count], f"reduce_scatter {dtype} {count}")
            proxied += 6
            if dtype.is_floating_point:
                ours, theirs = x.clone().double(), x.clone().double()
                dist.all_reduce(ours, op=dist.ReduceOp.AVG)
                dist.all_reduce(theirs, group=gloo)
                # the proxies scale by 1/size where this divides: an ulp apart at most
                assert torch.allclose(ours, theirs / size, rtol=1e-15, atol=0), f"all_reduce AVG {count}"
                proxied += 1
    xs = [inputs(rank, 50_000, torch.float32, i) for i in range(4)]
    expected = [x.clone() for x in xs]
    for e in expected:
        dist.all_reduce(e, group=gloo)
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for work, x, e in reversed(list(zip(works, xs, expected))):
        work.wait()
        same(x, e, "async all_reduce")
    proxied += 4
    x = torch.arange(size * 6, dtype=torch.float32) + 100 * rank  # small: inline in the mesh's heads; barrier: Gloo's
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(ours, x)
    dist.all_to_all_single(theirs, x, group=gloo)
    same(ours, theirs, "all_to_all_single")
    dist.barrier()
    return proxied


def train_mlp(rank: int, wrap, steps: int = 3, local_step: int = None) -> list:
    """The training scenarios' run, the same on every backend: a small MLP seeded alike on every
    rank, wrapped by `wrap(model)` (DDP, FSDP2: what runs forward), SGD on this rank's batches;
    step `local_step` runs under DDP's ``no_sync`` (nothing communicated) and takes no optimizer
    step. Returns the trained parameters (FSDP2's gathered whole)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    net = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        opt.zero_grad()
        with net.no_sync() if step == local_step else contextlib.nullcontext():
            net(torch.randn(16, 64, generator=data)).pow(2).mean().backward()
        if step != local_step:
            opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def ddp(group, hook=None):
    """A `wrap` for train_mlp: DDP on `group` (None: the default one), small buckets, `hook`."""
    def wrap(model):
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.1)
        if hook is not None:
            net.register_comm_hook(group, hook)
        return net
    return wrap


def scenario_ddp(pg, gloo, rank, size):
    """DDP on the backend trains bit for bit as DDP on Gloo (2 ranks: a sum of two is the same in
    any order), its buckets through the proxies."""
    before = sum(lanes_ran())
    ours = train_mlp(rank, ddp(None), steps=4, local_step=1)
    assert sum(lanes_ran()) > before, "DDP's buckets did not reach the proxies"
    for a, b in zip(ours, train_mlp(rank, ddp(gloo), steps=4, local_step=1)):
        same(a, b, "DDP parameters")
    return 0


def scenario_hook(pg, gloo, rank, size):
    """DDP on a Gloo group with FastHorovod's communication hook trains bit for bit as DDP on Gloo
    alone, its buckets through the proxies: the hook's own under --init gloo, else the backend's,
    which the hook shares."""
    before = sum(lanes_ran())
    ours = train_mlp(rank, ddp(gloo, fasthorovod.distributed.allreduce_hook))
    assert sum(lanes_ran()) > before, "the hook's buckets did not reach the proxies"
    for a, b in zip(ours, train_mlp(rank, ddp(gloo))):
        same(a, b, "DDP parameters with the hook")
    return 0


def scenario_fsdp(pg, gloo, rank, size):
    """FSDP2 (``fully_shard``, on the CPU) trains bit for bit as on a Gloo group (2 ranks), its
    all-gathers and reduce-scatters through the proxies (the group's ``all_gather_single`` and
    ``reduce_scatter_single``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def sharded(group):
        return lambda model: fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))

    for a, b in zip(train_mlp(rank, sharded(dist.group.WORLD)), train_mlp(rank, sharded(gloo))):
        same(a, b, "FSDP parameters")
    return 1  # per lane at least


def scenario_functional(pg, gloo, rank, size):
    """Functional collectives (torch.distributed._functional_collectives: what torch.compile and
    DTensor issue) on the group give Gloo's results, one at a time and coalesced, through the
    proxies (its ``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced`` and
    ``allreduce``)."""
    import torch.distributed._functional_collectives as fc

    def done(t):
        return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t

    xs = [inputs(rank, count, dtype, seed) for seed, (count, dtype) in
          enumerate([(1000 * size, torch.float32), (100_003 * size, torch.float64), (4096 * size, torch.int32)])]
    for x in xs:
        want = torch.empty(size * x.numel(), dtype=x.dtype)
        dist.all_gather_into_tensor(want, x, group=gloo)
        same(done(fc.all_gather_tensor(x, 0, pg)), want, "functional all_gather")
        want = torch.empty(x.numel() // size, dtype=x.dtype)
        dist.reduce_scatter_tensor(want, x, group=gloo)
        same(done(fc.reduce_scatter_tensor(x, "sum", 0, pg)), want, "functional reduce_scatter")
        want = x.clone()
        dist.all_reduce(want, group=gloo)
        same(done(fc.all_reduce(x, "sum", pg)), want, "functional all_reduce")
    scattered = fc.reduce_scatter_single_coalesced(xs, "sum", [0] * len(xs), pg)
    for x, r in zip(xs, scattered):
        want = torch.empty(x.numel() // size, dtype=x.dtype)
        dist.reduce_scatter_tensor(want, x, group=gloo)
        same(done(r), want, "coalesced functional reduce_scatter")
    flags = inputs(rank, 333, torch.uint8, 9).bool()  # a dtype the proxies do not carry: Gloo's, in the same work
    gathered = fc.all_gather_single_coalesced(xs + [flags], pg)
    for x, g in zip(xs + [flags], gathered):
        want = torch.empty(size * x.numel(), dtype=x.dtype)
        dist.all_gather_into_tensor(want, x, group=gloo)
        same(done(g), want, "coalesced functional all_gather")
    return 1


def scenario_alltoall(pg, gloo, rank, size):
    """``dist.all_to_all_single`` on the lanes' mesh gives Gloo's results: equal splits and splits
    that differ between ranks and destinations (some empty), several dtypes, 2-D rows."""
    proxied = 0
    for seed, (rows, dtype) in enumerate([(50_000 * size, torch.float32), (3_000 * size, torch.int64),
                                          (7 * size, torch.float64)]):
        x = inputs(rank, rows * 4, dtype, seed).view(rows, 4)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x, group=gloo)
        got = torch.empty_like(x)
        dist.all_to_all_single(got, x, group=pg)
        same(got, want, f"all_to_all_single {dtype}")
        proxied += 1
    send = [(rank + d) % (size + 1) * 1000 for d in range(size)]  # rank s sends rank d this many rows
    recv = [(s + rank) % (size + 1) * 1000 for s in range(size)]
    x = inputs(rank, sum(send) * 3, torch.float32, 7).view(sum(send), 3)
    want = torch.empty(sum(recv), 3)
    dist.all_to_all_single(want, x, recv, send, group=gloo)
    got = torch.empty(sum(recv), 3)
    dist.all_to_all_single(got, x, recv, send, group=pg)
    same(got, want, "all_to_all_single with uneven splits")
    return proxied + 1


def scenario_mismatch(pg, gloo, rank, size):
    """Ranks that issue different collectives get an error naming it, not a wrong result."""
    x = torch.ones(1000 * (rank + 1))
    try:
        dist.all_reduce(x)
        raise AssertionError("a mismatched all_reduce did not fail")
    except CollectiveMismatchError as e:
        assert "c10d.allreduce" in str(e), str(e)
    return 0


def scenario_timeout(pg, gloo, rank, size):
    """A collective that rank 1 never issues fails on rank 0 after the group's timeout (3 s)."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1000))
            raise AssertionError("an all_reduce without its peer did not fail")
        except FastHorovodTimeoutError as e:
            waited = time.monotonic() - started
            assert 2.5 < waited < 10 and "timeout" in str(e), (waited, str(e))
        store.set("timeout.checked", "1")
        store.wait(["timeout.seen"], datetime.timedelta(seconds=60))  # rank 0 holds the store: it leaves last
    else:
        store.wait(["timeout.checked"], datetime.timedelta(seconds=60))
        store.set("timeout.seen", "1")
    print(f"rank {rank}: timeout ok", flush=True)
    os._exit(0)  # the world is broken (rank 0's collective is still pending): no orderly shutdown


def scenario_dead_rank(pg, gloo, rank, size):
    """A rank that dies during a collective makes the others' works fail, well before the timeout."""
    dist.all_reduce(torch.ones(1000))
    if rank == size - 1:
        os._exit(3)
    started = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(1 << 20))
        raise AssertionError("all_reduce with a dead rank did not fail")
    except FastHorovodError as e:
        print(f"rank {rank}: dead_rank ok after {time.monotonic() - started:.1f} s: {type(e).__name__}", flush=True)
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--init", default="fasthorovod", help="the default group's backend")
    parser.add_argument("--describe", action="store_true",
                        help="print the data plane's plan as JSON (`data plane {...}`) after start-up")
    args = parser.parse_args()
    dist.init_process_group(args.init, timeout=datetime.timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    assert args.init != "fasthorovod" or pg.proxies is not None, "the proxies must be running"
    assert pg.group_name, "the group has no name (DeviceMesh.from_group needs one)"
    if args.describe:
        print(f"rank {rank}: data plane {json.dumps(pg.proxies.describe())}", flush=True)
    gloo = dist.new_group(backend="gloo")
    before = lanes_ran()
    proxied = globals()[f"scenario_{args.scenario}"](pg, gloo, rank, size)
    after = lanes_ran()
    assert all(b - a >= proxied for a, b in zip(before, after)), (before, after, proxied)
    print(f"rank {rank}: lanes ran {[b - a for a, b in zip(before, after)]} collectives", flush=True)
    dist.destroy_process_group()
    from fasthorovod.distributed import backend
    if args.init == "fasthorovod":  # (the hook's own proxies stop at interpreter exit)
        assert not backend._running, "destroy_process_group() left the proxies running"
    print(f"rank {rank}: {args.scenario} ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
