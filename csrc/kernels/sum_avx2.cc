// AVX2 variants of sum_into and scale: a vector loop (four vectors per iteration for the sum, so one
// iteration keeps four independent add chains in flight) plus the scalar reference for the tail.
#include "kernels/sum.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {
namespace {

template <DType D>
void sum_vec(void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t begin, size_t end) {
  using W = Vec<D>;
  using T = typename W::T;
  constexpr size_t w = W::kWidth;
  T* d = static_cast<T*>(dst);
  const T* f = static_cast<const T*>(first);
  size_t i = begin;
  for (; i + 4 * w <= end; i += 4 * w) {
    auto a0 = W::load(f + i), a1 = W::load(f + i + w);
    auto a2 = W::load(f + i + 2 * w), a3 = W::load(f + i + 3 * w);
    for (size_t k = 0; k < nsrc; ++k) {
      const T* s = static_cast<const T*>(srcs[k]) + i;
      a0 = W::add(a0, W::load(s));
      a1 = W::add(a1, W::load(s + w));
      a2 = W::add(a2, W::load(s + 2 * w));
      a3 = W::add(a3, W::load(s + 3 * w));
    }
    W::store(d + i, a0);
    W::store(d + i + w, a1);
    W::store(d + i + 2 * w, a2);
    W::store(d + i + 3 * w, a3);
  }
  for (; i + w <= end; i += w) {
    auto a = W::load(f + i);
    for (size_t k = 0; k < nsrc; ++k) a = W::add(a, W::load(static_cast<const T*>(srcs[k]) + i));
    W::store(d + i, a);
  }
  sum_ref<D>(dst, first, srcs, nsrc, i, end);
}

template <DType D>
void scale_vec(void* buf, double factor, size_t begin, size_t end) {
  const auto f = scale_factor<D>(factor);
  if constexpr (D == DType::kInt64) {
    scale_ref<D>(buf, f, begin, end);
  } else {
    using W = Vec<D>;
    constexpr size_t w = W::kWidth;
    auto* d = static_cast<typename W::T*>(buf);
    const auto fv = W::set1(f);
    size_t i = begin;
    for (; i + w <= end; i += w) W::store(d + i, W::mul(W::load(d + i), fv));
    scale_ref<D>(buf, f, i, end);
  }
}

}  // namespace

void sum_avx2(DType dtype, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t begin,
              size_t end) {
  visit_dtype(dtype, [&](auto tag) { sum_vec<decltype(tag)::value>(dst, first, srcs, nsrc, begin, end); });
}

void scale_avx2(DType dtype, void* buf, double factor, size_t begin, size_t end) {
  visit_dtype(dtype, [&](auto tag) { scale_vec<decltype(tag)::value>(buf, factor, begin, end); });
}

}  // namespace tagps::kernels::detail
