// 2-bit quantization with error feedback; see quantize.h for the rule and the bit layout.
#include "collectives/quantize.h"

#include <array>
#include <cstring>

namespace fasthorovod {
namespace {

// Bit pair of value j (0..3) inside its byte: +t sets both bits, -t only the upper one.
constexpr uint8_t kPositiveBits[4] = {0xc0, 0x30, 0x0c, 0x03};
constexpr uint8_t kNegativeBits[4] = {0x80, 0x20, 0x08, 0x02};

// The four values (+1, -1 or 0) that one byte of a payload encodes.
struct DecodeTable {
  std::array<std::array<int8_t, 4>, 256> values{};
  DecodeTable() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t pair = static_cast<uint8_t>(byte) & kPositiveBits[j];
        values[byte][j] = pair == kPositiveBits[j] ? 1 : (pair == kNegativeBits[j] ? -1 : 0);
      }
    }
  }
};

const DecodeTable& Decoder() {
  static const DecodeTable table;
  return table;
}

}  // namespace

void Quantize2Bit(const float* grad, float* residual, size_t count, float threshold, uint32_t* packed) {
  const float neg_threshold = -threshold;
  const size_t words = PackedWords2Bit(count);
  for (size_t w = 0; w < words; ++w) {
    const size_t begin = w * kValuesPerWord2Bit;
    const size_t end = begin + kValuesPerWord2Bit < count ? begin + kValuesPerWord2Bit : count;
    uint8_t bytes[4] = {0, 0, 0, 0};
    for (size_t i = begin; i < end; ++i) {
      const size_t j = i - begin;
      float r = residual[i] + grad[i];
      if (r >= threshold) {
        bytes[j >> 2] |= kPositiveBits[j & 3];
        r -= threshold;
      } else if (r <= neg_threshold) {
        bytes[j >> 2] |= kNegativeBits[j & 3];
        r += threshold;
      }
      residual[i] = r;
    }
    std::memcpy(&packed[w], bytes, sizeof(bytes));
  }
}

void DequantizeSum2Bit(const uint32_t* payloads, size_t num_payloads, size_t words_per_payload, size_t count,
                       float threshold, float scale, float* out) {
  const DecodeTable& decoder = Decoder();
  const float step = threshold * scale;
  const size_t words = PackedWords2Bit(count);
  for (size_t w = 0; w < words; ++w) {
    // Per element of this block: (#payloads that sent +t) - (#payloads that sent -t).
    int32_t counts[kValuesPerWord2Bit] = {};
    for (size_t p = 0; p < num_payloads; ++p) {
      uint8_t bytes[4];
      std::memcpy(bytes, &payloads[p * words_per_payload + w], sizeof(bytes));
      for (size_t b = 0; b < 4; ++b) {
        const auto& v = decoder.values[bytes[b]];
        counts[4 * b + 0] += v[0];
        counts[4 * b + 1] += v[1];
        counts[4 * b + 2] += v[2];
        counts[4 * b + 3] += v[3];
      }
    }
    const size_t begin = w * kValuesPerWord2Bit;
    const size_t n = begin + kValuesPerWord2Bit < count ? kValuesPerWord2Bit : count - begin;
    for (size_t j = 0; j < n; ++j) out[begin + j] = static_cast<float>(counts[j]) * step;
  }
}

}  // namespace fasthorovod
