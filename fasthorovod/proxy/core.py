"""What the data plane hands the C++ core: its dtype and op codes, its request structs, name hashes.

One table of dtypes, in C++ (``_C.DTYPES``); everything above asks ``ProxyGroup.supports(dtype)``.
"""
from __future__ import annotations

import hashlib

import torch

from fasthorovod import _C

# torch dtype -> the core's dtype code, from the names the core exports (one table, in C++).
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPES.items()}
# (dtype in memory, dtype on the wire) -> the code of that compression done by the proxies: float32
# whose hops carry float16 or bfloat16 and add in float32 (docs/dataplane.md)
WIRE_CODES = {(getattr(torch, memory), getattr(torch, wire)): code for (memory, wire), code in _C.WIRE_DTYPES.items()}
OP_SUM, OP_AVERAGE, OP_GATHER, OP_BROADCAST = _C.OP_SUM, _C.OP_AVERAGE, _C.OP_GATHER, _C.OP_BROADCAST
OP_REDUCESCATTER, OP_ALLTOALL = _C.OP_REDUCESCATTER, _C.OP_ALLTOALL

# A broadcast travels as a sum of the tensor's bytes read as integers of the element's width
# (ProxyGroup.broadcast): the integer dtype for each element size.
BROADCAST_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def hash64(text: str) -> int:
    """The 64-bit hash the negotiation compares for a tensor's name and description."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def native(cls, **fields):
    """An instance of the bound struct `cls` (``_C.Request``, ``_C.ChannelConfig``, ...) with `fields`
    set; the rest keep the core's defaults."""
    obj = cls()
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


def request(**fields) -> "_C.Request":
    """A ``_C.Request`` with `fields` set."""
    return native(_C.Request, **fields)
