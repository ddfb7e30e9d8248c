// N-way in-place summation and scaling of contiguous buffers (the summation service's inner loops).
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"
#include "kernels/elem.h"

namespace tagps::kernels {

struct SumOptions {
  DType dtype = DType::kFloat32;
  void* dst = nullptr;
  // Each source holds `count` elements of `dtype`. A source may be dst itself (exact alias); a partial
  // overlap with dst is the caller's error (tagps.kernels rejects it).
  std::vector<const void*> srcs;
  size_t count = 0;
  // The first term, `count` elements that dst itself or no source overlaps; null: dst (in place). Out of
  // place, dst is only written: a sum into a fresh buffer moves one row less than a copy and a sum.
  const void* first = nullptr;
};

// dst[i] = (((first[i] + srcs[0][i]) + srcs[1][i]) + ...) with first = dst unless given, reading every
// input once. float16/bfloat16 accumulate in float32 and round once; integers wrap. The scalar and AVX2
// paths add in the same order, so their results are bitwise equal.
void sum_into(const SumOptions& options);

struct ScaleOptions {
  DType dtype = DType::kFloat32;
  void* buf = nullptr;
  size_t count = 0;
  // Rounded to the dtype's accumulation type (float for float16/bfloat16/float32); integer dtypes need an
  // integral factor in the int64 range and wrap on overflow.
  double factor = 1.0;
};

// buf[i] *= factor.
void scale(const ScaleOptions& options);

namespace detail {

// Elements per block of the scalar sum; the block's accumulators stay in L1.
inline constexpr size_t kSumBlock = 256;

// Scalar reference over [begin, end): the order of additions per element is first, srcs[0], srcs[1], ...
template <DType D>
void sum_ref(void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t begin, size_t end) {
  using E = Elem<D>;
  using T = typename E::T;
  using A = typename E::A;
  T* d = static_cast<T*>(dst);
  const T* f = static_cast<const T*>(first);
  A acc[kSumBlock];
  for (size_t b = begin; b < end; b += kSumBlock) {
    const size_t len = end - b < kSumBlock ? end - b : kSumBlock;
    for (size_t j = 0; j < len; ++j) acc[j] = E::load(f[b + j]);
    for (size_t k = 0; k < nsrc; ++k) {
      const T* s = static_cast<const T*>(srcs[k]) + b;
      for (size_t j = 0; j < len; ++j) acc[j] += E::load(s[j]);
    }
    for (size_t j = 0; j < len; ++j) d[b + j] = E::store(acc[j]);
  }
}

// Scalar reference of scale over [begin, end); `factor` is already in the accumulation type.
template <DType D>
void scale_ref(void* buf, typename Elem<D>::A factor, size_t begin, size_t end) {
  using E = Elem<D>;
  auto* d = static_cast<typename E::T*>(buf);
  for (size_t i = begin; i < end; ++i) d[i] = E::store(E::load(d[i]) * factor);
}

// AVX2 variants (sum_avx2.cc), same contract as the references.
void sum_avx2(DType dtype, void* dst, const void* first, const void* const* srcs, size_t nsrc, size_t begin,
              size_t end);
void scale_avx2(DType dtype, void* buf, double factor, size_t begin, size_t end);

// Converts a scale factor to the accumulation type of D (integral factors checked by scale()).
template <DType D>
typename Elem<D>::A scale_factor(double factor) {
  using A = typename Elem<D>::A;
  if constexpr (D == DType::kInt32 || D == DType::kInt64) {
    return static_cast<A>(static_cast<int64_t>(factor));
  } else {
    return static_cast<A>(factor);
  }
}

}  // namespace detail
}  // namespace tagps::kernels
