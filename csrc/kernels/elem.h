// Scalar element traits shared by the reference kernels and the scalar tails of the AVX2 variants:
// storage type T, accumulation type A (float for float16/bfloat16, unsigned for integers so that overflow
// wraps like numpy instead of being undefined), and the load/store conversions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "common/half.h"

namespace tagps::kernels::detail {

template <DType D>
struct Elem;

template <>
struct Elem<DType::kFloat32> {
  using T = float;
  using A = float;
  static A load(T x) { return x; }
  static T store(A x) { return x; }
};

template <>
struct Elem<DType::kFloat64> {
  using T = double;
  using A = double;
  static A load(T x) { return x; }
  static T store(A x) { return x; }
};

template <>
struct Elem<DType::kFloat16> {
  using T = uint16_t;
  using A = float;
  static A load(T x) { return half_to_float(x); }
  static T store(A x) { return float_to_half(x); }
};

template <>
struct Elem<DType::kBFloat16> {
  using T = uint16_t;
  using A = float;
  static A load(T x) { return bf16_to_float(x); }
  static T store(A x) { return float_to_bf16(x); }
};

template <>
struct Elem<DType::kInt32> {
  using T = int32_t;
  using A = uint32_t;
  static A load(T x) { return static_cast<A>(x); }
  static T store(A x) { return static_cast<T>(x); }
};

template <>
struct Elem<DType::kInt64> {
  using T = int64_t;
  using A = uint64_t;
  static A load(T x) { return static_cast<A>(x); }
  static T store(A x) { return static_cast<T>(x); }
};

// Calls fn(std::integral_constant<DType, D>{}) for the runtime dtype, so a generic lambda can take the
// dtype as a compile-time constant: [&](auto tag) { constexpr DType D = decltype(tag)::value; ... }.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(std::integral_constant<DType, DType::kFloat32>{});
    case DType::kFloat64:
      return fn(std::integral_constant<DType, DType::kFloat64>{});
    case DType::kFloat16:
      return fn(std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16:
      return fn(std::integral_constant<DType, DType::kBFloat16>{});
    case DType::kInt32:
      return fn(std::integral_constant<DType, DType::kInt32>{});
    case DType::kInt64:
      break;
  }
  return fn(std::integral_constant<DType, DType::kInt64>{});
}

}  // namespace tagps::kernels::detail
