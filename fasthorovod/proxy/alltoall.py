"""The proxies' alltoall (Horovod's ``alltoall``), posted through a ProxyGroup's one submit path
(``ProxyGroup._submit``) and carried by the lanes' mesh (csrc/collectives/alltoall.h).

Rank s sends ``splits[d]`` rows of its tensor to rank d, and every rank may send a different
number to each. In two stages, as the allgather of rows (gather.py):

1. an allgather of every rank's *head*: a hash of the tensor's other dimensions and dtype (every
   rank checks the others'), its splits, and its tensor's bytes when they fit in
   :data:`~fasthorovod.proxy.gather.INLINE_BYTES`. Every rank then holds the whole split matrix.
   When every rank's tensor fit, that one collective is the alltoall.
2. otherwise, posted by the group's second-stage thread (stages.py) once the heads are in and under
   the same name, the blocks: the proxies send each block straight to its rank (the rank's lanes
   share every block, each taking segments as its sockets drain) and write what they receive in
   rank order into a receive buffer. The second-stage thread writes the size table (elements it
   sends to each rank and receives from each, both from the matrix, and where the receive region
   is), posts the blocks, and only then stages the rank's rows for the other ranks into the send
   buffer, block by block in distance order (the block for rank + 1 first), each published in the
   table's staged word once copied: the proxies send a block once it is staged
   (collectives/alltoall.h), so the first blocks travel while the last are copied. Nothing is
   copied while the heads travel: on the emulated cloud's two shared cores, four workers staging
   at once made the heads' allgather take 25 ms instead of 3 (docs/benchmarks.md). The rank then
   copies its own block (which never leaves the worker, and is never staged) from the tensor to
   its place while the proxies work.
   The receive region is laid out as the output, so an output of at least LEND_MIN_BYTES on the
   CPU is that region itself, lent (buffers.py): nothing is copied out. Otherwise (a CUDA tensor, a
   small output) the rank touches the rest of the output while the proxies work, so that copying
   the received blocks out meets no page faults (a fresh 64 MiB tensor takes three times as long to
   fill as a used one).

The collective the ranks negotiate is described by the matrix (the most one rank sends as its
count, a hash of it in the description), so every rank submits the same description; the sizes one rank's proxies send and
another's receive agree because both come from that matrix.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from fasthorovod import _C
from fasthorovod.proxy.buffers import Buffer, copy_tensor, zero_tensor
from fasthorovod.proxy.core import DTYPE_CODES, OP_ALLTOALL, hash64
from fasthorovod.proxy.gather import INLINE_BYTES, GatherRequest, post as gather_post
from fasthorovod.proxy.requests import Request, lends
from fasthorovod.proxy.stages import HeadsFirst

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def post(group: "ProxyGroup", tensor: torch.Tensor, splits: Sequence[int], name: str,
         gather_heads: Optional[Callable[[torch.Tensor, str], GatherRequest]] = None) -> "AlltoallRequest":
    """Posts the alltoall of `tensor` (a dtype the proxies carry, at least one dimension, CPU or
    CUDA), sending ``splits[d]`` rows to rank d (``sum(splits) <= tensor.shape[0]``; rows past the
    sum are not sent, as in Horovod). The request's ``output`` holds the rows received from every
    rank in rank order, ``received_splits`` how many came from each.

    `gather_heads(head, name)`: how the heads travel (gather.py, ``post_rows``); by default the
    proxies' own allgather.
    """
    n = group.size
    if (tensor.dim() == 0 or tensor.dtype not in DTYPE_CODES or len(splits) != n or min(splits) < 0
            or sum(splits) > tensor.shape[0]):
        raise ValueError(f"the proxies alltoall a tensor of a supported dtype with at least one dimension, with one "
                         f"non-negative split per rank summing to at most its first dimension; got "
                         f"{tuple(tensor.shape)} {tensor.dtype} with splits {list(splits)}")
    description = f"alltoall of {','.join(map(str, tensor.shape[1:]))} {tensor.dtype}"
    head = torch.zeros(8 * (1 + n) + INLINE_BYTES, dtype=torch.uint8)
    words = head[:8 * (1 + n)].view(torch.int64)
    words[0] = hash64(description) - (1 << 63)  # as a signed 64-bit word
    words[1:].copy_(torch.tensor(list(splits), dtype=torch.int64))
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    sent = tensor[:sum(splits)]
    if sum(splits) * row_bytes <= INLINE_BYTES:
        payload = sent.reshape(-1).contiguous().view(torch.uint8)
        copy_tensor(head[8 * (1 + n):8 * (1 + n) + payload.numel()], payload.cpu())
    heads = gather_heads(head, name) if gather_heads is not None else gather_post(group, head, name, description)
    request = AlltoallRequest(group, heads, tensor, name, description)
    group.second_stages.add(request)
    return request


class AlltoallRequest(HeadsFirst):
    """A posted :func:`post`: ``wait()`` returns once ``output`` and ``received_splits`` (a list of
    ints) hold the result, or raises what failed in either stage."""

    verb = "alltoall"
    heads_end_with_the_data_plane = True

    def __init__(self, group: "ProxyGroup", heads, tensor: torch.Tensor, name: str, description: str) -> None:
        super().__init__(group, heads, name, description, (tensor,))
        self._like: Optional[torch.Tensor] = tensor  # the input: its rows, the output's shape, dtype, device
        self.output: Optional[torch.Tensor] = None  # complete once wait() returned
        self.received_splits: List[int] = []

    def _second_stage(self) -> Optional[Request]:
        try:
            self._heads.wait()
        except Exception as e:  # the heads' allgather refused: say it of the alltoall, as Horovod does
            if "is not supported with Join" in str(e):
                raise type(e)("Alltoall is not supported with Join at this time.") from e
            raise
        n, rank, x = self._group.size, self._group.rank, self._like
        heads = self._heads.output.reshape(n, -1)  # one head per rank, uint8
        words = heads[:, :8 * (1 + n)].contiguous().view(torch.int64)
        self.check_descriptions(words[:, 0].tolist())
        matrix = words[:, 1:].tolist()  # matrix[s][d]: rows rank s sends to rank d
        self.received_splits = [matrix[s][rank] for s in range(n)]
        row_elems = math.prod(x.shape[1:])
        row_bytes = row_elems * x.element_size()
        shape = (sum(self.received_splits),) + tuple(x.shape[1:])
        inline = max(sum(row) for row in matrix) * row_bytes <= INLINE_BYTES
        if inline or not lends(shape[0] * row_bytes, x.device):
            self.output = torch.empty(shape, dtype=x.dtype, device=x.device)
        if inline:
            self._from_heads(heads[:, 8 * (1 + n):], matrix, row_bytes)
            return None
        self.await_inputs()
        blocks = _Blocks(self._group, self._name, matrix, x, self.output, shape)
        blocks.stage()
        return blocks

    def _finished(self) -> None:
        if self.output is None:
            self.output = self._second.output  # lent

    def _drop(self) -> None:
        self._like = None

    def _from_heads(self, payloads: torch.Tensor, matrix: List[List[int]], row_bytes: int) -> None:
        """Every rank's rows came inline: this rank's blocks, from each rank's head, in rank order."""
        rank = self._group.rank
        out = self.output.view(-1).view(torch.uint8) if self.output.numel() else None
        at = 0
        for s, row in enumerate(matrix):
            nbytes = row[rank] * row_bytes
            if nbytes:
                begin = sum(row[:rank]) * row_bytes
                copy_tensor(out[at:at + nbytes], payloads[s, begin:begin + nbytes])
            at += nbytes


def _publish(send: Buffer, size: int, staged: int) -> None:
    """Sets the staged word of the alltoall table in `send` (collectives/alltoall.h)."""
    _C.publish_word(send.view(torch.int64, 8 * _C.alltoall_staged_word(size), 1).data_ptr(), staged)


class _Blocks(Request):
    """The second stage on the mesh: takes a send buffer, writes the size table into it, posts the
    blocks with a receive buffer laid out as the output (`shape`); then :meth:`stage` copies the
    rows of `tensor` for the other ranks into the send buffer while the proxies run, and the rank's
    rows for itself to their place. `output` None: once done, the receive buffer is lent as
    ``output``. Else the rank's own rows go straight to `output`, the rest of which is touched
    meanwhile, and the received blocks are copied out once done. Owns both buffers (Request
    releases the send buffer, _finish the receive buffer unless it was lent)."""

    def __init__(self, group: "ProxyGroup", name: str, matrix: List[List[int]], tensor: torch.Tensor,
                 output: Optional[torch.Tensor], shape: Sequence[int]) -> None:
        n, rank, dtype = group.size, group.rank, tensor.dtype
        itemsize = tensor.element_size()
        row_elems = math.prod(shape[1:])
        sent = [c * row_elems for c in matrix[rank]]
        recv = [matrix[s][rank] * row_elems for s in range(n)]
        send = group.pool.acquire(_C.alltoall_send_offset(n) + sum(sent) * itemsize)
        with group._releasing_on_failure(send):
            self._recv_buffer = group.pool.acquire(max(1, sum(recv) * itemsize))
            with group._releasing_on_failure(self._recv_buffer):
                # The table: nothing staged yet, no segment claimed by the lanes.
                table = send.view(torch.int64, 0, _C.alltoall_claim_word(n) + n)
                table.zero_()
                table[:2 * n + 1].copy_(torch.tensor(sent + recv + [self._recv_buffer.id], dtype=torch.int64))
                # What the ranks compare: the matrix (its hash) and, as the count, the most one rank
                # sends (the same everywhere, and no more than one rank's tensor, which the size
                # limits bound).
                largest = max(sum(row) for row in matrix) * row_elems
                ticket = group._submit(send, name, f"alltoall {hash64(repr(matrix)):016x}", sum(sent) * itemsize,
                                       buffer_offset=0, count=largest, dtype=DTYPE_CODES[dtype], op=OP_ALLTOALL)
        super().__init__(group, ticket, send, True, (), (), ())
        self._recv, self._rank, self._shape, self._dtype = recv, rank, tuple(shape), dtype
        self._rows, self._splits = tensor[:sum(matrix[rank])], matrix[rank]
        self.output = output  # complete once wait() returned (lent then, where None before)

    def stage(self) -> None:
        """Copies the rows for the other ranks into the send region, each block at its place in
        rank order, in distance order, publishing each in the staged word (the proxies send a block
        once it is there); then the rank's own rows to their place, and the first touch of every
        other page of an output. A failed copy publishes ALLTOALL_STAGING_FAILED, so the proxies
        fail the alltoall on every rank (they say so), and raises here once they have."""
        group, rows = self._group, self._rows
        n, rank, send = group.size, group.rank, self._buffer
        try:
            staged = send.view(rows.dtype, _C.alltoall_send_offset(n), rows.numel())
            row, begins = math.prod(rows.shape[1:]), list(itertools.accumulate(self._splits, initial=0))
            for distance in range(1, n):
                d = (rank + distance) % n
                copy_tensor(staged[begins[d] * row:begins[d + 1] * row], rows[begins[d]:begins[d + 1]].reshape(-1))
                _publish(send, n, distance)
        except Exception:
            _publish(send, n, _C.ALLTOALL_STAGING_FAILED)
            with contextlib.suppress(Exception):
                self.wait()  # fails at once, and gives the buffers back once the proxies are done
            raise
        at, recv = sum(self._recv[:rank]), self._recv
        flat = self.output.view(-1) if self.output is not None else self._recv_buffer.view(self._dtype, 0, sum(recv))
        copy_tensor(flat[at:at + recv[rank]], rows[begins[rank]:begins[rank + 1]].reshape(-1))
        if self.output is not None:
            zero_tensor(flat[:at])
            zero_tensor(flat[at + recv[rank]:])
        self._rows = None

    def _copy_out(self) -> None:
        if self.output is None:
            (self.output,) = self._group.pool.lend(self._recv_buffer, [(0, self._dtype, self._shape)])
            self._recv_buffer = None  # the output owns it now
            return
        flat, at, dtype = self.output.view(-1), 0, self._dtype
        for s, count in enumerate(self._recv):
            if s != self._rank and count:
                copy_tensor(flat[at:at + count], self._recv_buffer.view(dtype, at * self.output.element_size(), count))
            at += count

    def _finish(self) -> None:
        super()._finish()
        if self._recv_buffer is not None:
            self._group.pool.release(self._recv_buffer)
            self._recv_buffer = None
