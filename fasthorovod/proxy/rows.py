"""Rows per rank: how a reduce-scatter's and an allgather's tensors lie in a ring's staging buffer.

Both collectives exchange, for every tensor, a number of rows per rank: Horovod's split of the
first dimension for a reduce-scatter (scatter.py), each rank's own first dimension for an
allgather (gather.py). The buffer holds one row of ``width`` elements per rank: tensor t's part
starts at column ``columns[t]`` and is padded to its largest share, so every rank's row has the
same width and the ring's chunks stay equal. Rank r's row sits in the ring chunk that rank r holds
complete when a reduce-scatter phase ends, and that an allgather phase starts from
(``_C.allgather_own_chunk``: chunk ``(r + 1) % size``); lane j carries columns ``bounds[j]`` to
``bounds[j+1]`` of every row, equal shares of the width (``_C.shard_boundaries``, which the
coordinator applies to such collectives whatever the lane weights). :class:`RowsOut` is either
collective once posted: its outputs are filled from the buffer when it completes.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Sequence, Tuple

import torch

from fasthorovod import _C
from fasthorovod.proxy.buffers import Buffer, copy_tensor, zero_tensor
from fasthorovod.proxy.requests import Request

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def shares(rows: int, size: int) -> List[int]:
    """Horovod's split of `rows` over `size` ranks: rows // size each, one more for the first
    rows % size ranks."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


class Layout:
    """Where each tensor's rows for each rank lie in the staging buffer (``size * width`` elements).

    `row_elems[t]`: elements in one row of tensor t (its shape without the first dimension);
    `counts[t][r]`: rank r's rows of tensor t.
    """

    def __init__(self, row_elems: Sequence[int], counts: Sequence[Sequence[int]], size: int, lanes: int) -> None:
        self.size = size
        self.row_elems = list(row_elems)
        self.counts = [list(c) for c in counts]
        self.padded = [max(c, default=0) * e for c, e in zip(self.counts, self.row_elems)]
        self.columns = [sum(self.padded[:i]) for i in range(len(self.padded))]
        self.width = sum(self.padded)
        self.bounds = _C.shard_boundaries(self.width, [1.0] * lanes)
        self.padding = any(min(c) != max(c) for c in self.counts if c)

    @classmethod
    def split(cls, tensors: Sequence[torch.Tensor], size: int, lanes: int) -> "Layout":
        """A reduce-scatter's: every rank holds whole tensors, each split as Horovod splits it."""
        return cls([math.prod(t.shape[1:]) for t in tensors], [shares(t.shape[0], size) for t in tensors],
                   size, lanes)

    def pieces(self, t: int, rank: int) -> List[Tuple[int, int, int]]:
        """(element offset in the buffer, element offset in rank `rank`'s rows of tensor t, count)
        for each lane's piece of those rows."""
        begin = self.columns[t]
        end = begin + self.counts[t][rank] * self.row_elems[t]
        chunk = (rank + 1) % self.size
        out = []
        for lo, hi in zip(self.bounds[:-1], self.bounds[1:]):
            a, b = max(lo, begin), min(hi, end)
            if a < b:
                out.append((self.size * lo + chunk * (hi - lo) + (a - lo), a - begin, b - a))
        return out

    def first_row(self, t: int, rank: int) -> int:
        """Where rank `rank`'s rows of tensor t start in the whole (gathered or reduced) tensor."""
        return sum(self.counts[t][:rank])

    def place(self, t: int, ranks: Sequence[int], source: torch.Tensor, staged: torch.Tensor,
              into_buffer: bool) -> None:
        """Copies the rows of tensor t that `ranks` hold between `source` (flat; rank r's rows at
        ``first_row(t, r)`` relative to the first of `ranks`) and `staged`, in the direction
        `into_buffer` says."""
        base = self.first_row(t, ranks[0]) if ranks else 0
        for r in ranks:
            at_rows = (self.first_row(t, r) - base) * self.row_elems[t]
            for at, offset, count in self.pieces(t, r):
                mine = source[at_rows + offset:at_rows + offset + count]
                if into_buffer:
                    copy_tensor(staged[at:at + count], mine)
                else:
                    copy_tensor(mine, staged[at:at + count])


def rows_in(layout: Layout, tensors: Sequence[torch.Tensor], staged: torch.Tensor) -> None:
    """A reduce-scatter's input: lays every rank's rows of `tensors` out in `staged`, padding zeroed
    (it is summed)."""
    if layout.padding:
        zero_tensor(staged)
    for t, x in enumerate(tensors):
        layout.place(t, range(layout.size), x.reshape(-1), staged, True)  # a non-contiguous input: a copy


def rows_out(layout: Layout, staged: torch.Tensor, outputs: Sequence[torch.Tensor], ranks: Sequence[int]) -> None:
    """Copies the rows of each tensor that `ranks` hold (consecutive, in rank order) from `staged`
    into `outputs`: a reduce-scatter's own rows, or an allgather's every rank's."""
    for t, out in enumerate(outputs):
        layout.place(t, ranks, out.view(-1), staged, False)


class RowsOut(Request):
    """A posted collective laid out by rows per rank: once wait() returned, each of ``outputs``
    holds the rows of its tensor that `ranks` hold (:func:`rows_out`)."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, outputs: Sequence[torch.Tensor],
                 layout: Layout, ranks: Sequence[int]) -> None:
        super().__init__(group, ticket, buffer, True, (), outputs, ())
        self._layout, self._ranks = layout, list(ranks)
        self.outputs = list(outputs)

    def _copy_out(self) -> None:
        layout = self._layout
        rows_out(layout, self._buffer.view(self.outputs[0].dtype, 0, layout.size * layout.width), self.outputs,
                 self._ranks)
