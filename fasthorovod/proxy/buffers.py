"""Shared-memory buffers that proxies can read and write in place.

Two kinds, one mechanism (a :class:`ShmBuffer` segment named ``<prefix>.<id>``):

* staging buffers, pooled by size class: an allreduce of an ordinary tensor copies it in, the
  proxies reduce it in place, and the result is copied out;
* persistent buffers (``register``): memory the caller keeps using, e.g. the DistributedOptimizer's
  gradient buckets, whose tensors are views into the segment, so no copy is needed at all.

Names are unlinked from /dev/shm as soon as every proxy has mapped the segment (after its first
completed request) and at close; the memory itself is freed when the last mapping — including any
tensor view still alive — goes away, so closing never invalidates a view.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

from fasthorovod import _C

_MIN_CLASS = 1 << 16
_LARGE_STEP = 16 << 20


def size_class(nbytes: int) -> int:
    """Rounds a request up to a pool size class (powers of two, then multiples of 16 MiB)."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if nbytes <= _LARGE_STEP:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // _LARGE_STEP) * _LARGE_STEP


class Buffer:
    """One shared-memory segment with a uint8 tensor view of all of it."""

    def __init__(self, buffer_id: int, name: str, nbytes: int) -> None:
        self.id = buffer_id
        self.shm = _C.ShmBuffer(name, nbytes)
        self.bytes = torch.frombuffer(self.shm, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.nbytes = nbytes
        self.address = self.bytes.data_ptr()

    def view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset:offset + numel * itemsize].view(dtype)


class BufferPool:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._next_id = 0
        self._free: Dict[int, List[Buffer]] = {}
        self._all: Dict[int, Buffer] = {}
        self._persistent: List[Buffer] = []

    def _create(self, nbytes: int) -> Buffer:
        buffer_id = self._next_id
        self._next_id += 1
        buf = Buffer(buffer_id, f"{self._prefix}.{buffer_id}", nbytes)
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
            self._free.setdefault(size_class(buf.nbytes), []).append(buf)

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

    @staticmethod
    def mapped_by_proxies(buf: Buffer) -> None:
        """Every proxy has mapped `buf` (a request on it completed): drop its name."""
        if buf.shm.linked:
            buf.shm.unlink()

    def close(self) -> None:
        """Unlinks every name; mappings go away with the last reference (views stay valid)."""
        with self._lock:
            for buf in self._all.values():
                buf.shm.unlink()
            self._all.clear()
            self._free.clear()
            self._persistent.clear()
