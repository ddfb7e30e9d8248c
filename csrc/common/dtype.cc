#include "common/dtype.h"

#include "common/error.h"

namespace tagps {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  throw InvalidType(detail::concat("unknown dtype code ", static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

DType dtype_from_code(int code) {
  if (code < 0 || code > static_cast<int>(DType::kInt64)) {
    throw InvalidType(detail::concat("unknown dtype code ", code));
  }
  return static_cast<DType>(code);
}

}  // namespace tagps
