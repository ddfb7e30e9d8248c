// Conversions between float32 and the 16-bit float formats (round-to-nearest-even).
#pragma once

#include <cstddef>

#include "common/dtype.h"
#include "common/error.h"
#include "kernels/elem.h"

namespace tagps::kernels {

struct CastOptions {
  DType dst_dtype = DType::kFloat16;
  DType src_dtype = DType::kFloat32;
  void* dst = nullptr;
  const void* src = nullptr;  // must not overlap dst
  size_t count = 0;
};

// dst[i] = src[i] converted. Supported pairs: float32 -> float16, float32 -> bfloat16, float16 -> float32,
// bfloat16 -> float32; others throw InvalidType. Narrowing rounds to nearest even (float16 overflows to
// inf; bfloat16 NaN becomes 0x7FC0 as in torch); widening is exact.
void cast(const CastOptions& options);

namespace detail {

template <DType To, DType From>
void cast_ref(void* dst, const void* src, size_t begin, size_t end) {
  auto* d = static_cast<typename Elem<To>::T*>(dst);
  const auto* s = static_cast<const typename Elem<From>::T*>(src);
  for (size_t i = begin; i < end; ++i) d[i] = Elem<To>::store(Elem<From>::load(s[i]));
}

void cast_avx2(DType to, DType from, void* dst, const void* src, size_t begin, size_t end);

// Calls fn(to_tag, from_tag) for a supported pair; throws InvalidType for any other.
template <typename Fn>
void visit_cast(DType to, DType from, Fn&& fn) {
  using C = std::integral_constant<DType, DType::kFloat32>;
  using H = std::integral_constant<DType, DType::kFloat16>;
  using B = std::integral_constant<DType, DType::kBFloat16>;
  if (to == DType::kFloat16 && from == DType::kFloat32) return fn(H{}, C{});
  if (to == DType::kBFloat16 && from == DType::kFloat32) return fn(B{}, C{});
  if (to == DType::kFloat32 && from == DType::kFloat16) return fn(C{}, H{});
  if (to == DType::kFloat32 && from == DType::kBFloat16) return fn(C{}, B{});
  throw InvalidType(::tagps::detail::concat("cast from ", dtype_name(from), " to ", dtype_name(to),
                                            " is not supported (float32 <-> float16/bfloat16 only)"));
}

}  // namespace detail
}  // namespace tagps::kernels
