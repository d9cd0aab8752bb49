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
};
constexpr uint32_t kNumDTypes = 9;

bool DTypeValid(uint32_t dtype);
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

}  // namespace fasthorovod
