// 2-bit gradient quantization with error feedback (MXNet's "2bit" gradient compression).
//
// A worker keeps a residual r (one float per gradient element, zero at first). To send a
// gradient g with threshold t > 0 it accumulates, then emits at most one step of size t:
//
//     r <- r + g
//     if r >= t:  send +t,  r <- r - t
//     elif r <= -t: send -t,  r <- r + t
//     else:       send 0
//
// so nothing is lost, only delayed: after any number of calls, (sum of everything sent) +
// r == (sum of every g) + r_initial, exactly whenever the float additions involved are exact
// (tests use dyadic values). Each value travels as two bits, sixteen values per 32-bit word, in
// MXNet's layout: value j of a block of 16 lives in byte j / 4 of the word, in the bit pair
// selected by j % 4 from the most significant end (masks 0xc0, 0x30, 0x0c, 0x03); the pair is
// 11 for +t, 10 for -t and 00 for 0 (01 never occurs and also decodes to 0). Words are defined
// byte by byte, so the format does not depend on the machine's endianness. The bits of a last,
// partial block beyond `count` are zero.
//
// Quantized payloads cannot be added as 2-bit numbers, so a collective gathers every rank's
// packed words and each rank dequantizes and sums them itself (DequantizeSum2Bit). That sum
// counts, per element, how many payloads sent +t and how many sent -t, and multiplies once: the
// result is count * (t * scale) with one rounding, independent of the order of the payloads, and
// bit-identical on every rank.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fasthorovod {

constexpr size_t kValuesPerWord2Bit = 16;

// Number of 32-bit words that hold `count` 2-bit values.
constexpr size_t PackedWords2Bit(size_t count) { return (count + kValuesPerWord2Bit - 1) / kValuesPerWord2Bit; }

// Quantizes grad[0, count) into packed[0, PackedWords2Bit(count)) and updates residual[0, count)
// in place (the rule above). `threshold` must be > 0. `grad` may alias `residual`'s storage only
// if the caller no longer needs the gradient (the residual is read, then written).
void Quantize2Bit(const float* grad, float* residual, size_t count, float threshold, uint32_t* packed);

// out[i] = scale * sum over p < num_payloads of decode(payloads[p * words_per_payload ...])[i],
// for i < count, where decode maps a value's bits to +threshold, -threshold or 0. Payloads are
// consecutive rows of `words_per_payload` words (>= PackedWords2Bit(count)); `out` is overwritten.
void DequantizeSum2Bit(const uint32_t* payloads, size_t num_payloads, size_t words_per_payload, size_t count,
                       float threshold, float scale, float* out);

}  // namespace fasthorovod
