"""A Horovod program that knows nothing of FastHorovod (it imports horovod.torch), for the patch
switch's test (tests/test_patch.py): run under ``fasthorovodrun --patch-horovod`` its module is
fasthorovod.torch, and its large allreduce and its optimizer's buckets go through the proxies."""
import sys

import torch

import horovod.torch as hvd

hvd.init()
x = hvd.allreduce(torch.full((1 << 20,), float(hvd.rank() + 1)), op=hvd.Sum, name="plain.big")
assert torch.all(x == hvd.size() * (hvd.size() + 1) / 2), x[:4]
model = torch.nn.Linear(1000, 1000)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
model(torch.randn(4, 1000)).sum().backward()
optimizer.step()
lanes = getattr(hvd, "proxy_group", lambda: None)()  # None under Horovod itself
counts = [lane["collectives"] for lane in lanes.lane_stats()] if lanes else None
sys.stdout.write(f"rank {hvd.rank()}: module {hvd.__name__}, proxy collectives {counts}\n")  # one write: one line
sys.stdout.flush()
hvd.shutdown()
