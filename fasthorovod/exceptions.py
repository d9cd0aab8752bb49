"""One exception family for every failure of the proxy data plane, chosen by the kind of failure.

``FastHorovodError`` subclasses Horovod's ``HorovodInternalError`` (itself a ``RuntimeError``), so
code that catches Horovod's error — Horovod elastic among it — treats a failed proxy, a dead peer
or a timeout as the recoverable communication failure it is.

The native core carries a code with every error, from the socket where it happened (abort frames
carry it between ranks, shared memory from a proxy to its worker) to the binding edge, which calls
:func:`error_for` with the code's name: the class is chosen from the code alone, never from the
message text.
"""
from horovod.common.exceptions import HorovodInternalError


class FastHorovodError(HorovodInternalError):
    """A proxy, a peer rank or a connection failed; every waiting handle raises it."""


class FastHorovodTimeoutError(FastHorovodError):
    """Nothing moved for FASTHOROVOD_TIMEOUT_SECONDS (a peer is stopped, dead or elsewhere)."""


class CollectiveMismatchError(FastHorovodError):
    """Ranks issued different large collectives (order, name, shape, dtype or op)."""


class ProxyDiedError(FastHorovodError):
    """One of this worker's own proxy processes exited (killed or crashed)."""


class FastHorovodValueError(FastHorovodError, ValueError):
    """An argument the data plane cannot take (also a ``ValueError``, as Python's convention asks)."""


# Code names as csrc/common/status.h CodeName() spells them; codes not listed are FastHorovodError.
_CLASS_BY_CODE = {
    "timeout": FastHorovodTimeoutError,
    "mismatch": CollectiveMismatchError,
    "invalid_argument": FastHorovodValueError,
    "proxy_died": ProxyDiedError,
}


def error_for(code: str, message: str) -> FastHorovodError:
    """The exception for a native error of kind `code` (a name from ``fasthorovod._C.ERROR_CODES``)."""
    return _CLASS_BY_CODE.get(code, FastHorovodError)(message)
