"""Scheduler workloads, run as Horovod ranks by tests/multiproc/test_scheduler.py.

    python scheduler_worker.py identical --algorithms od-sgd,ssd-sgd,...
    python scheduler_worker.py digits --algorithms ssgd,od-sgd,... --epochs 30 --out result.json

Every scenario checks its own results and exits non-zero on the first wrong value.
"""
import argparse
import hashlib
import json
import time

import torch

import fasthorovod.torch as hvd
import lanes  # tests/workers/, this script's directory
from fasthorovod.scheduler import TwoBitCompression

DELAYED = ("od-sgd", "ssd-sgd", "cd-sgd")


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def all_digests(model):
    return hvd.allgather_object(digest(model))


def mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def options_for(algorithm: str, warmup: int, threshold: float) -> dict:
    opts = {}
    if algorithm in ("od-sgd", "ssd-sgd", "cd-sgd", "local-sgd"):
        opts["warmup_steps"] = warmup
    if algorithm in ("cd-sgd",):
        opts["threshold"] = threshold
    return opts


def make_optimizer(model, algorithm: str, lr: float, warmup: int, threshold: float):
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if algorithm == "ssgd":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if algorithm == "ssgd-2bit":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=TwoBitCompression(threshold))
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), algorithm=algorithm,
                                    **options_for(algorithm, warmup, threshold))


def scenario_identical(args):
    """After sync_weights() every rank holds bit-identical parameters (= the global weights)."""
    rank, size = hvd.rank(), hvd.size()
    for algorithm in args.algorithms.split(","):
        torch.manual_seed(7 + rank)  # different initial weights per rank: broadcast must fix them
        model = mlp(32)
        opt = make_optimizer(model, algorithm, lr=0.05, warmup=3, threshold=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        sent, stats = lane_bytes(), opt.communication_stats()
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(13):
            opt.zero_grad()
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        before = all_digests(model)
        if algorithm in DELAYED + ("local-sgd",):
            assert len(set(before)) == size, f"{algorithm}: local weights should differ before sync_weights"
        opt.sync_weights()
        check_lanes_carried(algorithm, lane_bytes() - sent, opt.communication_stats(), stats)
        after = all_digests(model)
        assert len(set(after)) == 1, f"{algorithm}: ranks differ after sync_weights: {after}"
        if algorithm in DELAYED:
            assert all(torch.equal(p, w) for p, w in zip(model.parameters(), opt.global_weights))
        state = opt.state_dict()["fasthorovod_scheduler"]
        assert state["algorithm"] == opt.algorithm and state["step"] == 14, state  # 13 + broadcast's step
        print(f"rank {rank}: {algorithm} identical after sync_weights ({after[0][:12]})", flush=True)


def load_split(rank: int, size: int):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    shard = torch.arange(rank, len(x_train), size)
    return (x_train[shard], y_train[shard], len(x_train) // size), (torch.from_numpy(x_test), torch.from_numpy(y_test))


def lane_bytes() -> int:
    group = hvd.proxy_group()
    return sum(s["bytes_sent"] for s in group.lane_stats()) if group is not None else 0


def lane_bytes_at_least(size: int, allreduced: float, allgathered: float) -> float:
    """What a rank's lanes send at least for allreduces of `allreduced` bytes and allgathers of
    rows of `allgathered` bytes (its own) among `size` ranks: 2(n-1)/n of the first and every other
    rank's row of the second (tests/multiproc/harness.py ring_allreduce_bytes; headers only add)."""
    return 2 * (size - 1) / size * allreduced + (size - 1) * allgathered


def check_lanes_carried(algorithm: str, sent: int, stats: dict, before: dict) -> None:
    """The policy's collectives since `before` (its communication_stats then) went through this
    rank's lanes, which sent `sent` bytes meanwhile."""
    allreduced = stats["allreduce_bytes"] - before["allreduce_bytes"]
    allgathered = stats["allgather_bytes"] - before["allgather_bytes"]
    least = lane_bytes_at_least(hvd.size(), allreduced, allgathered)
    assert sent >= least > 0, (f"{algorithm}: the lanes sent {sent} B for {allreduced} B allreduced and "
                               f"{allgathered} B allgathered (at least {least:.0f} B expected)")


def scenario_digits(args):
    """Trains every algorithm on scikit-learn's digits (same init, data and epochs); rank 0 writes
    test accuracy, time and communication volume per algorithm."""
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    (x, y, per_rank), (x_test, y_test) = load_split(rank, size)
    steps_per_epoch = per_rank // args.batch
    torch.manual_seed(0)
    init = mlp(args.hidden).state_dict()
    results = {}
    for algorithm in args.algorithms.split(","):
        model = mlp(args.hidden)
        model.load_state_dict(init)
        opt = make_optimizer(model, algorithm, args.lr, args.warmup, args.threshold)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [args.decay_epoch], 0.1)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.barrier()
        lanes0, start = lane_bytes(), time.perf_counter()
        for epoch in range(args.epochs):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 * epoch + rank))
            for s in range(steps_per_epoch):
                batch = perm[s * args.batch:(s + 1) * args.batch]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
            sched.step()
        if hasattr(opt, "sync_weights"):
            opt.sync_weights()
        elapsed = time.perf_counter() - start
        digests = all_digests(model)
        assert len(set(digests)) == 1, f"{algorithm}: ranks differ at the end"
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        steps = args.epochs * steps_per_epoch
        entry = {"accuracy": accuracy, "seconds": elapsed, "steps": steps,
                 "lane_bytes_per_step": (lane_bytes() - lanes0) / steps}
        if hasattr(opt, "communication_stats"):
            stats = opt.communication_stats()
            entry.update({k + "_per_step": v / steps for k, v in stats.items()})
        else:  # fasthorovod.torch's SSGD: one average of every gradient per step
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            entry.update({"allreduce_bytes_per_step": nbytes, "allgather_bytes_per_step": 0})
        results[algorithm] = entry
        if rank == 0:
            print(f"{algorithm:10s} accuracy {accuracy * 100:6.2f}%  {elapsed:6.1f} s  "
                  f"{entry['allreduce_bytes_per_step'] + entry['allgather_bytes_per_step']:9.0f} B/step payload  "
                  f"{entry['lane_bytes_per_step']:9.0f} B/step on proxy lanes", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["identical", "digits"])
    parser.add_argument("--algorithms", default="ssgd,od-sgd,ssd-sgd,cd-sgd,local-sgd,ssgd-2bit")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--decay-epoch", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threshold", type=float, default=0.005)
    parser.add_argument("--out", default="digits.json")
    args = parser.parse_args()
    lanes.keep()
    hvd.init()
    try:
        globals()["scenario_" + args.scenario](args)
        lanes.report(hvd.rank(), hvd)
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    main()
