"""The CUDA-tensor checks, run as Horovod ranks: ``scripts/cuda_check.sh`` starts two.

Each check runs FastHorovod on tensors of ``--device`` (cuda on a GPU machine; cpu runs the same
checks anywhere) and compares with Horovod's own result for the same values on the CPU (Horovod as
the project installs it is a CPU build): allreduce (sum, average, in place, grouped, float16),
broadcast (in place and out of place, every bit of NaN payloads, infinities and -0.0 kept) and
DistributedOptimizer steps of a small model. Integer-valued data makes every sum exact in any
order; the optimizer's fp32 results are compared within 1e-5 (the ring adds in another order than
Horovod's). Every tensor is large enough for the proxies, and the lanes' counters must show that
they carried it. Prints one ``CUDA CHECK`` line per check and rank; exits non-zero on the first
wrong value.
"""
import argparse
import sys

import torch

import fasthorovod.torch as hvd
import horovod.torch as horovod

COUNT = 1 << 20  # 4 MiB of float32: above the proxies' threshold on one host (8 MiB) only with cuda_check.sh's 0


def lanes_ran() -> int:
    """Collectives this rank's lanes ran (over TCP, or through shared memory on one host)."""
    group = hvd.proxy_group()
    return sum(lane["collectives"] for lane in group.lane_stats()) if group is not None else 0


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"CUDA CHECK rank {hvd.rank()} {name}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def values(count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers, different on every rank: exact sums in float16 too."""
    g = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    return torch.randint(-8, 8, (count,), generator=g).to(dtype)


def through_the_proxies(name: str, run) -> None:
    """Runs `run`, checking that this rank's lanes ran collectives while it did."""
    before = lanes_ran()
    run()
    check(f"{name} went through the proxies", lanes_ran() > before, f"({lanes_ran() - before} collectives)")


def check_allreduce(device: str) -> None:
    for dtype in (torch.float32, torch.float16):
        x = values(COUNT, dtype, 1)
        expected = horovod.allreduce(x, op=horovod.Sum, name=f"ref.sum.{dtype}")

        def run():
            out = hvd.allreduce(x.to(device), op=hvd.Sum, name=f"sum.{dtype}")
            check(f"allreduce sum {dtype}", out.device.type == device and torch.equal(out.cpu(), expected))
            avg = hvd.allreduce(x.to(device), op=hvd.Average, name=f"avg.{dtype}")
            ref = horovod.allreduce(x, op=horovod.Average, name=f"ref.avg.{dtype}")
            check(f"allreduce average {dtype}", torch.allclose(avg.cpu().float(), ref.float(), atol=1e-3))
            y = x.to(device)
            hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{dtype}")
            check(f"allreduce_ in place {dtype}", y.device.type == device and torch.equal(y.cpu(), expected))
        through_the_proxies(f"allreduce {dtype}", run)
    group = [values(COUNT + i, torch.float32, 2 + i) for i in range(3)]
    refs = horovod.grouped_allreduce(group, op=horovod.Sum, name="ref.grouped")
    outs = hvd.grouped_allreduce([t.to(device) for t in group], op=hvd.Sum, name="grouped")
    check("grouped_allreduce", all(torch.equal(o.cpu(), r) for o, r in zip(outs, refs)))


def check_broadcast(device: str) -> None:
    special = values(COUNT, torch.float32, 5)
    special[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    special.view(torch.int32)[4] = 0x7FC00123  # a NaN with a payload
    root = hvd.size() - 1
    expected = horovod.broadcast(special, root_rank=root, name="ref.bcast")

    def run():
        t = (special if hvd.rank() == root else torch.zeros_like(special)).to(device)
        hvd.broadcast_(t, root_rank=root, name="bcast.inplace")
        check("broadcast_ in place, bit-exact",
              t.device.type == device and torch.equal(t.cpu().view(torch.int32), expected.view(torch.int32)))
        out = hvd.broadcast(special.to(device), root_rank=root, name="bcast")
        check("broadcast out of place, bit-exact", torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32)))
    through_the_proxies("broadcast", run)


def train(api, device: str, steps: int = 5) -> torch.Tensor:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).to(device)
    opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=api.Average)
    api.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(64, 256, generator=data).to(device)
        y = torch.randint(0, 16, (64,), generator=data).to(device)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def check_optimizer(device: str) -> None:
    reference = train(horovod, "cpu")
    result = {}
    through_the_proxies("DistributedOptimizer", lambda: result.setdefault("ours", train(hvd, device)))
    diff = (result["ours"] - reference).abs().max().item()
    check("DistributedOptimizer matches Horovod's", diff <= 1e-5, f"(max |difference| {diff:.2g})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args().device
    if device == "cuda" and not torch.cuda.is_available():
        print("CUDA CHECK skipped: torch sees no CUDA device", flush=True)
        return 0
    hvd.init()
    try:
        if device == "cuda":
            torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        check_allreduce(device)
        check_broadcast(device)
        check_optimizer(device)
        print(f"CUDA CHECK rank {hvd.rank()}: all ok on {device}", flush=True)
    finally:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
