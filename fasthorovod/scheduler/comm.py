"""How the scheduler's policies talk to the other ranks: one small, injectable interface.

A policy never calls Horovod or the proxies itself; it asks its :class:`Communicator` for

* ``alloc(count, dtype)``: a flat buffer the transport can use without a copy (for the proxies:
  a persistent shared-memory buffer, so an allreduce of it is zero-copy);
* ``allreduce_average_async(tensor, name)``: an in-place average over all ranks, as a
  :class:`Handle` whose ``wait()`` returns the tensor;
* ``allgather_packed_async(words, name)``: every rank's packed 2-bit payload, as a handle whose
  ``wait()`` returns an int32 tensor of shape ``(size, len(words))``, row r = rank r's words;
* ``broadcast_object(obj)``: rank 0's object;
* ``new_scope()``: a number that keeps the collective names of several optimizers apart.

:class:`HorovodCommunicator` implements it with FastHorovod's collectives (large averages travel
through the proxies). Unit tests inject a fake world of ranks instead (tests/unit/test_scheduler.py).

The packed allgather goes through exactly one function, :func:`_allgather_packed`: the proxies'
ring allgather (each lane gathering its shard of the words), or Horovod's without proxies.
"""
from __future__ import annotations

import abc
import itertools
from typing import Any, Callable

import torch


class Handle:
    """An operation in flight: ``wait()`` blocks until it is done and returns its result (once)."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        self._wait = wait
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            self._result = self._wait()
            self._done = True
            self._wait = None
        return self._result


class Communicator(abc.ABC):
    """The collectives a policy needs (see the module docstring)."""

    rank: int = 0
    size: int = 1
    _scopes = itertools.count()

    def new_scope(self) -> int:
        """A number for a new optimizer's collective names: the same on every rank as long as every
        rank constructs its optimizers in the same order (one counter per process)."""
        return next(Communicator._scopes)

    def alloc(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat buffer of `count` elements that the transport reads and writes in place."""
        return torch.zeros(count, dtype=dtype)

    @abc.abstractmethod
    def allreduce_average_async(self, tensor: torch.Tensor, name: str) -> Handle:
        """Starts ``tensor <- average over ranks of tensor`` (in place); wait() returns `tensor`."""

    @abc.abstractmethod
    def allgather_packed_async(self, words: torch.Tensor, name: str) -> Handle:
        """Starts gathering every rank's int32 `words` (same length on every rank).

        wait() returns an int32 tensor of shape (size, len(words)); `words` must stay unchanged
        until then.
        """

    @abc.abstractmethod
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (blocking)."""


def _allgather_packed(words: torch.Tensor, name: str) -> Handle:
    """The one path of packed 2-bit payloads between ranks: an allgather of int32 words.

    Returns a handle whose wait() gives the (size, len(words)) int32 tensor of every rank's words.
    With the proxies running it is their ring allgather, sharded over the lanes like an allreduce
    (each lane gathers its share of the columns over its own TCP connections); without them
    (FASTHOROVOD_NUM_PROXIES=0, one rank) Horovod's allgather.
    """
    from fasthorovod.torch import allgather_async, mpi_ops, synchronize

    group = mpi_ops.proxy_group()
    if group is not None:
        request = group.allgather(words, name)

        def finish():
            request.wait()
            return request.output
        return Handle(finish)
    handle = allgather_async(words.view(1, -1), name=name)
    return Handle(lambda: synchronize(handle))


class HorovodCommunicator(Communicator):
    """FastHorovod's collectives on the global process set (``hvd.init()`` must have run)."""

    def __init__(self) -> None:
        import fasthorovod.torch as hvd
        from fasthorovod.torch import mpi_ops

        self._mpi_ops = mpi_ops
        self.rank = hvd.rank()
        self.size = hvd.size()

    def alloc(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        from fasthorovod.proxy.group import DTYPE_CODES

        group = self._mpi_ops.proxy_group()
        if group is None or dtype not in DTYPE_CODES or count == 0:
            return torch.zeros(count, dtype=dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        buf = group.pool.register(count * itemsize).view(dtype, 0, count)
        buf.zero_()
        return buf

    def allreduce_average_async(self, tensor: torch.Tensor, name: str) -> Handle:
        mpi_ops = self._mpi_ops
        handle = mpi_ops.allreduce_async_(tensor, name=name, op=mpi_ops.Average)
        return Handle(lambda: mpi_ops.synchronize(handle))

    def allgather_packed_async(self, words: torch.Tensor, name: str) -> Handle:
        return _allgather_packed(words, name)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        from fasthorovod.torch import broadcast_object

        return broadcast_object(obj, root_rank=root_rank, name="fasthorovod.scheduler.counters")
