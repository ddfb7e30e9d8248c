#include "kernels/sum.h"

#include <cmath>

#include "common/cpu.h"
#include "common/error.h"
#include "common/parallel.h"

namespace tagps::kernels {
namespace {

// Below this many elements the OpenMP fork costs more than it saves.
constexpr size_t kMinParallel = size_t{1} << 16;

}  // namespace

void sum_into(const SumOptions& o) {
  dtype_size(o.dtype);  // throws InvalidType for an unknown dtype
  const void* first = o.first != nullptr ? o.first : o.dst;
  if (o.count == 0 || (o.srcs.empty() && first == o.dst)) return;
  TAGPS_ENFORCE(o.dst != nullptr, "sum_into: dst is null");
  for (const void* s : o.srcs) TAGPS_ENFORCE(s != nullptr, "sum_into: a source is null");
  const void* const* srcs = o.srcs.data();
  const size_t nsrc = o.srcs.size();
  detail::visit_dtype(o.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    simd_parallel_for(
        o.count, kMinParallel,
        [&](auto begin, auto end) { detail::sum_avx2(D, o.dst, first, srcs, nsrc, begin, end); },
        [&](auto begin, auto end) { detail::sum_ref<D>(o.dst, first, srcs, nsrc, begin, end); });
  });
}

void scale(const ScaleOptions& o) {
  dtype_size(o.dtype);
  if (o.dtype == DType::kInt32 || o.dtype == DType::kInt64) {
    TAGPS_ENFORCE(std::isfinite(o.factor) && std::trunc(o.factor) == o.factor &&
                      o.factor >= -9.2233720368547758e18 && o.factor < 9.2233720368547758e18,
                  "scale: an integer buffer needs an integral factor in the int64 range, got ", o.factor);
  }
  if (o.count == 0) return;
  TAGPS_ENFORCE(o.buf != nullptr, "scale: buf is null");
  detail::visit_dtype(o.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    const auto factor = detail::scale_factor<D>(o.factor);
    simd_parallel_for(
        o.count, kMinParallel,
        [&](auto begin, auto end) { detail::scale_avx2(D, o.buf, o.factor, begin, end); },
        [&](auto begin, auto end) { detail::scale_ref<D>(o.buf, factor, begin, end); });
  });
}

}  // namespace tagps::kernels
