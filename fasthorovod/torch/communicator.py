"""The scheduler's Communicator on FastHorovod's collectives (the facade hands it to the policies).

The scheduler (fasthorovod/scheduler) never imports this package; ``DistributedOptimizer`` here
builds a :class:`HorovodCommunicator` and passes it down. Large averages travel through the
proxies like any allreduce of ``fasthorovod.torch``; buffers come from the data plane's
:meth:`~fasthorovod.proxy.group.ProxyGroup.alloc`, so those averages copy nothing.

Packed 2-bit payloads go through exactly one function, :func:`allgather_packed`: the proxies'
ring allgather (each lane gathering its shard of the words), or Horovod's without proxies.
"""
from __future__ import annotations

from typing import Any

import torch
from horovod.torch import functions as _hvd_functions
from horovod.torch import mpi_ops as _hvd

from fasthorovod.scheduler.comm import Communicator, Handle
from fasthorovod.torch import mpi_ops


def allgather_packed(words: torch.Tensor, name: str) -> Handle:
    """The one path of packed 2-bit payloads between ranks: an allgather of int32 words.

    Returns a handle whose wait() gives the (size, len(words)) int32 tensor of every rank's words.
    With the proxies running it is their ring allgather, sharded over the lanes like an allreduce
    (each lane gathers its share of the columns over its own TCP connections); without them
    (FASTHOROVOD_NUM_PROXIES=0, one rank) Horovod's allgather.
    """
    group = mpi_ops.proxy_group()
    if group is not None:
        request = group.allgather(words, name)

        def finish():
            request.wait()
            return request.output
        return Handle(finish)
    handle = _hvd.allgather_async(words.view(1, -1), name=name)
    return Handle(lambda: mpi_ops.synchronize(handle))


class HorovodCommunicator(Communicator):
    """FastHorovod's collectives on the global process set. Building one is free; ``rank`` and
    ``size`` (and every collective) need ``hvd.init()``."""

    @property
    def rank(self) -> int:
        return _hvd.rank()

    @property
    def size(self) -> int:
        return _hvd.size()

    @property
    def epoch(self) -> int:
        return mpi_ops.epoch()

    def alloc(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        group = mpi_ops.proxy_group()
        if group is None or not group.supports(dtype):
            return torch.zeros(count, dtype=dtype)
        return group.alloc(count, dtype)

    def allreduce_average_async(self, tensor: torch.Tensor, name: str) -> Handle:
        handle = mpi_ops.allreduce_async_(tensor, name=name, op=_hvd.Average)
        return Handle(lambda: mpi_ops.synchronize(handle))

    def allgather_packed_async(self, words: torch.Tensor, name: str) -> Handle:
        return allgather_packed(words, name)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return _hvd_functions.broadcast_object(obj, root_rank=root_rank, name="fasthorovod.scheduler.counters")
