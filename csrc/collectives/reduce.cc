#include "collectives/reduce.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define FASTHOROVOD_F16C 1  // float16 conversions in hardware where the CPU has F16C (checked at run time)
#endif

namespace fasthorovod {
namespace {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
void SumPlain(void* dst, const void* src, size_t count) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] + s[i]);
}

// Integers wrap like the C types do: add as unsigned to avoid signed-overflow UB.
template <typename T, typename U>
void SumWrapping(void* dst, const void* src, size_t count) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (size_t i = 0; i < count; ++i) {
    d[i] = static_cast<T>(static_cast<U>(static_cast<U>(d[i]) + static_cast<U>(s[i])));
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void SumHalfLike(void* dst, const void* src, size_t count) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < count; ++i) d[i] = FromFloat(ToFloat(d[i]) + ToFloat(s[i]));
}

template <typename T>
void ScaleFloating(void* data, size_t count, double factor) {
  T* d = static_cast<T*>(data);
  const T f = static_cast<T>(factor);
  for (size_t i = 0; i < count; ++i) d[i] *= f;
}

template <typename T>
void ScaleInteger(void* data, size_t count, double factor) {
  T* d = static_cast<T*>(data);
  for (size_t i = 0; i < count; ++i) d[i] = static_cast<T>(std::trunc(static_cast<double>(d[i]) * factor));
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void ScaleHalfLike(void* data, size_t count, double factor) {
  uint16_t* d = static_cast<uint16_t*>(data);
  const float f = static_cast<float>(factor);
  for (size_t i = 0; i < count; ++i) d[i] = FromFloat(ToFloat(d[i]) * f);
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // inf, or nan made quiet (as the F16C instruction does)
    return BitsFloat(sign | 0x7f800000u | (mantissa != 0 ? 0x400000u : 0u) | (mantissa << 13));
  }
  if (exponent != 0) return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return BitsFloat(sign);  // signed zero
  // Subnormal half: value = mantissa * 2^-24, exact in float32.
  float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

uint16_t FloatToHalf(float f) {
  const uint32_t bits = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan (keep nan quiet and non-zero)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to nearest even.
    float magnitude = BitsFloat(abs);
    float scaled = magnitude * 16777216.0f;  // exact: power-of-two scaling
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  // Normal: drop 13 mantissa bits with round to nearest even; the carry may bump the exponent.
  uint32_t rebased = abs - (112u << 23);
  uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet nan
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void ReduceSum(DType dtype, void* dst, const void* src, size_t count) {
  switch (dtype) {
    case DType::kUInt8: return SumWrapping<uint8_t, uint8_t>(dst, src, count);
    case DType::kInt8: return SumWrapping<int8_t, uint8_t>(dst, src, count);
    case DType::kInt16: return SumWrapping<int16_t, uint16_t>(dst, src, count);
    case DType::kInt32: return SumWrapping<int32_t, uint32_t>(dst, src, count);
    case DType::kInt64: return SumWrapping<int64_t, uint64_t>(dst, src, count);
    case DType::kFloat16: return SumHalfLike<HalfToFloat, FloatToHalf>(dst, src, count);
    case DType::kBFloat16: return SumHalfLike<BFloat16ToFloat, FloatToBFloat16>(dst, src, count);
    case DType::kFloat32:
    case DType::kFloat32WireFloat16:
    case DType::kFloat32WireBFloat16: return SumPlain<float>(dst, src, count);
    case DType::kFloat64: return SumPlain<double>(dst, src, count);
  }
}

void Scale(DType dtype, void* data, size_t count, double factor) {
  if (factor == 1.0) return;
  switch (dtype) {
    case DType::kUInt8: return ScaleInteger<uint8_t>(data, count, factor);
    case DType::kInt8: return ScaleInteger<int8_t>(data, count, factor);
    case DType::kInt16: return ScaleInteger<int16_t>(data, count, factor);
    case DType::kInt32: return ScaleInteger<int32_t>(data, count, factor);
    case DType::kInt64: return ScaleInteger<int64_t>(data, count, factor);
    case DType::kFloat16: return ScaleHalfLike<HalfToFloat, FloatToHalf>(data, count, factor);
    case DType::kBFloat16: return ScaleHalfLike<BFloat16ToFloat, FloatToBFloat16>(data, count, factor);
    case DType::kFloat32:
    case DType::kFloat32WireFloat16:
    case DType::kFloat32WireBFloat16: return ScaleFloating<float>(data, count, factor);
    case DType::kFloat64: return ScaleFloating<double>(data, count, factor);
  }
}

namespace {

// The wire types' conversions as types, so that each loop below is compiled once per wire type
// with the conversion inlined.
struct Half {
  static float ToFloat(uint16_t h) { return HalfToFloat(h); }
  static uint16_t FromFloat(float f) { return FloatToHalf(f); }
};
struct BFloat16 {
  static float ToFloat(uint16_t b) { return BFloat16ToFloat(b); }
  static uint16_t FromFloat(float f) { return FloatToBFloat16(f); }
};

// Runs `loop` with the conversions of the 16-bit `wire` type (in software).
template <typename Loop>
void WithConversions(DType wire, Loop loop) {
  if (wire == DType::kBFloat16) {
    loop(BFloat16{});
  } else {
    loop(Half{});
  }
}


#ifdef FASTHOROVOD_F16C
// Eight elements an instruction, rounding to nearest even like FloatToHalf (which the tails use):
// the same bits for every input, NaNs included (tests/cpp/test_ring.cc compares them).
__attribute__((target("avx,f16c"))) void ToHalfF16c(uint16_t* d, const float* s, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) d[i] = FloatToHalf(s[i]);
}

template <bool kAdd>
__attribute__((target("avx,f16c"))) void FromHalfF16c(float* d, const uint16_t* s, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(d + i, kAdd ? _mm256_add_ps(_mm256_loadu_ps(d + i), v) : v);
  }
  for (; i < count; ++i) d[i] = kAdd ? d[i] + HalfToFloat(s[i]) : HalfToFloat(s[i]);
}

bool HardwareHalf(DType wire) {
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return wire != DType::kBFloat16 && f16c;
}
#else
bool HardwareHalf(DType) { return false; }
#endif

}  // namespace

void ToWire(DType wire, void* dst, const float* src, size_t count) {
  uint16_t* d = static_cast<uint16_t*>(dst);
#ifdef FASTHOROVOD_F16C
  if (HardwareHalf(wire)) return ToHalfF16c(d, src, count);
#endif
  WithConversions(wire, [&](auto type) {
    for (size_t i = 0; i < count; ++i) d[i] = type.FromFloat(src[i]);
  });
}

void FromWire(DType wire, float* dst, const void* src, size_t count) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
#ifdef FASTHOROVOD_F16C
  if (HardwareHalf(wire)) return FromHalfF16c<false>(dst, s, count);
#endif
  WithConversions(wire, [&](auto type) {
    for (size_t i = 0; i < count; ++i) dst[i] = type.ToFloat(s[i]);
  });
}

void AddFromWire(DType wire, float* dst, const void* src, size_t count) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
#ifdef FASTHOROVOD_F16C
  if (HardwareHalf(wire)) return FromHalfF16c<true>(dst, s, count);
#endif
  WithConversions(wire, [&](auto type) {
    for (size_t i = 0; i < count; ++i) dst[i] += type.ToFloat(s[i]);
  });
}

}  // namespace fasthorovod
