"""The proxies' element types and reductions, checked against numpy/torch and a float64 reference."""
import numpy as np
import pytest
import torch

import fasthorovod_testing
from fasthorovod.proxy.core import DTYPE_CODES

F16, BF16, F32 = DTYPE_CODES[torch.float16], DTYPE_CODES[torch.bfloat16], DTYPE_CODES[torch.float32]


def _as_u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def test_float16_sum_rounds_like_numpy_for_all_pairs_of_a_sample():
    rng = np.random.default_rng(0)
    # Every half value (incl. subnormals, inf, nan) against random partners.
    a = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    b = rng.standard_normal(a.size).astype(np.float16) * np.float16(100)
    dst = a.copy()
    fasthorovod_testing.reduce_sum(F16, dst, b)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    same = (dst.view(np.uint16) == expected.view(np.uint16)) | (np.isnan(dst) & np.isnan(expected))
    assert same.all(), np.flatnonzero(~same)[:10]


def test_float16_subnormals_and_overflow_round_to_nearest_even():
    values = np.array([6e-8, 3e-8, 65504, 65519, 65520, -65520, 1e-4, 2.0 ** -24 * 1.5], dtype=np.float32)
    with np.errstate(over="ignore"):
        halves = values.astype(np.float16)
    dst = np.zeros_like(halves)
    fasthorovod_testing.reduce_sum(F16, dst, halves)
    assert (dst.view(np.uint16) == halves.view(np.uint16)).all()
    big = np.array([65504, 65504], dtype=np.float16)
    fasthorovod_testing.reduce_sum(F16, big, np.array([16, 8], dtype=np.float16))
    assert np.isinf(big[0]) and big[1] == 65504  # 65520 rounds up to inf, 65512 down (ties to even)


def test_bfloat16_sum_matches_torch_rounding():
    torch.manual_seed(0)
    a = torch.randn(100_000).mul_(1000).to(torch.bfloat16)
    b = torch.randn(100_000).to(torch.bfloat16)
    dst = a.clone()
    fasthorovod_testing.reduce_sum(BF16, _as_u16(dst), _as_u16(b))
    expected = (a.float() + b.float()).to(torch.bfloat16)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_sum_wraps_like_torch(dtype):
    info = torch.iinfo(dtype)
    a = torch.tensor([info.max, info.min, 0, 5], dtype=dtype)
    b = torch.tensor([1, -1 if info.min < 0 else 1, info.max, 7], dtype=dtype)
    dst = a.clone()
    fasthorovod_testing.reduce_sum(DTYPE_CODES[dtype], dst.numpy(), b.numpy())
    assert torch.equal(dst, a + b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ring_error_of_half_types_is_within_the_documented_bound(dtype, ranks):
    """Each hop rounds once: |result − exact| ≤ (ranks − 1) · 2^−p · Σ|x_i| (docs/dataplane.md)."""
    torch.manual_seed(ranks)
    count = 50_000
    inputs = [torch.randn(count).to(dtype) for _ in range(ranks)]
    buffers = [_as_u16(t.clone()) for t in inputs]
    fasthorovod_testing._loopback_allreduce(buffers, DTYPE_CODES[dtype], segment_bytes=8192)
    exact = torch.stack([t.double() for t in inputs]).sum(0)
    magnitude = torch.stack([t.double().abs() for t in inputs]).sum(0)
    unit = 2.0 ** -(11 if dtype == torch.float16 else 8)
    for buf in buffers:
        result = torch.from_numpy(buf.view(np.int16)).view(dtype).double()
        assert ((result - exact).abs() <= (ranks - 1) * unit * magnitude + 1e-12).all()
    assert all((b == buffers[0]).all() for b in buffers), "every rank must hold the same bits"


def test_scale_integers_truncate_and_floats_multiply():
    ints = np.array([7, -7, 3], dtype=np.int32)
    fasthorovod_testing.scale(DTYPE_CODES[torch.int32], ints, 0.5)
    assert ints.tolist() == [3, -3, 1]
    floats = np.array([1.0, -2.0, 3.0], dtype=np.float64)
    fasthorovod_testing.scale(DTYPE_CODES[torch.float64], floats, 0.25)
    assert floats.tolist() == [0.25, -0.5, 0.75]


def test_bad_dtype_code_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        fasthorovod_testing.reduce_sum(99, np.zeros(1, np.float32), np.zeros(1, np.float32))
