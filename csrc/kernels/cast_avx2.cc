// AVX2/F16C variant of cast: eight elements per iteration through the float32 register form of Vec<>,
// the scalar reference for the tail.
#include "kernels/cast.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {
namespace {

template <DType To, DType From>
void cast_vec(void* dst, const void* src, size_t begin, size_t end) {
  static_assert(Vec<To>::kWidth == 8 && Vec<From>::kWidth == 8, "float32 register form on both sides");
  auto* d = static_cast<typename Vec<To>::T*>(dst);
  const auto* s = static_cast<const typename Vec<From>::T*>(src);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m256 a = Vec<From>::load(s + i);
    const __m256 b = Vec<From>::load(s + i + 8);
    Vec<To>::store(d + i, a);
    Vec<To>::store(d + i + 8, b);
  }
  for (; i + 8 <= end; i += 8) Vec<To>::store(d + i, Vec<From>::load(s + i));
  cast_ref<To, From>(dst, src, i, end);
}

}  // namespace

void cast_avx2(DType to, DType from, void* dst, const void* src, size_t begin, size_t end) {
  visit_cast(to, from, [&](auto to_tag, auto from_tag) {
    cast_vec<decltype(to_tag)::value, decltype(from_tag)::value>(dst, src, begin, end);
  });
}

}  // namespace tagps::kernels::detail
