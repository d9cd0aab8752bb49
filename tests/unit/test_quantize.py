"""The 2-bit quantizer (csrc/collectives/quantize.cc via fasthorovod._C): MXNet's rule and bit
layout, exact error feedback, dequantize-and-sum."""
import numpy as np
import pytest
import torch

from fasthorovod import _C
from fasthorovod.scheduler import TwoBitCompression, dequantize_sum_2bit, quantize_2bit

POS = [0xC0, 0x30, 0x0C, 0x03]
NEG = [0x80, 0x20, 0x08, 0x02]


def reference_quantize(grad, residual, threshold):
    """MXNet's quantize_2bit, element by element, in float32: returns (words, new residual)."""
    grad = np.asarray(grad, dtype=np.float32)
    r = np.asarray(residual, dtype=np.float32).copy()
    t = np.float32(threshold)
    nbytes = 4 * ((grad.size + 15) // 16)
    out = bytearray(nbytes)
    for i in range(grad.size):
        r[i] = np.float32(r[i] + grad[i])
        j = i % 16
        byte = 4 * (i // 16) + j // 4
        if r[i] >= t:
            out[byte] |= POS[j % 4]
            r[i] = np.float32(r[i] - t)
        elif r[i] <= -t:
            out[byte] |= NEG[j % 4]
            r[i] = np.float32(r[i] + t)
    return np.frombuffer(bytes(out), dtype=np.int32), r


def reference_dequantize(words, count, threshold):
    raw = np.asarray(words, dtype=np.int32).tobytes()
    out = np.zeros(count, dtype=np.float32)
    for i in range(count):
        j = i % 16
        byte = raw[4 * (i // 16) + j // 4]
        pair = byte & POS[j % 4]
        out[i] = threshold if pair == POS[j % 4] else (-threshold if pair == NEG[j % 4] else 0.0)
    return out


def dyadic(count, seed, scale=1.0):
    """Multiples of 2^-8 in [-scale, scale]: every sum below is exact in float32."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-256, 257, size=count) / 256.0 * scale).astype(np.float32)


@pytest.mark.parametrize("count", [1, 3, 15, 16, 17, 33, 1000])
def test_words_and_residual_match_mxnet_rule_bit_for_bit(count):
    grad = dyadic(count, seed=count)
    residual = dyadic(count, seed=count + 1, scale=0.25)
    words_ref, residual_ref = reference_quantize(grad, residual, 0.5)
    r = torch.from_numpy(residual.copy())
    words = quantize_2bit(torch.from_numpy(grad), r, 0.5)
    assert words.dtype == torch.int32 and words.numel() == (count + 15) // 16
    assert np.array_equal(words.numpy(), words_ref)
    assert np.array_equal(r.numpy(), residual_ref)


def test_known_layout():
    # +t, -t, 0, +t in the first byte: 11 10 00 11 = 0xe3; value 4 (-t) opens the second byte: 10 = 0x80.
    grad = torch.tensor([1.0, -1.0, 0.0, 0.75, -0.5], dtype=torch.float32)
    words = quantize_2bit(grad, torch.zeros(5), 0.5)
    assert bytes(words.numpy().tobytes()) == bytes([0xE3, 0x80, 0x00, 0x00])
    out = torch.empty(5)
    dequantize_sum_2bit(words, out, 0.5)
    assert out.tolist() == [0.5, -0.5, 0.0, 0.5, -0.5]


@pytest.mark.parametrize("count", [5, 16, 100, 70_000])  # 70 000: the GIL-released path
def test_pack_unpack_round_trip(count):
    rng = np.random.default_rng(count)
    values = rng.choice(np.array([-0.25, 0.0, 0.25], dtype=np.float32), size=count)
    # With a zero residual, exactly ±t reaches the threshold: the payload decodes to `values`.
    residual = torch.zeros(count)
    words = quantize_2bit(torch.from_numpy(values), residual, 0.25)
    assert torch.count_nonzero(residual) == 0
    out = torch.empty(count)
    dequantize_sum_2bit(words, out, 0.25)
    assert np.array_equal(out.numpy(), values)
    if count < 1000:
        assert np.array_equal(reference_dequantize(words.numpy(), count, 0.25), values)


def test_bits_beyond_count_are_zero():
    words = quantize_2bit(torch.ones(17), torch.zeros(17), 0.5)  # 17 values: 2 words
    raw = words.numpy().tobytes()
    assert raw[:4] == b"\xff\xff\xff\xff" and raw[4:] == b"\xc0\x00\x00\x00"


@pytest.mark.parametrize("threshold", [0.5, 0.125])
def test_error_feedback_conserves_mass_exactly(threshold):
    """Σ sent + residual == Σ inputs after every step (dyadic inputs: float32 sums are exact)."""
    count, steps = 4000, 40
    residual = torch.zeros(count)
    sent_total = np.zeros(count, dtype=np.float64)
    input_total = np.zeros(count, dtype=np.float64)
    out = torch.empty(count)
    for step in range(steps):
        grad = dyadic(count, seed=step, scale=0.375)
        input_total += grad
        words = quantize_2bit(torch.from_numpy(grad), residual, threshold)
        dequantize_sum_2bit(words, out, threshold)
        sent_total += out.numpy()
        assert np.array_equal(sent_total + residual.numpy().astype(np.float64), input_total), step
    assert np.count_nonzero(sent_total) > count // 2  # it did send


def test_dequantize_sum_of_payloads_is_scaled_count_and_order_free():
    count, n = 1000, 5
    payloads = []
    expected = np.zeros(count, dtype=np.float32)
    for p in range(n):
        values = dyadic(count, seed=50 + p)
        payloads.append(quantize_2bit(torch.from_numpy(values), torch.zeros(count), 0.5))
        expected += reference_dequantize(payloads[-1].numpy(), count, 0.5)
    stacked = torch.stack(payloads)
    out = torch.empty(count)
    dequantize_sum_2bit(stacked, out, 0.5, scale=0.25)
    assert np.array_equal(out.numpy(), expected * np.float32(0.25))
    reversed_out = torch.empty(count)
    dequantize_sum_2bit(stacked.flip(0), reversed_out, 0.5, scale=0.25)
    assert torch.equal(out, reversed_out)


def test_bad_arguments_raise_value_error():
    g, r = torch.zeros(32), torch.zeros(32)
    with pytest.raises(ValueError, match="threshold"):
        quantize_2bit(g, r, 0.0)
    with pytest.raises(ValueError, match="float32"):
        quantize_2bit(g.double(), r, 0.5)
    with pytest.raises(ValueError, match="residual"):
        quantize_2bit(g, torch.zeros(31), 0.5)
    with pytest.raises(ValueError, match="words"):
        _C.quantize_2bit(g.numpy(), r.numpy(), np.zeros(3, dtype=np.int32), 0.5)
    with pytest.raises(ValueError, match="4-byte"):
        _C.quantize_2bit(g.numpy(), r.numpy(), np.zeros(2, dtype=np.int64), 0.5)
    with pytest.raises(ValueError, match="words"):
        dequantize_sum_2bit(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(32), 0.5)
    with pytest.raises(ValueError, match="C-contiguous"):
        _C.dequantize_sum_2bit(np.zeros((4, 2), dtype=np.int32).T, np.zeros(32, dtype=np.float32), 0.5, 1.0)


def test_two_bit_compression_is_not_an_allreduce_compressor():
    c = TwoBitCompression(threshold=0.25)
    assert c.threshold == 0.25
    with pytest.raises(TypeError, match="allgather"):
        c.compress(torch.zeros(4))
    with pytest.raises(ValueError, match="threshold"):
        TwoBitCompression(threshold=-1)
