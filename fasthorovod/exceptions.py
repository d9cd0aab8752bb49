"""One exception family for every failure of the proxy data plane.

``FastHorovodError`` subclasses Horovod's ``HorovodInternalError`` (itself a ``RuntimeError``), so
code that catches Horovod's error — Horovod elastic among it — treats a failed proxy, a dead peer
or a timeout as the recoverable communication failure it is. The native core raises these classes
by name (csrc/bindings/module.cc).
"""
from horovod.common.exceptions import HorovodInternalError


class FastHorovodError(HorovodInternalError):
    """A proxy, a peer rank or a connection failed; every waiting handle raises it."""


class FastHorovodTimeoutError(FastHorovodError):
    """Nothing moved for FASTHOROVOD_TIMEOUT_SECONDS (a peer is stopped, dead or elsewhere)."""


class CollectiveMismatchError(FastHorovodError):
    """Ranks issued different large collectives (order, name, shape, dtype or op)."""
