#include "common/dtype.h"

namespace fasthorovod {

bool DTypeValid(uint32_t dtype) { return dtype < kNumDTypes; }

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kInt16:
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32:
    case DType::kFloat32:
    case DType::kFloat32WireFloat16:
    case DType::kFloat32WireBFloat16: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat32WireFloat16: return "float32 as float16 on the wire";
    case DType::kFloat32WireBFloat16: return "float32 as bfloat16 on the wire";
  }
  return "invalid";
}

DType WireDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32WireFloat16: return DType::kFloat16;
    case DType::kFloat32WireBFloat16: return DType::kBFloat16;
    default: return dtype;
  }
}

}  // namespace fasthorovod
