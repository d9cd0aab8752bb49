"""The proxies' reduce-scatter (Horovod's ``reducescatter``), posted through a ProxyGroup's one
submit path (``ProxyGroup._submit``).

Horovod gives rank r rows [o_r, o_r + n_r) of the reduced tensor's first dimension, the first
``dim0 % size`` ranks one row more than the others. Each rank lays the whole input out as an
allgather's rows (gather.py): row r holds what rank r receives, padded with zeros to the largest
share, and sits in the ring chunk that rank r holds reduced once the reduce-scatter phase is over
(``_C.allgather_own_chunk``); lane j carries equal shares of every row's width. The ring then
runs its reduce-scatter phase only (OP_REDUCESCATTER), half an allreduce's traffic, and each rank
copies its own row out. Several tensors (``grouped_reducescatter``) lie side by side in each row,
so they travel as one collective.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from fasthorovod import _C
from fasthorovod.proxy.buffers import Buffer, copy_tensor, zero_tensor
from fasthorovod.proxy.core import DTYPE_CODES, OP_REDUCESCATTER, WIRE_CODES
from fasthorovod.proxy.requests import Request

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def shares(rows: int, size: int) -> List[int]:
    """Horovod's split of `rows` over `size` ranks: rows // size each, one more for the first
    rows % size ranks."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


class Layout:
    """Where each tensor's rows for each rank lie in a row of the staging buffer.

    Rank r's row is ``width`` elements: tensor t's part of it starts at column ``columns[t]`` and
    is ``padded[t]`` elements (its largest share of rows times its row size), of which rank r's
    rows fill the first ``shares[t][r] * row_elems[t]``. Lane j carries columns ``bounds[j]`` to
    ``bounds[j+1]`` of every row; in the buffer, lane j's region starts at ``size * bounds[j]``
    and holds one chunk per rank, rank r's in chunk ``(r + 1) % size``.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], size: int, lanes: int) -> None:
        self.size = size
        self.row_elems = [math.prod(t.shape[1:]) for t in tensors]
        self.shares = [shares(t.shape[0], size) for t in tensors]
        self.padded = [s[0] * e for s, e in zip(self.shares, self.row_elems)]
        self.columns = [sum(self.padded[:i]) for i in range(len(tensors))]
        self.width = sum(self.padded)
        self.bounds = _C.shard_boundaries(self.width, [1.0] * lanes)
        self.padding = any(s[0] != s[-1] for s in self.shares)

    def pieces(self, t: int, rank: int) -> List[Tuple[int, int, int]]:
        """(element offset in the buffer, element offset in rank `rank`'s rows of tensor t, count)
        for each lane's piece of those rows."""
        begin = self.columns[t]
        end = begin + self.shares[t][rank] * self.row_elems[t]
        chunk = (rank + 1) % self.size
        out = []
        for lo, hi in zip(self.bounds[:-1], self.bounds[1:]):
            a, b = max(lo, begin), min(hi, end)
            if a < b:
                out.append((self.size * lo + chunk * (hi - lo) + (a - lo), a - begin, b - a))
        return out

    def first_row(self, t: int, rank: int) -> int:
        return sum(self.shares[t][:rank])


class ScatterRequest(Request):
    """A posted reduce-scatter: on wait() each output holds this rank's rows of its tensor."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, outputs: Sequence[torch.Tensor],
                 layout: Layout) -> None:
        super().__init__(group, ticket, buffer, True, (), outputs, ())
        self._layout = layout
        self.outputs = list(outputs)  # this rank's rows of each tensor; complete once wait() returned

    def _copy_out(self) -> None:
        layout, dtype = self._layout, self._outputs[0].dtype
        rows_out(layout, self._buffer.view(dtype, 0, layout.size * layout.width), self._outputs, self._group.rank)


def rows_in(layout: Layout, tensors: Sequence[torch.Tensor], staged: torch.Tensor) -> None:
    """Lays every rank's rows of `tensors` out in `staged` (``size * width`` elements)."""
    if layout.padding:
        zero_tensor(staged)
    for t, x in enumerate(tensors):
        flat = x.reshape(-1)  # Horovod takes non-contiguous inputs too: a copy then
        for r in range(layout.size):
            base = layout.first_row(t, r) * layout.row_elems[t]
            for at, offset, count in layout.pieces(t, r):
                copy_tensor(staged[at:at + count], flat[base + offset:base + offset + count])


def rows_out(layout: Layout, staged: torch.Tensor, outputs: Sequence[torch.Tensor], rank: int) -> None:
    """Copies rank `rank`'s rows of each tensor from `staged` into `outputs`."""
    for t, out in enumerate(outputs):
        flat = out.view(-1)
        for at, offset, count in layout.pieces(t, rank):
            copy_tensor(flat[offset:offset + count], staged[at:at + count])


def post(group: "ProxyGroup", tensors: Sequence[torch.Tensor], name: str, average: bool, prescale: float,
         postscale: float, wire: Optional[torch.dtype] = None) -> ScatterRequest:
    """Posts the reduce-scatter of `tensors` (one dtype, at least one dimension each, the same
    shapes on every rank; CPU or CUDA); the request's outputs are this rank's rows of each."""
    dtype = tensors[0].dtype
    if any(t.dim() == 0 or t.dtype != dtype for t in tensors) or dtype not in DTYPE_CODES:
        raise ValueError("a reduce-scatter takes tensors of one supported dtype with at least one dimension, got "
                         + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))
    n, rank = group.size, group.rank
    layout = Layout(tensors, n, group.lanes)
    itemsize = tensors[0].element_size()
    outputs = [torch.empty((layout.shares[t][rank],) + tuple(x.shape[1:]), dtype=dtype, device=x.device)
               for t, x in enumerate(tensors)]
    buffer = group.pool.acquire(max(1, n * layout.width * itemsize))
    with group._releasing_on_failure(buffer):
        rows_in(layout, tensors, buffer.view(dtype, 0, n * layout.width))
        description = ";".join(",".join(map(str, x.shape)) for x in tensors)
        ticket = group._submit(buffer, name, description, sum(x.numel() for x in tensors) * itemsize,
                               buffer_offset=0, count=n * layout.width,
                               dtype=DTYPE_CODES[dtype] if wire is None else WIRE_CODES[(dtype, wire)],
                               op=OP_REDUCESCATTER, prescale=prescale,
                               postscale=postscale / n if average else postscale)
    return ScatterRequest(group, ticket, buffer, outputs, layout)
