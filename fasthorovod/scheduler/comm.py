"""How the scheduler's policies talk to the other ranks: one small, injectable interface.

A policy never calls Horovod or the proxies itself; it asks its :class:`Communicator` for

* ``alloc(count, dtype)``: a flat buffer the transport can use without a copy (for the proxies:
  a persistent shared-memory buffer, so an allreduce of it is zero-copy);
* ``allreduce_average_async(tensor, name)``: an in-place average over all ranks, as a
  :class:`Handle` whose ``wait()`` returns the tensor;
* ``allgather_packed_async(words, name)``: every rank's packed 2-bit payload, as a handle whose
  ``wait()`` returns an int32 tensor of shape ``(size, len(words))``, row r = rank r's words;
* ``broadcast_object(obj)``: rank 0's object;
* ``new_scope()``: a number that keeps the collective names of several optimizers apart;
* ``epoch``: a number that changes when the transport is replaced (Horovod elastic's reset).

:class:`fasthorovod.torch.communicator.HorovodCommunicator` implements it with FastHorovod's
collectives (large averages travel through the proxies) and ``fasthorovod.torch``'s
``DistributedOptimizer`` passes it in; this package never imports ``fasthorovod.torch`` (nor
Horovod): the layers point down only. Unit tests inject a fake world of ranks instead
(tests/unit/test_scheduler.py).
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
    #: Changes whenever the transport was replaced (an elastic reset): buffers from ``alloc`` and
    #: operations started before belong to the old one.
    epoch: int = 0
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
