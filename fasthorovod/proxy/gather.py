"""The proxies' allgathers, posted through a ProxyGroup's one submit path (``ProxyGroup._submit``):
:func:`post`, of one equal-length row per rank (the scheduler's packed payloads), and
:func:`post_rows`, Horovod's allgather of tensors whose first dimension differs between ranks.

A ring allgather is sharded over the lanes: lane j gathers columns [b_j, b_j+1) of every rank's
row. The lanes' shares are equal whatever the lane weights, which rebalancing sets per rank: each
rank lays its row out before the collective is negotiated, by equal shares of its width
(``_C.shard_boundaries``, the function the coordinator computes the run order's boundaries with:
size x those of one row, csrc/negotiation/coordinator.h). The hierarchical layout has no
allgather schedule; there each rank writes its rows among zeros, read as integer words of the
element's size, and the ranks sum them (adding integer zeros changes no bit, so every row arrives
exactly): twice the bytes of a ring allgather across hosts. :func:`post` submits that as a sum
with the same description, so that a joined rank's zeros fit too; :func:`post_rows` as an
allgather, which the proxies run as that sum (csrc/proxy/proxy.cc, HostPhases) and the negotiation
refuses while a rank has joined, as Horovod does.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from fasthorovod import _C
from fasthorovod.proxy.buffers import copy_tensor, zero_tensor
from fasthorovod.proxy.core import BROADCAST_WORDS, DTYPE_CODES, OP_GATHER, OP_SUM, hash64
from fasthorovod.proxy.requests import GatherRequest, Request
from fasthorovod.proxy.rows import Layout, RowsOut
from fasthorovod.proxy.stages import HeadsFirst

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def post(group: "ProxyGroup", tensor: torch.Tensor, name: str, description: Optional[str] = None) -> GatherRequest:
    """Posts the allgather of this rank's 1-D CPU `tensor` (same length and dtype on every rank;
    `description`: what the ranks compare, by default the length)."""
    if tensor.dim() != 1 or tensor.dtype not in DTYPE_CODES or tensor.device.type != "cpu":
        raise ValueError(f"allgather takes a 1-D CPU tensor of a supported dtype, got {tuple(tensor.shape)} "
                         f"{tensor.dtype} on {tensor.device}")
    if group.plan.layout is not None:
        return _post_as_sum(group, tensor, name, description)
    n, width, itemsize = group.size, tensor.numel(), tensor.element_size()
    bounds = _C.shard_boundaries(width, [1.0] * group.lanes)  # the coordinator's layout of a row
    output = torch.empty((n, width), dtype=tensor.dtype)
    buffer = group.pool.acquire(max(1, n * width * itemsize))
    own = _C.allgather_own_chunk(group.rank, n)
    with group._releasing_on_failure(buffer):
        for begin, end in zip(bounds[:-1], bounds[1:]):
            m = end - begin
            copy_tensor(buffer.view(tensor.dtype, (n * begin + own * m) * itemsize, m), tensor[begin:end])
        ticket = group._submit(buffer, name, description or str(width), width * itemsize, buffer_offset=0,
                               count=n * width, dtype=DTYPE_CODES[tensor.dtype], op=OP_GATHER)
    return GatherRequest(group, ticket, buffer, output, bounds)


def _post_as_sum(group: "ProxyGroup", tensor: torch.Tensor, name: str, description: Optional[str]) -> GatherRequest:
    n, width, itemsize = group.size, tensor.numel(), tensor.element_size()
    words = BROADCAST_WORDS.get(itemsize)
    if words is None:
        raise ValueError(f"the proxies cannot allgather {tensor.dtype} (element size {itemsize})")
    output = torch.empty((n, width), dtype=tensor.dtype)
    buffer = group.pool.acquire(max(1, n * width * itemsize))
    count = n * width
    with group._releasing_on_failure(buffer):
        zero_tensor(buffer.view(words, 0, count))
        copy_tensor(buffer.view(tensor.dtype, group.rank * width * itemsize, width), tensor)
        ticket = group._submit(buffer, name, description or str(width), width * itemsize, buffer_offset=0,
                               count=count, dtype=DTYPE_CODES[words], op=OP_SUM)
    return GatherRequest(group, ticket, buffer, output, None)


# The bytes of an allgather that travel with its row counts: every allgather's first collective
# carries 4 KiB more per rank (33 microseconds a hop at 1 Gbit/s), and small allgathers (objects,
# sizes, metrics) take that one collective instead of two.
INLINE_BYTES = 4096


def _inline(tensors: Sequence[torch.Tensor], payload: torch.Tensor, into_head: bool) -> None:
    """Copies `tensors`' bytes, one after another, into `payload` (uint8) or back out of it."""
    at = 0
    for x in tensors:
        nbytes = x.numel() * x.element_size()
        flat = x.reshape(-1) if into_head else x.view(-1)
        words = flat.view(torch.uint8) if flat.is_contiguous() else flat.contiguous().view(torch.uint8)
        if into_head:
            copy_tensor(payload[at:at + nbytes], words)
        else:
            copy_tensor(words, payload[at:at + nbytes])
        at += nbytes


def post_rows(group: "ProxyGroup", tensors: Sequence[torch.Tensor], name: str,
              gather_heads: Optional[Callable[[torch.Tensor, str], GatherRequest]] = None) -> "RowsRequest":
    """Posts Horovod's allgather of `tensors` (one supported dtype, at least one dimension each; on
    every rank the same shapes but for the first dimension; CPU or CUDA): the
    request's outputs are each tensor's rows of every rank, in rank order.

    First, posted now, an allgather of every rank's *head*: a hash of the tensors' other
    dimensions and dtype (which every rank checks against the others'), the row counts, and the
    tensors' bytes when they fit in :data:`INLINE_BYTES`. When every rank's fit, that one
    collective is the allgather. Otherwise, second, under the same name, the rows, each rank's
    padded to the largest count (rows.py), posted by the group's second-stage thread (stages.py)
    as soon as the heads are in. The padding is the price of equal ring chunks: the ring carries
    ``size x`` the largest rank's rows.

    `gather_heads(head, name)`: how the heads travel, a request with ``poll()``, ``wait()`` and,
    once waited, ``output`` (one row per rank); by default the proxies' own allgather (:func:`post`).
    """
    dtype = tensors[0].dtype
    if any(t.dim() == 0 or t.dtype != dtype for t in tensors) or dtype not in DTYPE_CODES:
        raise ValueError("the proxies allgather tensors of one supported dtype with at least one dimension, got "
                         + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))
    description = "rows of " + "; ".join(",".join(map(str, t.shape[1:])) for t in tensors) + f" {dtype}"
    head = torch.zeros(8 * (1 + len(tensors)) + INLINE_BYTES, dtype=torch.uint8)
    words = head[:8 * (1 + len(tensors))].view(torch.int64)
    words[0] = hash64(description) - (1 << 63)  # as a signed 64-bit word
    words[1:].copy_(torch.tensor([t.shape[0] for t in tensors]))
    if sum(t.numel() * t.element_size() for t in tensors) <= INLINE_BYTES:
        _inline(tensors, head[8 * (1 + len(tensors)):], into_head=True)
    heads = gather_heads(head, name) if gather_heads is not None else post(group, head, name, description)
    request = RowsRequest(group, heads, tensors, name, description)
    group.second_stages.add(request)
    return request


class RowsRequest(HeadsFirst):
    """A posted :func:`post_rows`: ``wait()`` returns once the rows are in ``outputs`` (or raises
    what failed in either stage)."""

    verb = "allgather"

    def __init__(self, group: "ProxyGroup", heads, tensors: Sequence[torch.Tensor], name: str,
                 description: str) -> None:
        super().__init__(group, heads, name, description, tensors)
        self._tensors = list(tensors)  # this rank's rows, held until they are staged
        self.outputs: List[torch.Tensor] = []  # complete once wait() returned

    def _second_stage(self) -> Optional[Request]:
        self._heads.wait()
        heads = self._heads.output.reshape(self._group.size, -1)  # one head per rank, uint8
        k = len(self._tensors)
        words = heads[:, :8 * (1 + k)].contiguous().view(torch.int64)
        self.check_descriptions(words[:, 0].tolist())
        counts = words[:, 1:].t().tolist()
        row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in self._tensors]
        sent = [sum(c[r] * b for c, b in zip(counts, row_bytes)) for r in range(self._group.size)]
        if max(sent) > INLINE_BYTES:
            self.await_inputs()
            return self._post_rows(counts)
        self.outputs = self._empty_outputs(counts)
        for r in range(self._group.size):
            mine = [out[sum(c[:r]):sum(c[:r + 1])] for out, c in zip(self.outputs, counts)]
            _inline(mine, heads[r, 8 * (1 + k):], into_head=False)
        return None

    def _drop(self) -> None:
        self._tensors = []

    def _finished(self) -> None:
        self.outputs = self._second.outputs

    def _post_rows(self, counts: List[List[int]]) -> Request:
        group, tensors, n = self._group, self._tensors, self._group.size
        x0 = tensors[0]
        layout = Layout([math.prod(t.shape[1:]) for t in tensors], counts, n, group.lanes)
        outputs = self._empty_outputs(counts)
        buffer = group.pool.acquire(max(1, n * layout.width * x0.element_size()))
        # The hierarchical layout sums the rows (csrc/proxy/proxy.cc, HostPhases): this rank's among
        # zeros, as integer words of the element's size, so that every bit arrives.
        summed = group.plan.layout is not None
        with group._releasing_on_failure(buffer):
            staged = buffer.view(x0.dtype, 0, n * layout.width)
            if summed:
                zero_tensor(staged)
            for t, x in enumerate(tensors):
                layout.place(t, [group.rank], x.reshape(-1), staged, True)
            code = DTYPE_CODES[BROADCAST_WORDS[x0.element_size()] if summed else x0.dtype]
            ticket = group._submit(buffer, self._name, "rows of " + ";".join(",".join(map(str, c)) for c in counts),
                                   sum(x.numel() for x in tensors) * x0.element_size(), buffer_offset=0,
                                   count=n * layout.width, dtype=code, op=OP_GATHER)
        return RowsOut(group, ticket, buffer, outputs, layout, range(n))

    def _empty_outputs(self, counts: List[List[int]]) -> List[torch.Tensor]:
        return [torch.empty((sum(c),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                for c, t in zip(counts, self._tensors)]
