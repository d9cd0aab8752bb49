"""Shared-memory buffers that proxies can read and write in place.

Two kinds, one mechanism (a :class:`ShmBuffer`: an anonymous memfd that the channel hands to every
proxy under the buffer's id when it is created, ``ProxyChannel.create_buffer``):

* staging buffers, pooled by size class: an allreduce of an ordinary tensor copies it in, the
  proxies reduce it in place, and the result is copied out, or, for a new output of at least
  :data:`LEND_MIN_BYTES` on the CPU (an out-of-place allreduce, an alltoall), *lent*: the output
  is a tensor over the buffer itself (``BufferPool.lend``), which returns to the pool when the last
  tensor over it is gone (no copy, and no fresh pages to fault in);
* persistent buffers (``register``): memory the caller keeps using, e.g. the DistributedOptimizer's
  gradient buckets, whose tensors are views into the segment, so no copy is needed at all.

Segments have no names (nothing in /dev/shm, nothing a crash can leave behind, no bound from
/dev/shm's size); their pages are reserved at creation, so a shortage of memory raises a
FastHorovodError naming the size here rather than a SIGBUS later. The memory is freed when the
last mapping — including any tensor view still alive — goes away, so closing never invalidates a
view.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fasthorovod import _C

_MIN_CLASS = 1 << 16
_POWERS_UP_TO = 1 << 20

# Outputs of at least this size are lent rather than copied out: above it a size class is at most
# 1.25 times the size it holds, so a lent output keeps at most a quarter more memory than it needs.
LEND_MIN_BYTES = _POWERS_UP_TO


def size_class(nbytes: int) -> int:
    """Rounds a request up to a pool size class: 64 KiB, powers of two up to 1 MiB, then quarters
    of the power of two below (1.25, 1.5, 1.75, 2 MiB, 2.5, 3, 3.5, 4 MiB, ...)."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if nbytes <= _POWERS_UP_TO:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class Buffer:
    """One shared-memory segment with a uint8 tensor view of all of it."""

    def __init__(self, buffer_id: int, shm: "_C.ShmBuffer", nbytes: int) -> None:
        self.id = buffer_id
        self.shm = shm
        self.bytes = torch.frombuffer(self.shm, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.nbytes = nbytes
        self.address = self.bytes.data_ptr()

    def view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset:offset + numel * itemsize].view(dtype)


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_sparse and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for staging, on this thread. Both contiguous CPU tensors of one dtype
    and size: a plain memory copy; anything else (another device, dtype or layout): torch's copy.
    torch's CPU copy of a large tensor runs on its intra-op thread pool, whose threads spin after
    every parallel region: with torch's default thread count they took the CPUs the proxies
    needed (a 4 MiB allreduce on the 5-host emulated cloud ran at 0.47 Gbit/s instead of 0.69;
    docs/dataplane.md, "Staging copies"). No autograd record either way: the collectives' autograd
    functions wrap these calls."""
    if _plain(dst) and _plain(src) and dst.dtype == src.dtype and dst.numel() == src.numel():
        nbytes = dst.numel() * dst.element_size()
        if nbytes:
            _C.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        with torch.no_grad():
            dst.copy_(src)


def zero_tensor(dst: torch.Tensor) -> None:
    """``dst.zero_()`` on this thread for a contiguous CPU tensor (see :func:`copy_tensor`)."""
    if _plain(dst):
        if dst.numel():
            _C.zero_bytes(dst.data_ptr(), dst.numel() * dst.element_size())
    else:
        with torch.no_grad():
            dst.zero_()


def unshared(buffer_id: int, nbytes: int) -> "_C.ShmBuffer":
    """A segment no proxy sees (for a pool without a channel, e.g. in unit tests)."""
    return _C.ShmBuffer(nbytes)


def stage(buffer: "Buffer", tensors: Sequence[torch.Tensor], contribute: bool = True) -> List[int]:
    """Copies `tensors` (zeros instead when not `contribute`) one after another into `buffer`;
    returns their byte offsets."""
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        staging = buffer.view(t.dtype, offset, t.numel())
        if contribute:
            copy_tensor(staging, t.reshape(-1))
        else:
            zero_tensor(staging)
        offset += t.numel() * t.element_size()
    return offsets


class BufferPool:
    def __init__(self, create: Callable[[int, int], "_C.ShmBuffer"] = unshared) -> None:
        """`create(id, nbytes)` makes the segment of a new buffer (``ProxyChannel.create_buffer``:
        every proxy holds it under `id` before a request can name it)."""
        self._create_segment = create
        self._lock = threading.RLock()  # a lent buffer comes back from a finalizer, on any thread
        self._next_id = 0
        self._free: Dict[int, List[Buffer]] = {}
        self._all: Dict[int, Buffer] = {}
        self._persistent: List[Buffer] = []

    def _create(self, nbytes: int) -> Buffer:
        buffer_id = self._next_id
        self._next_id += 1
        buf = Buffer(buffer_id, self._create_segment(buffer_id, nbytes), nbytes)
        self._all[buffer_id] = buf
        return buf

    def acquire(self, nbytes: int) -> Buffer:
        """A staging buffer of at least nbytes; give it back with :meth:`release`."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                return free.pop()
            return self._create(cls)

    def release(self, buf: Buffer) -> None:
        with self._lock:
            if buf.id in self._all:  # not after close(): a closed pool keeps nothing
                self._free.setdefault(size_class(buf.nbytes), []).append(buf)

    def lend(self, buf: Buffer, pieces: Sequence[Tuple[int, torch.dtype, Sequence[int]]]) -> List[torch.Tensor]:
        """Tensors over `buf` (acquired, holding results) for the caller to keep, one per piece
        (byte offset, dtype, shape): each owns its bytes of the segment, is no view of another
        tensor, and keeps the mapping alive. The buffer returns to the pool once every one of them
        (and every view of them) is gone; until then nothing else uses it."""
        if not pieces:
            self.release(buf)
            return []
        whole = memoryview(buf.shm)
        left = [len(pieces)]

        def returned() -> None:
            with self._lock:
                left[0] -= 1
                if left[0] == 0:
                    self.release(buf)

        tensors = []
        for offset, dtype, shape in pieces:
            numel = math.prod(shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if numel == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
                returned()
                continue
            # torch.frombuffer holds the memoryview while the tensor's storage lives; its finalizer
            # runs when the storage goes.
            span = whole[offset:offset + numel * itemsize]
            weakref.finalize(span, returned)
            storage = torch.frombuffer(span, dtype=dtype).untyped_storage()
            tensors.append(torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape)))
        return tensors

    def register(self, nbytes: int) -> Buffer:
        """A persistent buffer the caller owns for the life of the pool (never recycled)."""
        with self._lock:
            buf = self._create(nbytes)
            self._persistent.append(buf)
            return buf

    def locate(self, tensor: torch.Tensor) -> Optional[Tuple[Buffer, int]]:
        """(buffer, byte offset) if `tensor` lies inside a persistent buffer: zero-copy path."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for buf in self._persistent:
            if buf.address <= start and end <= buf.address + buf.nbytes:
                return buf, start - buf.address
        return None

    def close(self) -> None:
        """Forgets every buffer; mappings go away with the last reference (views stay valid)."""
        with self._lock:
            self._all.clear()
            self._free.clear()
            self._persistent.clear()
