"""The proxies' alltoall (Horovod's ``alltoall``), posted through a ProxyGroup's one submit path
(``ProxyGroup._submit``) and carried by the lanes' mesh (csrc/collectives/alltoall.h).

Rank s sends ``splits[d]`` rows of its tensor to rank d, and every rank may send a different
number to each. In two stages, as the allgather of rows (gather.py):

1. an allgather of every rank's *head*: a hash of the tensor's other dimensions and dtype (every
   rank checks the others'), its splits, and its tensor's bytes when they fit in
   :data:`~fasthorovod.proxy.gather.INLINE_BYTES`. Every rank then holds the whole split matrix.
   When every rank's tensor fit, that one collective is the alltoall.
2. otherwise, posted by the group's second-stage thread (stages.py) once the heads are in and under
   the same name, the blocks: the proxies send each block straight to its rank (lane j carries
   part j of every block) and write what they receive in rank order into a receive buffer. The
   rank's rows for the other ranks are staged into the send buffer when the alltoall is called,
   while the heads travel, block by block in distance order (the block for rank + 1 first), each
   published in the table's staged word once copied. Once the heads are in, the second-stage
   thread writes the size table (elements it sends to each rank and receives from each, both from
   the matrix, and where the receive region is) and posts the blocks, whether or not staging is
   done: the proxies send a block once it is staged (collectives/alltoall.h), so the first blocks
   travel while the last are copied. The rank then copies its own block (which never leaves the
   worker, and is never staged) from the tensor to its place while the proxies work.
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
import threading
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
    staging = sum(splits) * row_bytes > INLINE_BYTES
    if staging:
        request.reserve(sent)
    group.second_stages.add(request)
    if staging:
        request.stage(sent, splits)  # while the heads travel, and the first blocks once they are in
    return request


class AlltoallRequest(HeadsFirst):
    """A posted :func:`post`: ``wait()`` returns once ``output`` and ``received_splits`` (a list of
    ints) hold the result, or raises what failed in either stage."""

    verb = "alltoall"
    heads_end_with_the_data_plane = True

    def __init__(self, group: "ProxyGroup", heads, tensor: torch.Tensor, name: str, description: str) -> None:
        super().__init__(group, heads, name, description)
        self._like: Optional[torch.Tensor] = tensor  # the input, for the output's shape, dtype, device
        self._send: Optional[Buffer] = None  # the staged rows (stage), until the blocks own it
        self._staging = threading.Event()  # set once stage() ended: `_send` is no longer written
        self._staging_error: Optional[Exception] = None  # what stage() failed with
        self.output: Optional[torch.Tensor] = None  # complete once wait() returned
        self.received_splits: List[int] = []

    def reserve(self, rows: torch.Tensor) -> None:
        """Takes the send buffer for `rows`, nothing staged in it yet."""
        group = self._group
        send = group.pool.acquire(_C.alltoall_send_offset(group.size) + rows.numel() * rows.element_size())
        with group._releasing_on_failure(send):
            _publish(send, group.size, 0)
        self._send = send

    def stage(self, rows: torch.Tensor, splits: Sequence[int]) -> None:
        """Copies the rows this rank sends to the others (``splits[d]`` to rank d) into the send
        buffer (reserve), each block at its place in rank order, in distance order, publishing each
        in the staged word; its own block, which the proxies never read, goes straight from `rows`
        to the output (_Blocks). The second stage may post the blocks meanwhile, on another thread;
        it gives the buffer back only once staging ended (``_staging``). A failure publishes
        ALLTOALL_STAGING_FAILED, so the proxies fail the alltoall on every rank (they say so), and
        ``wait()`` raises it here."""
        n, rank, send = self._group.size, self._group.rank, self._send
        try:
            staged = send.view(rows.dtype, _C.alltoall_send_offset(n), rows.numel())
            row, begins = math.prod(rows.shape[1:]), list(itertools.accumulate(splits, initial=0))
            for distance in range(1, n):
                d = (rank + distance) % n
                begin, end = begins[d] * row, begins[d + 1] * row
                copy_tensor(staged[begin:end], rows[begins[d]:begins[d + 1]].reshape(-1))
                _publish(send, n, distance)
        except Exception as e:
            self._staging_error = e
            _publish(send, n, _C.ALLTOALL_STAGING_FAILED)
        finally:
            self._staging.set()

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
        if self._send is None:  # this rank's rows fit inline, another rank's did not
            rows = x[:sum(matrix[rank])]
            self.reserve(rows)
            self.stage(rows, matrix[rank])
        send, self._send = self._send, None
        own = x[sum(matrix[rank][:rank]):sum(matrix[rank][:rank + 1])]
        return _Blocks(self._group, self._name, send, self._staging, matrix, own, self.output, shape)

    def wait(self) -> None:
        try:
            super().wait()
        except Exception as e:
            if self._staging_error is not None:  # the cause, rather than the proxies' word for it
                raise self._staging_error from e
            raise

    def _finished(self) -> None:
        if self.output is None:
            self.output = self._second.output  # lent

    def _drop(self) -> None:
        if self._send is not None:
            self._staging.wait()  # a memory copy on the caller's thread
            self._group.pool.release(self._send)
            self._send = None
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


@contextlib.contextmanager
def _releasing_once_staged(group: "ProxyGroup", send: Buffer, staging: threading.Event):
    """Gives `send` back to the pool if posting fails, once the caller's staging into it ended."""
    try:
        yield
    except BaseException:
        staging.wait()
        group.pool.release(send)
        raise


class _Blocks(Request):
    """The second stage on the mesh: writes the size table into `send` (the rows for the other
    ranks are staged there, or being staged by the caller until `staging` is set), posts the blocks with a receive buffer laid out as the output
    (`shape`), and copies `own`, the rank's rows for itself, to its place. `output` None: once done,
    the receive buffer is lent as ``output``. Else `own` goes straight to `output`, the rest of
    which is touched meanwhile, and the received blocks are copied out once done. Owns both buffers
    from here on (Request releases the send buffer, _finish the receive buffer unless it was lent)."""

    def __init__(self, group: "ProxyGroup", name: str, send: Buffer, staging: threading.Event,
                 matrix: List[List[int]], own: torch.Tensor, output: Optional[torch.Tensor],
                 shape: Sequence[int]) -> None:
        n, rank, dtype = group.size, group.rank, own.dtype
        itemsize = own.element_size()
        row_elems = math.prod(shape[1:])
        sent = [c * row_elems for c in matrix[rank]]
        recv = [matrix[s][rank] * row_elems for s in range(n)]
        with _releasing_once_staged(group, send, staging):  # the caller may still be staging into it
            self._recv_buffer = group.pool.acquire(max(1, sum(recv) * itemsize))
            with group._releasing_on_failure(self._recv_buffer):
                # The table but its staged word, which the caller's staging writes; the lanes'
                # claim words start at zero.
                send.view(torch.int64, 0, 2 * n + 2).copy_(torch.tensor(sent + recv + [self._recv_buffer.id, 0],
                                                                        dtype=torch.int64))
                send.view(torch.int64, 8 * _C.alltoall_claim_word(n), n).zero_()
                # What the ranks compare: the matrix (its hash) and, as the count, the most one rank
                # sends (the same everywhere, and no more than one rank's tensor, which the size
                # limits bound).
                largest = max(sum(row) for row in matrix) * row_elems
                ticket = group._submit(send, name, f"alltoall {hash64(repr(matrix)):016x}", sum(sent) * itemsize,
                                       buffer_offset=0, count=largest, dtype=DTYPE_CODES[dtype], op=OP_ALLTOALL)
        super().__init__(group, ticket, send, True, (), (), ())
        self._recv, self._rank, self._shape, self._dtype = recv, rank, tuple(shape), dtype
        self.output = output  # complete once wait() returned (lent then, where None before)
        # While the proxies work: the own block, and the first touch of every other page of an output.
        at = sum(recv[:rank])
        flat = output.view(-1) if output is not None else self._recv_buffer.view(dtype, 0, sum(recv))
        copy_tensor(flat[at:at + recv[rank]], own.reshape(-1))
        if output is not None:
            zero_tensor(flat[:at])
            zero_tensor(flat[at + recv[rank]:])

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
