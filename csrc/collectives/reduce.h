// Element types and the reductions a ring hop applies.
//
// Sum is the only reduction the proxies run: Average is Sum followed by a postscale of 1/size,
// and Horovod's prescale/postscale factors are applied once per element (prescale to the local
// input before the first hop, postscale to each fully reduced chunk before it is allgathered).
//
// float16 and bfloat16 are added the way NCCL does: each hop converts both operands to float32,
// adds, and rounds the sum back to the wire type (round to nearest, ties to even). After a ring of
// n ranks an element has been rounded n-1 times, so its error against the exact sum is bounded by
// (n-1) * 2^-p * sum(|x_i|) with p = 11 (float16) or 8 (bfloat16) significand bits; see
// docs/dataplane.md. The compressed codes hold float32 in memory and are reduced and scaled as
// float32 here; only their wire is 16-bit (ToWire and friends). Integer sums wrap around like the integer types themselves; integer scaling
// multiplies in double and truncates toward zero.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace fasthorovod {

// dst[i] = dst[i] + src[i] for i < count.
void ReduceSum(DType dtype, void* dst, const void* src, size_t count);

// data[i] = data[i] * factor for i < count (see the rounding rules above).
void Scale(DType dtype, void* data, size_t count, double factor);

// The wire side of the compressed codes (kFloat32WireFloat16, kFloat32WireBFloat16; `wire` is their
// WireDType): float32 rounded to the 16-bit wire type (to nearest, ties to even), float32 from it,
// and float32 plus the wire values (the sum in float32).
void ToWire(DType wire, void* dst, const float* src, size_t count);
void FromWire(DType wire, float* dst, const void* src, size_t count);
void AddFromWire(DType wire, float* dst, const void* src, size_t count);

// IEEE half and bfloat16 conversions (exposed for tests).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace fasthorovod
