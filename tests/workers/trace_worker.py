"""Trace workloads, run as Horovod ranks by tests/multiproc/test_trace.py (``trace_worker.py SCENARIO --dir DIR``).

clock      worker-side capture only (no proxies needed): start_trace with Horovod's barrier and
           allgather_object (clock offsets), three iterations of synthetic events, stop_trace.
allreduce  the whole trace (needs the data plane's capture points): FASTHOROVOD_TRACE_DIR makes
           hvd.init() start tracing in the worker and its proxies; named allreduces of known sizes,
           then a few DistributedOptimizer steps; each rank writes DIR/manifest.rank<R>.json with
           what it allreduced, the lane boundaries and the proxies' own byte counters, for the test
           to compare with the trace files.
"""
import argparse
import json
import os
import sys
import time

import torch

import fasthorovod.torch as hvd
from fasthorovod.trace import capture
from worker import run_scenario  # tests/workers/worker.py (this script's directory is on sys.path)

TENSORS = [  # (name, elements, dtype): element counts divisible by size·lanes for 2 ranks × 2 lanes
    ("trace.a", 400_000, torch.float32),
    ("trace.b", 262_144, torch.float64),
]
REPEATS = 2


def scenario_clock(args):
    rank, size = hvd.rank(), hvd.size()
    # The barrier estimator itself, without the same-host shortcut: the true offset here is 0.
    estimate = capture.estimate_clock_offset(rank, hvd.barrier, hvd.allgather_object, rounds=8,
                                             same_host_is_exact=False)
    tracer = capture.start_trace(args.dir, rank=rank, size=size, barrier=hvd.barrier,
                                 allgather_object=hvd.allgather_object, rounds=8,
                                 metadata={"barrier_estimate": list(estimate)})
    assert capture.tracer is tracer
    for step in range(3):
        with capture.span("compute"):
            time.sleep(0.005 * (1 + rank))  # rank 1 computes longer: it is the straggler
        capture.event("request", "g", bytes=1024)
        t0 = capture.now_ns()
        hvd.allreduce(torch.ones(16), name=f"clock.{step}")
        capture.complete("wait", "g", t0, capture.now_ns())
        with capture.span("update"):
            time.sleep(0.001)
        capture.next_step()
    path = capture.stop_trace()
    print(f"rank {rank}: clock ok, offset {tracer.clock_offset_ns} ns, wrote {path}", flush=True)


def scenario_allreduce(args):
    rank, size = hvd.rank(), hvd.size()
    group = hvd.proxy_group()
    assert group is not None, "proxies must be running"
    assert capture.tracer is not None, "FASTHOROVOD_TRACE_DIR must make hvd.init() start the trace"
    manifest = {"rank": rank, "size": size, "lanes": group.lanes, "tensors": []}
    for name, count, dtype in TENSORS:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        manifest["tensors"].append({"name": name, "count": count, "itemsize": itemsize,
                                    "bounds": group.lane_boundaries(count), "repeats": REPEATS})
    for _ in range(REPEATS):
        handles = [hvd.allreduce_async(torch.full((count,), float(rank + 1), dtype=dtype), op=hvd.Sum, name=name)
                   for name, count, dtype in TENSORS]
        for h, (name, count, dtype) in zip(handles, TENSORS):
            out = hvd.synchronize(h)
            assert torch.all(out == size * (size + 1) / 2), name

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(args.steps):
        opt.zero_grad()
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    manifest["lane_stats"] = group.lane_stats()
    with open(os.path.join(args.dir, f"manifest.rank{rank}.json"), "w") as f:
        json.dump(manifest, f)
    print(f"rank {rank}: allreduce trace ok", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["clock", "allreduce"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    run_scenario(globals(), parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
