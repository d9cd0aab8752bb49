"""The scheduler's Communicator on FastHorovod's collectives (the facade hands it to the policies).

The scheduler (fasthorovod/scheduler) never imports this package; ``DistributedOptimizer`` here
builds a :class:`HorovodCommunicator` and passes it down. Large averages travel through the
proxies like any allreduce of ``fasthorovod.torch``; buffers come from the data plane's
:meth:`~fasthorovod.proxy.group.ProxyGroup.alloc`, so those averages copy nothing.

Packed 2-bit payloads go through exactly one function, :func:`allgather_packed`: the proxies'
ring allgather (each lane gathering its shard of the words), or Horovod's without proxies.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from horovod.common.process_sets import global_process_set
from horovod.torch import functions as _hvd_functions
from horovod.torch import mpi_ops as _hvd

from fasthorovod.scheduler.comm import AVERAGE, SUM, Communicator, Handle
from fasthorovod.torch import mpi_ops
from fasthorovod.torch.trace_hooks import compute_spans
from fasthorovod.trace import capture as _trace

_OPS = {AVERAGE: _hvd.Average, SUM: _hvd.Sum}


def allgather_packed(words: torch.Tensor, name: str) -> Handle:
    """The one path of packed 2-bit payloads between ranks: an allgather of int32 words.

    Returns a handle whose wait() gives the (size, len(words)) int32 tensor of every rank's words.
    With the proxies running it is their ring allgather, sharded over the lanes like an allreduce
    (each lane gathers its share of the columns over its own TCP connections); without them
    (FASTHOROVOD_NUM_LANES=0, one rank) Horovod's allgather.
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

    def in_place(self, dtype: torch.dtype) -> bool:
        group = mpi_ops.proxy_group()
        return group is not None and group.supports(dtype)

    def wire_for(self, compression: Any, tensors: Sequence[torch.Tensor], op: str = AVERAGE) -> Any:
        return mpi_ops.wire_for(compression, tensors, _OPS[op])

    def allreduce_async(self, tensors: Sequence[torch.Tensor], name: str, op: str = AVERAGE,
                        prescale: float = 1.0, postscale: float = 1.0, wire: Any = None) -> Handle:
        if len(tensors) == 1:
            (tensor,) = tensors
            handle = mpi_ops._allreduce_async(tensor, tensor, name, _OPS[op], prescale, postscale,
                                              global_process_set, wire)
            return Handle(lambda: [mpi_ops.synchronize(handle)])
        handle = mpi_ops._grouped_allreduce_async(list(tensors), list(tensors), name, _OPS[op], prescale, postscale,
                                                  global_process_set, wire)
        return Handle(lambda: list(mpi_ops.synchronize(handle)))

    def sparse_allreduce_async(self, tensor: torch.Tensor, name: str, op: str = AVERAGE) -> Handle:
        return Handle(_hvd.sparse_allreduce_async(tensor, name=name, op=_OPS[op], process_set=global_process_set))

    def allgather_packed_async(self, words: torch.Tensor, name: str) -> Handle:
        return allgather_packed(words, name)

    def broadcast_object(self, obj: Any, name: str = "fasthorovod.scheduler.counters") -> Any:
        return _hvd_functions.broadcast_object(obj, root_rank=0, name=name)

    def note(self, event: str, name: str = "", **fields: Any) -> None:
        """The policies' events, into the DLC trace while one runs (docs/trace.md)."""
        tracer = _trace.tracer
        if tracer is None:
            return
        if event == "gradient":
            compute_spans.gradient_ready()
        elif event == "posted":
            tracer.event("grad_ready", name, **fields)
        elif event == "gradients_done":
            compute_spans.gradients_done()
