"""The ring schedule and the real TCP ring (ranks as threads over loopback, exactly as proxies run it)."""
import numpy as np
import pytest
import torch

import fasthorovod_testing
from fasthorovod import _C
from fasthorovod.proxy.core import DTYPE_CODES


@pytest.mark.parametrize("count,size", [(0, 3), (1, 4), (10, 3), (17, 4), (1000, 7)])
def test_chunks_cover_the_shard_exactly_and_spread_the_tail(count, size):
    bounds = [fasthorovod_testing.chunk_begin(count, size, c) for c in range(size + 1)]
    assert bounds[0] == 0 and bounds[-1] == count
    lengths = np.diff(bounds)
    assert lengths.min() >= 0 and lengths.max() - lengths.min() <= 1


def test_segment_count_keeps_one_frame_for_an_empty_chunk():
    assert fasthorovod_testing.segment_count(0, 16) == 1
    assert fasthorovod_testing.segment_count(16, 16) == 1
    assert fasthorovod_testing.segment_count(17, 16) == 2


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 5, 1023, 100_003])
@pytest.mark.parametrize("sockets", [1, 3])
def test_loopback_ring_sums_exactly(ranks, count, sockets):
    inputs = [np.random.default_rng(r).integers(-1000, 1000, count).astype(np.int64) for r in range(ranks)]
    buffers = [x.copy() for x in inputs]
    fasthorovod_testing._loopback_allreduce(buffers, DTYPE_CODES[torch.int64], segment_bytes=4096, sockets=sockets)
    expected = np.sum(inputs, axis=0) if count else np.zeros(0, np.int64)
    for buf in buffers:
        np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.uint8, torch.int8, torch.int16])
def test_loopback_ring_every_dtype(dtype):
    ranks, count = 3, 12_345
    inputs = [(torch.arange(count) % 5 + r).to(dtype) for r in range(ranks)]
    buffers = [t.clone().numpy() for t in inputs]
    fasthorovod_testing._loopback_allreduce(buffers, DTYPE_CODES[dtype], segment_bytes=1000)
    expected = sum(t.long() for t in inputs).to(dtype)
    for buf in buffers:
        assert torch.equal(torch.from_numpy(buf), expected)


def test_prescale_and_postscale_are_applied_once():
    ranks, count = 4, 10_001
    buffers = [np.full(count, r + 1, dtype=np.float64) for r in range(ranks)]
    fasthorovod_testing._loopback_allreduce(buffers, DTYPE_CODES[torch.float64], segment_bytes=512, prescale=2.0, postscale=0.25)
    for buf in buffers:
        np.testing.assert_array_equal(buf, np.full(count, 2.0 * 10 * 0.25))


def test_buffers_of_different_lengths_are_rejected():
    with pytest.raises(ValueError):
        fasthorovod_testing._loopback_allreduce([np.zeros(4, np.float32), np.zeros(5, np.float32)], DTYPE_CODES[torch.float32], 4096)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("width", [0, 1, 7, 40_000])
@pytest.mark.parametrize("sockets", [1, 2])
def test_loopback_ring_allgather_delivers_every_ranks_chunk_unchanged(ranks, width, sockets):
    """OP_GATHER: rank r contributes chunk allgather_own_chunk(r); afterwards every rank holds every
    rank's chunk bit for bit, and nothing is scaled (prescale/postscale are ignored)."""
    rows = [np.random.default_rng(r).integers(-2**31, 2**31 - 1, width, dtype=np.int64).astype(np.int32)
            for r in range(ranks)]
    buffers = []
    for r in range(ranks):
        buf = np.full(ranks * width, -1, np.int32)  # garbage where the other ranks' chunks will land
        own = _C.allgather_own_chunk(r, ranks)
        buf[own * width:(own + 1) * width] = rows[r]
        buffers.append(buf)
    fasthorovod_testing._loopback_allreduce(buffers, DTYPE_CODES[torch.int32], segment_bytes=4096, sockets=sockets,
                           prescale=3.0, postscale=0.5, op=_C.OP_GATHER)
    expected = np.concatenate([rows[(c - 1) % ranks] for c in range(ranks)]) if width else np.zeros(0, np.int32)
    for buf in buffers:
        np.testing.assert_array_equal(buf, expected)


def test_unknown_ring_op_is_rejected():
    with pytest.raises(ValueError, match="op must be"):
        fasthorovod_testing._loopback_allreduce([np.zeros(4, np.int32)] * 2, DTYPE_CODES[torch.int32], 4096, op=7)
