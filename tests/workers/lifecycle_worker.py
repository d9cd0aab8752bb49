"""Lifecycle workloads, run as Horovod ranks by tests/multiproc/test_lifecycle.py.

``thread_init``: hvd.init() from a thread that then exits; the proxies must survive it and carry an
allreduce. Then rank 1 SIGKILLs one of its proxies: the worker must reap it (no zombie) within a
second without being asked (no collective in between), and every rank's next allreduce raises.
With --deny-pidfd the ranks run as on Linux < 5.3 (pidfd_open fails, here by a seccomp filter
that the proxies inherit), so every watch takes its fallback.

``big_then_shutdown``: a verified 256 MiB allreduce (run by the test under a 64 MiB /dev/shm),
then hvd.shutdown() while a second 256 MiB allreduce is in flight (held there by a stopped proxy of
rank 0's): it must return promptly (under 2 s; 0.05-0.35 s here), with every proxy gone. Each rank prints one line the test parses.

``slow_joiner``: the last rank joins the negotiation --delay seconds after the others (as a rank
starved of CPU would); every rank restarts its data plane right after hvd.init() and then runs an
allreduce through the proxies. hvd.init() is a barrier for the data plane: a rank that went on
first would stop its half of it while the slow rank is still joining.
"""
import argparse
import os
import signal
import sys
import threading
import time

import torch

import fasthorovod.torch as hvd
from fasthorovod.proxy import group as group_module
import lanes  # tests/workers/, this script's directory
from file_barrier import file_barrier


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _exists(pid: int) -> bool:
    """Still in the process table (a zombie counts: it has not been reaped)."""
    return os.path.exists(f"/proc/{pid}")


def thread_init(args) -> None:
    if args.deny_pidfd:
        import fasthorovod_testing

        fasthorovod_testing.deny_pidfd_open()
    t = threading.Thread(target=hvd.init)
    t.start()
    t.join()  # the thread that spawned the proxies is gone
    time.sleep(0.5)  # PR_SET_PDEATHSIG would have ended them by now
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    assert group.channel.uses_pidfds is not args.deny_pidfd, group.channel.uses_pidfds
    pids = [p.pid for p in group.processes]
    assert all(_alive(p) for p in pids), f"rank {rank}: proxies died with the thread that started them"
    x = torch.full((1 << 20,), float(rank + 1))  # 4 MiB: through the proxies
    out = hvd.allreduce(x, op=hvd.Sum, name="after.thread")
    assert torch.all(out == size * (size + 1) / 2), out[:4]
    assert all(s["collectives"] > 0 for s in group.lane_stats()), "the allreduce must have used the proxies"

    hvd.barrier()
    reaped_after = None
    if rank == 1:
        victim = pids[0]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while _exists(victim) and time.monotonic() - killed < 5:
            time.sleep(0.005)
        reaped_after = time.monotonic() - killed
        assert not _exists(victim), f"rank 1: the killed proxy {victim} was not reaped within 5 s"
    hvd.barrier()
    try:
        hvd.allreduce(x, op=hvd.Sum, name="after.kill")
        raise AssertionError(f"rank {rank}: an allreduce after a proxy died must raise")
    except hvd.FastHorovodError as e:
        if rank == 1:
            assert type(e).__name__ == "ProxyDiedError" and "killed by signal 9" in str(e), repr(e)
        error = type(e).__name__
    started = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - started
    assert not any(_exists(p) for p in pids), f"rank {rank}: proxies left after shutdown"
    reaped = "" if reaped_after is None else f"; killed proxy reaped after {reaped_after * 1000:.0f} ms"
    print(f"LIFECYCLE rank {rank}: thread init ok (pidfds {not args.deny_pidfd}); raised {error}; "
          f"shutdown {took:.2f} s{reaped}", flush=True)
    lanes.report(rank)


def big_then_shutdown(args) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shm = os.statvfs("/dev/shm")
    shm_bytes = shm.f_blocks * shm.f_frsize
    count = args.mbytes * (1 << 20) // 4
    x = (torch.arange(count, dtype=torch.int32) % 7 + rank).to(torch.float32)  # exact in float32
    started = time.monotonic()
    out = hvd.allreduce(x, op=hvd.Sum, name="big")
    seconds = time.monotonic() - started
    expected = (torch.arange(count, dtype=torch.int32) % 7 * size + size * (size - 1) // 2).to(torch.float32)
    assert torch.equal(out, expected), f"rank {rank}: wrong result of the {args.mbytes} MiB allreduce"
    del out, expected
    group = hvd.proxy_group()
    pids = [p.pid for p in group.processes]
    hvd.barrier()
    # Keep the second allreduce in flight however the ranks are scheduled: rank 0 stops one of its
    # own proxies before submitting, so the ring cannot finish on any rank. Each rank polls once,
    # says so in a file in --sync-dir, and shuts down only when every rank has: a rank that shut
    # down before another had polled would fail that one's allreduce, no longer in flight.
    if rank == 0:
        os.kill(pids[0], signal.SIGSTOP)
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="big.in.flight")
    in_flight = not hvd.poll(handle)
    file_barrier(args.sync_dir, "polled", rank, size)
    started = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - started
    gone = not any(os.path.exists(f"/proc/{p}") for p in pids)
    print(f"BIG rank {rank}: {args.mbytes} MiB allreduce correct in {seconds:.2f} s with a "
          f"{shm_bytes >> 20} MiB /dev/shm; shutdown with it in flight ({in_flight}) took {took:.3f} s; "
          f"proxies gone {gone}", flush=True)
    lanes.report(rank)


def slow_joiner(args) -> None:
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    real_member = group_module._C.Member
    if rank == size - 1:
        def late_member(*member_args):
            time.sleep(args.delay)
            return real_member(*member_args)
        group_module._C.Member = late_member
    started = time.monotonic()
    hvd.init()
    init_s = time.monotonic() - started
    group_module._C.Member = real_member
    model = torch.nn.Linear(1024, 1024)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    hvd.restart_proxies()
    out = hvd.allreduce(torch.ones(1 << 20), op=hvd.Sum, name="after.slow.joiner")  # 4 MiB: the proxies
    assert torch.all(out == size), f"rank {rank}: wrong result"
    opt.zero_grad()
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    flat = opt._policy._buckets[0].flat  # the optimizer's gradients moved into the new data plane's memory
    assert hvd.proxy_group().pool.locate(flat) is not None, f"rank {rank}: the bucket stayed behind"
    assert torch.all(model.bias.grad == 2.0), f"rank {rank}: wrong gradient after the restart"
    print(f"SLOW rank {rank}: init took {init_s:.2f} s, restart, allreduce and optimizer ok", flush=True)
    hvd.shutdown()
    lanes.report(rank)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["thread_init", "big_then_shutdown", "slow_joiner"])
    parser.add_argument("--deny-pidfd", action="store_true")
    parser.add_argument("--mbytes", type=int, default=256)
    parser.add_argument("--delay", type=float, default=3.0)
    parser.add_argument("--sync-dir", default=None, help="big_then_shutdown: a directory every rank can write")
    args = parser.parse_args()
    lanes.keep()  # each scenario shuts its data planes down itself, then reports their lane counters
    {"thread_init": thread_init, "big_then_shutdown": big_then_shutdown,
     "slow_joiner": slow_joiner}[args.scenario](args)


if __name__ == "__main__":
    sys.exit(main())
