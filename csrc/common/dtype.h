// Element types the kernels handle. float16/bfloat16 are stored as uint16_t bit patterns.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tagps {

enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

// Bytes per element.
size_t dtype_size(DType dtype);
// "float32", "bfloat16", ...
const char* dtype_name(DType dtype);
// Converts the integer code the bindings receive; throws InvalidType for an unknown code.
DType dtype_from_code(int code);

}  // namespace tagps
