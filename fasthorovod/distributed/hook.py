"""``allreduce_hook``: a DistributedDataParallel communication hook for programs whose process group
stays Gloo's (or any other): DDP's large buckets are averaged through FastHorovod's proxies, the
others through the model's process group, as DDP's own hook does.

    import fasthorovod.distributed
    ddp.register_comm_hook(None, fasthorovod.distributed.allreduce_hook)

The proxies start at the first bucket, over the default group's store (collective: DDP's first
backward pass runs on every rank), unless this process already runs the ``fasthorovod`` backend,
whose proxies it then shares; their waits are bounded by FASTHOROVOD_TIMEOUT_SECONDS, or else by
torch's default process-group timeout. They stop at interpreter exit. The hook's `state` is the process group for the small buckets (None:
the default group).
"""
import collections
import threading
from typing import Dict, Optional

import torch
import torch.distributed as dist

from fasthorovod.distributed import backend

_lock = threading.Lock()
_completions = backend.Completions()
_rounds: Dict[int, int] = collections.defaultdict(int)  # bucket index -> the allreduces it posted


def _proxies():
    """The proxies of this process: the backend's, or the hook's own, started once."""
    with _lock:
        if not backend._running:  # waits bounded by FASTHOROVOD_TIMEOUT_SECONDS, else torch's default
            backend.start_proxies(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(),
                                  dist.distributed_c10d.default_pg_timeout)
        return backend._running[0] if backend._running else None


# (DDP checks the annotations themselves: real objects, not strings)
def allreduce_hook(state: Optional[dist.ProcessGroup], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages DDP's `bucket` over the ranks: through the proxies when it holds at least their
    threshold of a dtype they carry, else through `state` (a process group; None: the default
    one). DDP calls it for every bucket, in the same order on every rank."""
    tensor = bucket.buffer()
    group = state if state is not None else dist.group.WORLD
    proxies = _proxies()
    if (proxies is not None and proxies.supports(tensor.dtype) and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= proxies.plan.threshold_bytes):
        index = bucket.index()
        with _lock:
            name = f"ddp.bucket{index}.{_rounds[index]}"  # the same on every rank whatever the order
            _rounds[index] += 1
        request = proxies.allreduce([tensor], [tensor], name, True, 1.0, 1.0)
        return _completions.complete(name, request, None, tensor, proxies.config.timeout_seconds)
    size = dist.get_world_size(group)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0].div_(size))
