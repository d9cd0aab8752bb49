"""Posted collectives of a ProxyGroup: what ``wait()`` completes and where the results go."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from fasthorovod.proxy.buffers import LEND_MIN_BYTES, Buffer, copy_tensor

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def lends(nbytes: int, device: torch.device) -> bool:
    """Whether new outputs of `nbytes` together on `device` are lent from their buffer rather than
    copied out of it: on the CPU and at least LEND_MIN_BYTES (buffers.py)."""
    return device.type == "cpu" and nbytes >= LEND_MIN_BYTES


def lendable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether new outputs like `tensors` (staged together) are lent (:func:`lends`)."""
    return (all(t.device.type == "cpu" for t in tensors)
            and lends(sum(t.numel() * t.element_size() for t in tensors), torch.device("cpu")))


class Request:
    """One posted allreduce (possibly several tensors fused into one staging buffer). `outputs`
    None: new outputs shaped like `tensors`, lent from the staging buffer (``BufferPool.lend``)
    once done, in ``outputs``."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, staged: bool,
                 tensors: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]],
                 offsets: Sequence[int]) -> None:
        self._group = group
        self.ticket = ticket  # the negotiation's ticket (also the proxies' trace request number)
        self._buffer = buffer
        self._staged = staged
        self._tensors = tensors
        self._lent_shapes = [(t.dtype, tuple(t.shape)) for t in tensors] if outputs is None else None
        self._outputs = outputs
        self._offsets = offsets
        self._done = False
        self.outputs: List[torch.Tensor] = []  # the lent outputs, once wait() returned

    def poll(self) -> bool:
        return self._done or self._group.member.poll(self.ticket)

    def wait(self) -> None:
        """Blocks (GIL released) until done; copies results out (or lends them); raises
        FastHorovodError on failure."""
        if self._done:
            return
        try:
            self._group.member.wait(self.ticket, self._group.config.timeout_seconds)
        except BaseException:
            self._finish()
            raise
        if self._lent_shapes is not None:
            pieces = [(offset, dtype, shape) for (dtype, shape), offset in zip(self._lent_shapes, self._offsets)]
            self.outputs, self._staged = self._group.pool.lend(self._buffer, pieces), False  # the tensors own it now
        elif self._staged:
            self._copy_out()
        self._finish()

    def _copy_out(self) -> None:
        for out, offset in zip(self._outputs, self._offsets):
            copy_tensor(out.view(-1), self._buffer.view(out.dtype, offset, out.numel()))

    def _finish(self) -> None:
        self._done = True
        if self._staged:
            self._group.pool.release(self._buffer)
        self._tensors = self._outputs = ()


class GatherRequest(Request):
    """A posted allgather (ProxyGroup.allgather): on wait() the (size, n) output holds rank r's
    words in row r."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, output: torch.Tensor,
                 bounds: Optional[Sequence[int]]) -> None:
        super().__init__(group, ticket, buffer, True, (), (output,), (0,))
        self._bounds = bounds
        self.output = output  # (size, n); complete once wait() returned

    def _copy_out(self) -> None:
        (out,) = self._outputs
        size = out.shape[0]
        if self._bounds is None:  # summed rows (the hierarchical allreduce): row r is rank r's
            copy_tensor(out.view(-1), self._buffer.view(out.dtype, 0, out.numel()))
            return
        for begin, end in zip(self._bounds[:-1], self._bounds[1:]):
            # The lane's region holds size chunks of its columns; chunk c is rank c-1's (the ring's
            # allgather starts from chunk rank+1), so row r of the output is chunk r+1.
            chunks = self._buffer.view(out.dtype, size * begin * out.element_size(), size * (end - begin)).view(
                size, end - begin)
            for row in range(size):
                copy_tensor(out[row, begin:end], chunks[(row + 1) % size])
