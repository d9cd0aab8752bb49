"""How the scheduler's policies talk to the other ranks: one small, injectable interface.

A policy never calls Horovod or the proxies itself; it asks its :class:`Communicator` for

* ``alloc(count, dtype)``: a flat buffer the transport can use without a copy (for the proxies:
  a persistent shared-memory buffer, so an allreduce of it is zero-copy);
* ``allreduce_async(tensors, name, op, prescale, postscale, wire)``: an in-place average (or sum)
  over all ranks of one tensor, or of several as one group, as a :class:`Handle` whose
  ``wait()`` returns the tensors; ``allreduce_average_async(tensor, name)`` is its common case;
* ``sparse_allreduce_async(tensor, name, op)``: a sparse gradient's average (or sum);
* ``in_place(dtype)`` and ``wire_for(compression, tensors, op)``: whether the transport reads
  ``alloc``'s buffers of a dtype in place, and whether it applies a compressor itself, on the
  wire (the proxies' float16), so that the policy hands over uncompressed tensors;
* ``allgather_packed_async(words, name)``: every rank's packed 2-bit payload, as a handle whose
  ``wait()`` returns an int32 tensor of shape ``(size, len(words))``, row r = rank r's words;
* ``broadcast_object(obj, name)``: rank 0's object;
* ``note(event, name, **fields)``: what a policy did, for an observer (the trace); optional.
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
from typing import Any, Callable, Sequence

import torch

AVERAGE, SUM = "average", "sum"  # the reductions a policy asks for


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

    def in_place(self, dtype: torch.dtype) -> bool:
        """Whether an allreduce of a buffer from :meth:`alloc` of `dtype` copies nothing."""
        return False

    def wire_for(self, compression: Any, tensors: Sequence[torch.Tensor], op: str = AVERAGE) -> Any:
        """What the transport puts on the wire in place of `compression` for `tensors` (passed on as
        ``allreduce_async(wire=...)``; the tensors then stay uncompressed), or None: the policy
        compresses them itself."""
        return None

    @abc.abstractmethod
    def allreduce_async(self, tensors: Sequence[torch.Tensor], name: str, op: str = AVERAGE,
                        prescale: float = 1.0, postscale: float = 1.0, wire: Any = None) -> Handle:
        """Starts ``t <- op over ranks of (prescale * t), times postscale`` for every tensor of
        `tensors` (in place; several tensors are one group); ``op`` is :data:`AVERAGE` or
        :data:`SUM`. wait() returns the tensors."""

    def allreduce_average_async(self, tensor: torch.Tensor, name: str) -> Handle:
        """Starts ``tensor <- average over ranks of tensor`` (in place); wait() returns `tensor`."""
        handle = self.allreduce_async([tensor], name)
        return Handle(lambda: handle.wait()[0])

    def sparse_allreduce_async(self, tensor: torch.Tensor, name: str, op: str = AVERAGE) -> Handle:
        """Starts reducing the sparse `tensor`; wait() returns the result (sparse or dense)."""
        raise NotImplementedError(f"{type(self).__name__} carries no sparse tensors")

    @abc.abstractmethod
    def allgather_packed_async(self, words: torch.Tensor, name: str) -> Handle:
        """Starts gathering every rank's int32 `words` (same length on every rank).

        wait() returns an int32 tensor of shape (size, len(words)); `words` must stay unchanged
        until then.
        """

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, name: str = "fasthorovod.scheduler.counters") -> Any:
        """Rank 0's `obj` on every rank (blocking)."""

    def note(self, event: str, name: str = "", **fields: Any) -> None:
        """A policy's event for an observer: ``gradient`` (a gradient was accumulated), ``posted``
        (a bucket of gradients was posted: `name`, ``bucket``), ``gradients_done`` (the step waits
        for its gradients now). The default observes nothing."""
