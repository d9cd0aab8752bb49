"""An elastic training job (Horovod elastic API) for tests/multiproc/test_elastic.py,
tests/test_runner.py and benchmarks/elastic.py: a model whose large gradients go through the
proxies, ``hvd.elastic.run``, ``TorchState`` and ``ElasticSampler``.

The job trains until the world has gone through the sizes ``--sizes`` (e.g. ``3,2`` or ``4,3,4``)
and then ``--after`` more batches. The resizes come from outside (a host taken away on the
emulated cloud) or, with ``--hosts-file``, from the job itself: at batch ``--resize-at`` rank 0
rewrites the file that the discovery script prints (e.g. ``localhost:2`` instead of
``localhost:3``), once. Rank 0 prints ``STEP size S batch B time T`` after every step (T: wall
clock), and at the end every rank prints one line

    ELASTIC rank R size S batch B digest D planes [[epoch, size, collectives], ...]

where ``planes`` lists, per data plane this process used (one per hvd.init()), the world size and
how many collectives its proxies' lanes carried, followed by the lanes' counters of every data
plane (``FASTHOROVOD_LANES``, tests/workers/lanes.py) for the harness. After every hvd.init() (the first and each
reset's) every rank prints ``INIT rank R size S time T ...``: wall-clock marks of the process's
start-up (first one only) and, with FastHorovod, how long each step of the data plane's start-up
took (``describe()["startup_seconds"]``); ``READY`` when model, optimizer and state are built, and
``SYNCED`` when the state is synchronized (each entry to the elastic function). The digest is a hash of the parameters
(identical on every rank, or the job fails). ``ELASTIC_WORKER_HOROVOD=1`` runs the same job with
``import horovod.torch as hvd`` (the benchmark's peer).
"""
import time

SCRIPT_STARTED = time.time()

import argparse  # noqa: E402 (the clock above starts first)
import faulthandler
import hashlib
import os
import signal
import sys

import torch

if os.environ.get("ELASTIC_WORKER_HOROVOD") == "1":
    import horovod.torch as hvd
else:
    import fasthorovod.torch as hvd
IMPORTS_DONE = time.time()

import lanes  # noqa: E402 (tests/workers/, this script's directory)


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def make_optimizer(model, algorithm):
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if algorithm == "ssgd":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    options = {"warmup_steps": 3}
    if algorithm == "cd-sgd":
        options.update(threshold=0.01, correction_period=3)
    if algorithm == "ssd-sgd":
        options.update(period=2)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), algorithm=algorithm, **options)


def report_init(what: str) -> None:
    group = getattr(hvd, "proxy_group", lambda: None)()
    plane = f" plane {group.describe()['startup_seconds']}" if group is not None else ""
    print(f"INIT rank {hvd.rank()} size {hvd.size()} time {time.time():.3f} {what}{plane}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="world sizes to go through, e.g. 3,2 or 4,3,4")
    parser.add_argument("--hosts-file", help="resize by rewriting this file (what the discovery script prints)")
    parser.add_argument("--resize-to", help="the hosts file's new content, e.g. localhost:2")
    parser.add_argument("--resize-at", type=int, default=5)
    parser.add_argument("--model", choices=["mlp", "alexnet"], default="mlp",
                        help="alexnet: benchmarks/models.py at 32 px, batch 16 (61 M parameters)")
    parser.add_argument("--after", type=int, default=8)
    parser.add_argument("--commit-every", type=int, default=2)
    parser.add_argument("--algorithm", default="ssgd")
    parser.add_argument("--batch-sleep", type=float, default=0.2)
    parser.add_argument("--max-batches", type=int, default=200)
    parser.add_argument("--kill-proxy-at", type=int, default=-1,
                        help="at this batch rank 1 SIGKILLs one of its proxies (once): a failure on the proxy path")
    args = parser.parse_args()

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    lanes.keep()  # every data plane's counters, the ones elastic resets close too
    hvd.init()
    report_init(f"script {SCRIPT_STARTED:.3f} imports {IMPORTS_DONE:.3f}")
    torch.manual_seed(1234)
    if args.model == "alexnet":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
        from models import build_model
        model, shape, classes = build_model("alexnet"), (3, 32, 32), 1000
    else:
        # 1024 x 640 float32 weights: a 2.6 MB gradient, above the proxies' threshold
        model = torch.nn.Sequential(torch.nn.Linear(640, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        shape, classes = (640,), 10
    opt = make_optimizer(model, args.algorithm)
    dataset = list(range(4096))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, batch=0, sizes_seen=[hvd.size()], last_resize=0)
    planes = {}
    state.register_reset_callbacks([lambda: print(f"rank {hvd.rank()}: reset, size {hvd.size()}, batch {state.batch}",
                                                  flush=True), lambda: report_init("reset")])

    def note_plane():
        group = getattr(hvd, "proxy_group", lambda: None)()
        if group is None:
            return
        epoch = hvd.mpi_ops.epoch() if hasattr(hvd, "mpi_ops") else 0
        planes[epoch] = [epoch, hvd.size(), sum(s["collectives"] for s in group.lane_stats())]

    print(f"READY rank {hvd.rank()} time {time.time():.3f}", flush=True)  # model, optimizer, state built

    @hvd.elastic.run
    def train(state):
        print(f"SYNCED rank {hvd.rank()} time {time.time():.3f}", flush=True)  # state.sync() done
        while state.batch < args.max_batches:
            if hvd.size() != state.sizes_seen[-1]:
                state.sizes_seen = state.sizes_seen + [hvd.size()]
                state.last_resize = state.batch
            if state.sizes_seen == sizes and state.batch >= state.last_resize + args.after:
                return
            if (args.hosts_file and state.batch == args.resize_at and hvd.rank() == 0
                    and not os.path.exists(args.hosts_file + ".done")):
                with open(args.hosts_file + ".tmp", "w") as f:
                    f.write(args.resize_to + "\n")
                os.replace(args.hosts_file + ".tmp", args.hosts_file)
                open(args.hosts_file + ".done", "w").close()
                print(f"rank 0: hosts file now {args.resize_to!r} at batch {state.batch}", flush=True)
            if state.batch == args.kill_proxy_at and hvd.rank() == 1 and not os.path.exists(args.hosts_file + ".killed"):
                open(args.hosts_file + ".killed", "w").close()  # once, whatever resets follow
                victim = hvd.proxy_group().processes[0]
                os.kill(victim.pid, signal.SIGKILL)
                print(f"rank 1: killed proxy {victim.pid} at batch {state.batch}", flush=True)
            try:
                indices = list(iter(state.sampler))[:16]
                gen = torch.Generator().manual_seed(sum(indices) + 31 * state.batch)
                x = torch.randn(16, *shape, generator=gen)
                y = torch.randint(0, classes, (16,), generator=gen)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                note_plane()
                if hvd.rank() == 0:
                    print(f"STEP size {hvd.size()} batch {state.batch} time {time.time():.3f}", flush=True)
                state.sampler.record_batch(state.batch, 16)
                state.batch += 1
                time.sleep(args.batch_sleep)
                if state.batch % args.commit_every == 0:
                    state.commit()
            except hvd.HorovodInternalError as err:  # elastic restores and resets; say when it was seen
                print(f"FAILED rank {hvd.rank()} batch {state.batch} time {time.time():.3f}: "
                      f"{type(err).__name__}: {str(err)[:200]}", flush=True)
                raise

    train(state)
    if hasattr(opt, "sync_weights"):
        opt.sync_weights()
    note_plane()
    mine = digest(model)
    every = hvd.allgather_object(mine)
    if len(set(every)) != 1:
        print(f"rank {hvd.rank()}: ranks differ at the end: {every}", flush=True)
        return 1
    if hasattr(opt, "communication_stats") and hasattr(hvd, "proxy_group"):
        # The policy's collectives went through the lanes: 2(n-1)/n of what this rank allreduced,
        # the other ranks' rows of what it allgathered, with n the smallest world it trained in
        # (frame headers only add; tests/multiproc/harness.py ring_allreduce_bytes).
        stats, n = opt.communication_stats(), min(state.sizes_seen)
        least = 2 * (n - 1) / n * stats["allreduce_bytes"] + (n - 1) * stats["allgather_bytes"]
        sent = lanes.bytes_sent(hvd)
        if not sent >= least > 0:
            print(f"rank {hvd.rank()}: the lanes sent {sent} B, at least {least:.0f} B expected for {stats}", flush=True)
            return 1
    print(f"ELASTIC rank {hvd.rank()} size {hvd.size()} batch {state.batch} digest {mine} "
          f"planes {sorted(planes.values())}", flush=True)
    lanes.report(hvd.rank(), hvd)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
