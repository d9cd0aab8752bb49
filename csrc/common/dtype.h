// Element types of the data plane. The values are part of the shared-memory and wire formats.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fasthorovod {

// Values are part of the shared-memory and wire formats: append only.
enum class DType : uint32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  // float32 in memory, a 16-bit type on the wire: fp16 (or bf16) compression done by the proxies.
  // Each hop sends its float32 partial sums rounded to the wire type and adds what arrives in
  // float32 (collectives/ring.cc); DTypeSize is the memory size.
  kFloat32WireFloat16 = 9,
  kFloat32WireBFloat16 = 10,
};
constexpr uint32_t kNumDTypes = 11;

bool DTypeValid(uint32_t dtype);
size_t DTypeSize(DType dtype);  // bytes per element in memory
const char* DTypeName(DType dtype);
// The type of the elements on the wire: the 16-bit type for the compressed codes, else dtype itself.
DType WireDType(DType dtype);
// Whether dtype is a compressed code (float32 in memory, WireDType on the wire).
inline bool WireCompressed(DType dtype) {
  return dtype == DType::kFloat32WireFloat16 || dtype == DType::kFloat32WireBFloat16;
}

}  // namespace fasthorovod
