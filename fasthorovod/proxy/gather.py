"""The proxies' allgather, posted through a ProxyGroup's one submit path (``ProxyGroup._submit``).

A ring allgather is sharded over the lanes: lane j gathers columns [b_j, b_j+1) of every rank's
row. The lanes' shares are equal whatever the lane weights, which rebalancing sets per rank: each
rank lays its row out before the collective is negotiated, by equal shares of its width
(``_C.shard_boundaries``, the function the coordinator computes the run order's boundaries with:
size x those of one row, csrc/negotiation/coordinator.h). The hierarchical
allreduce has no allgather schedule; there each rank writes its row into a (size, len) buffer of
zeros, read as integer words, and the ranks sum it (adding integer zeros changes no bit, so every
row arrives exactly): twice the bytes of a ring allgather, with the same description, so that a
joined rank's zeros fit too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fasthorovod import _C
from fasthorovod.proxy.buffers import copy_tensor, zero_tensor
from fasthorovod.proxy.core import BROADCAST_WORDS, DTYPE_CODES, OP_GATHER, OP_SUM
from fasthorovod.proxy.requests import GatherRequest

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def post(group: "ProxyGroup", tensor: torch.Tensor, name: str) -> GatherRequest:
    """Posts the allgather of this rank's 1-D CPU `tensor` (same length and dtype on every rank)."""
    if tensor.dim() != 1 or tensor.dtype not in DTYPE_CODES or tensor.device.type != "cpu":
        raise ValueError(f"allgather takes a 1-D CPU tensor of a supported dtype, got {tuple(tensor.shape)} "
                         f"{tensor.dtype} on {tensor.device}")
    if group.plan.layout is not None:
        return _post_as_sum(group, tensor, name)
    n, width, itemsize = group.size, tensor.numel(), tensor.element_size()
    bounds = _C.shard_boundaries(width, [1.0] * group.lanes)  # the coordinator's layout of a row
    output = torch.empty((n, width), dtype=tensor.dtype)
    buffer = group.pool.acquire(max(1, n * width * itemsize))
    own = _C.allgather_own_chunk(group.rank, n)
    with group._releasing_on_failure(buffer):
        for begin, end in zip(bounds[:-1], bounds[1:]):
            m = end - begin
            copy_tensor(buffer.view(tensor.dtype, (n * begin + own * m) * itemsize, m), tensor[begin:end])
        ticket = group._submit(buffer, name, str(width), width * itemsize, buffer_offset=0, count=n * width,
                               dtype=DTYPE_CODES[tensor.dtype], op=OP_GATHER)
    return GatherRequest(group, ticket, buffer, output, bounds)


def _post_as_sum(group: "ProxyGroup", tensor: torch.Tensor, name: str) -> GatherRequest:
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
        ticket = group._submit(buffer, name, str(width), width * itemsize, buffer_offset=0, count=count,
                               dtype=DTYPE_CODES[words], op=OP_SUM)
    return GatherRequest(group, ticket, buffer, output, None)
