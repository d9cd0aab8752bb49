"""The one error path: every native error kind arrives in Python as its own exception class.

The multi-process kinds (a timeout from a frozen proxy, a dead proxy, a dead peer, a collective
mismatch) are checked with real ranks in tests/multiproc/test_faults.py and test_dataplane.py;
here the table itself and the errors a single process can provoke.
"""

import pytest
import torch

import fasthorovod_testing
from fasthorovod import _C
from fasthorovod import exceptions as ex
from fasthorovod.proxy.core import DTYPE_CODES, request


def test_every_native_error_kind_has_its_class():
    expected = {
        "invalid_argument": ex.FastHorovodValueError,
        "timeout": ex.FastHorovodTimeoutError,
        "mismatch": ex.CollectiveMismatchError,
        "proxy_died": ex.ProxyDiedError,
        "io_error": ex.FastHorovodError,
        "aborted": ex.FastHorovodError,
        "peer_error": ex.FastHorovodError,
    }
    assert set(_C.ERROR_CODES) == set(expected)
    for code, cls in expected.items():
        error = ex.error_for(code, f"a {code}")
        assert type(error) is cls and str(error) == f"a {code}"
        assert isinstance(error, ex.FastHorovodError)


def test_the_family_is_horovods_internal_error_and_invalid_arguments_are_value_errors():
    from horovod.common.exceptions import HorovodInternalError

    assert issubclass(ex.FastHorovodError, HorovodInternalError)
    assert issubclass(ex.FastHorovodValueError, ValueError)
    assert not issubclass(ex.FastHorovodTimeoutError, ValueError)


def _config(num_lanes):
    c = _C.ChannelConfig()
    c.num_lanes, c.rank, c.size, c.token = num_lanes, 0, 2, b"\x01" * 16
    c.bind_host = "127.0.0.1"
    return c


def test_invalid_arguments_raise_the_value_error_of_the_family():
    with pytest.raises(ex.FastHorovodValueError, match=r"number of proxies must be in \[1, 64\], got 0"):
        _C.ProxyChannel(_config(0))
    with pytest.raises(ex.FastHorovodValueError, match="lane_begin needs 2 to 65 boundaries, got 1"):
        request(lane_begin=[0])
    with pytest.raises(ex.FastHorovodValueError, match="invalid dtype"):
        fasthorovod_testing.scale(99, bytearray(8), 2.0)


def test_a_request_that_does_not_fit_the_channel_is_refused_before_it_is_posted():
    channel = _C.ProxyChannel(_config(2))
    with pytest.raises(ex.FastHorovodValueError, match="3 lanes? .*channel has 2 lanes"):
        channel.post(request(count=9, lane_begin=[0, 3, 6, 9]))
    with pytest.raises(ex.FastHorovodValueError, match="must not decrease"):
        channel.post(request(count=9, lane_begin=[0, 10, 9]))
    with pytest.raises(ex.FastHorovodValueError, match="from 0 to the element count"):
        channel.post(request(count=9, lane_begin=[0, 4, 8]))


def test_request_struct_round_trips_and_dtype_codes_come_from_the_core():
    r = request(count=10, dtype=_C.DTYPES["bfloat16"], op=_C.OP_AVERAGE, name="grad.fc1", lane_begin=[0, 4, 10],
                prescale=0.5, postscale=0.25)
    assert (r.count, r.op, r.name, r.lane_begin, r.prescale, r.postscale) == (10, _C.OP_AVERAGE, "grad.fc1",
                                                                            [0, 4, 10], 0.5, 0.25)
    assert DTYPE_CODES[torch.bfloat16] == _C.DTYPES["bfloat16"] and len(DTYPE_CODES) == 9
    assert all(fasthorovod_testing.dtype_size(code) == torch.empty((), dtype=dt).element_size() for dt, code in DTYPE_CODES.items())
