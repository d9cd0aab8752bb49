"""Negotiated collectives, run as Horovod ranks by tests/multiproc/test_negotiation.py.

Every scenario issues large (proxied) collectives in a different order on each rank, or from
several threads, or describes a tensor differently on one rank, and checks the results exactly.
"""
import argparse
import os
import random
import sys
import threading
import time

import torch

import lanes  # tests/workers/, this script's directory

DTYPES = [torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float16]
MIB = 1 << 20


def rank_value(rank: int, i: int) -> int:
    return (rank + 1) * (i % 7 + 1)


def scenario_permuted(hvd, args):
    """N async allreduces of mixed sizes (1-16 MiB) and dtypes, posted in a different random order
    on every rank by 1-4 threads each: exact results."""
    rank, size = hvd.rank(), hvd.size()
    plan = random.Random(args.seed)  # the same tensors everywhere
    tensors = []
    for i in range(args.count):
        dtype = DTYPES[i % len(DTYPES)]
        nbytes = plan.choice([1, 2, 4, 8, 16]) * MIB
        tensors.append((f"perm.{i}", dtype, nbytes // torch.empty((), dtype=dtype).element_size()))
    order = list(range(args.count))
    random.Random(args.seed * 1000 + rank).shuffle(order)  # a different order on every rank
    errors = []

    def post(indices):
        try:
            handles = []
            for i in indices:
                name, dtype, count = tensors[i]
                x = torch.full((count,), rank_value(rank, i), dtype=dtype)
                handles.append((i, hvd.allreduce_async(x, op=hvd.Sum, name=name)))
            for i, h in handles:
                name, dtype, count = tensors[i]
                out = hvd.synchronize(h)
                expected = sum(rank_value(r, i) for r in range(size))
                assert out.dtype == dtype and out.numel() == count, name
                assert torch.all(out == expected), f"{name}: {out[:4]} != {expected}"
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=post, args=(order[t::args.threads],)) for t in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a posting thread hung"
    if errors:
        raise errors[0]
    lanes = hvd.proxy_group().lane_stats()
    assert sum(lane["collectives"] for lane in lanes) >= args.count, "the tensors must travel through the proxies"
    print(f"rank {rank}: permuted ok ({args.count} tensors, {args.threads} threads)", flush=True)


def scenario_grouped(hvd, args):
    """Grouped allreduces (one dtype each, so really proxied) posted in permuted order."""
    rank, size = hvd.rank(), hvd.size()
    groups = [[torch.full((MIB // 4 + g,), float(rank + g + j)) for j in range(3)] for g in range(6)]
    order = list(range(len(groups)))
    random.Random(rank).shuffle(order)
    handles = {g: hvd.grouped_allreduce_async(groups[g], op=hvd.Sum, name=f"group.{g}") for g in order}
    for g in sorted(order):
        outs = hvd.synchronize(handles[g])
        for j, out in enumerate(outs):
            assert torch.all(out == sum(r + g + j for r in range(size))), (g, j)
    print(f"rank {rank}: grouped ok", flush=True)


def scenario_stall(hvd, args):
    """Rank 1 withholds a tensor for a while: rank 0's coordinator reports it with the missing rank;
    with a stall shutdown, a tensor rank 1 never submits fails on rank 0, and the job goes on."""
    rank, size = hvd.rank(), hvd.size()
    x = torch.ones(MIB)
    if rank == 1:
        time.sleep(args.delay)
    out = hvd.allreduce(x, op=hvd.Sum, name="stall.late")
    assert torch.all(out == size)
    if args.shutdown:
        if rank == 0:
            try:
                hvd.allreduce(x, op=hvd.Sum, name="stall.never")
            except hvd.FastHorovodTimeoutError as e:
                assert "stall.never" in str(e) and "[1]" in str(e), str(e)
                print(f"rank {rank}: stalled tensor failed: {e}", flush=True)
            else:
                raise AssertionError("a tensor rank 1 never submits must fail after the stall shutdown time")
        hvd.barrier()
        out = hvd.allreduce(x, op=hvd.Sum, name="stall.after")
        assert torch.all(out == size)
    print(f"rank {rank}: stall ok", flush=True)


def scenario_dynamic(hvd, args):
    """DistributedOptimizer where each rank's forward skips a different branch on each step (its
    gradients then come late, from synchronize(), with zeros) and runs the branches in a
    rank-dependent order (so gradient hooks fire in different orders). Rank 0 saves the parameters
    after every step, to be compared with Horovod's."""
    rank = hvd.rank()
    torch.manual_seed(1234)
    branches = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(3))
    head = torch.nn.Linear(512, 10)
    model = torch.nn.ModuleDict({"branches": branches, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + rank)
    history = []
    for step in range(args.steps):
        opt.zero_grad()
        x = torch.randn(16, 512, generator=data)
        y = torch.randint(0, 10, (16,), generator=data)
        order = [(step + rank + k) % 3 for k in range(3)][:: 1 if rank % 2 == 0 else -1]
        skipped = (step + rank) % 3
        hidden = sum(torch.relu(branches[b](x)) for b in order if b != skipped)
        torch.nn.functional.cross_entropy(head(hidden), y).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    if rank == 0:
        torch.save(torch.stack(history), args.out)
    print(f"rank {rank}: dynamic ok, proxies={getattr(hvd, 'proxy_group', lambda: None)() is not None}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["permuted", "grouped", "stall", "dynamic"])
    parser.add_argument("--module", default="fasthorovod.torch", choices=["fasthorovod.torch", "horovod.torch"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--delay", type=float, default=2.5)
    parser.add_argument("--shutdown", action="store_true")
    args = parser.parse_args()
    import importlib

    hvd = importlib.import_module(args.module)
    lanes.keep()
    hvd.init()
    globals()[f"scenario_{args.scenario}"](hvd, args)
    lanes.report(hvd.rank(), hvd)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
