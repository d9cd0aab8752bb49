"""The proxies' reduce-scatter (Horovod's ``reducescatter``), posted through a ProxyGroup's one
submit path (``ProxyGroup._submit``).

Horovod gives rank r rows [o_r, o_r + n_r) of the reduced tensor's first dimension, the first
``dim0 % size`` ranks one row more than the others. Each rank lays the whole input out by rows per
rank (rows.py): row r holds what rank r receives, padded with zeros to the largest share, in the
ring chunk that rank r holds reduced once the reduce-scatter phase is over. The ring then
runs its reduce-scatter phase only (OP_REDUCESCATTER), half an allreduce's traffic, and each rank
copies its own row out. Several tensors (``grouped_reducescatter``) lie side by side in each row,
so they travel as one collective. In the hierarchical layout the proxies run the hierarchical
allreduce of the same layout instead (csrc/proxy/proxy.cc, HostPhases: every row summed, twice
the reduce-scatter's bytes across hosts), and each rank copies its own row out as on a flat ring.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from fasthorovod.proxy.core import DTYPE_CODES, OP_REDUCESCATTER, WIRE_CODES
from fasthorovod.proxy.rows import Layout, RowsOut, rows_in

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def post(group: "ProxyGroup", tensors: Sequence[torch.Tensor], name: str, average: bool, prescale: float,
         postscale: float, wire: Optional[torch.dtype] = None) -> RowsOut:
    """Posts the reduce-scatter of `tensors` (one dtype, at least one dimension each, the same
    shapes on every rank; CPU or CUDA); the request's outputs are this rank's rows of each."""
    dtype = tensors[0].dtype
    if any(t.dim() == 0 or t.dtype != dtype for t in tensors) or dtype not in DTYPE_CODES:
        raise ValueError("a reduce-scatter takes tensors of one supported dtype with at least one dimension, got "
                         + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors))
    n, rank = group.size, group.rank
    layout = Layout.split(tensors, n, group.lanes)
    itemsize = tensors[0].element_size()
    outputs = [torch.empty((layout.counts[t][rank],) + tuple(x.shape[1:]), dtype=dtype, device=x.device)
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
    return RowsOut(group, ticket, buffer, outputs, layout, [rank])
