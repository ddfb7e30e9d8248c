#include "kernels/cast.h"

#include "common/cpu.h"
#include "common/error.h"
#include "common/parallel.h"

namespace tagps::kernels {
namespace {

constexpr size_t kMinParallel = size_t{1} << 16;

}  // namespace

void cast(const CastOptions& o) {
  detail::visit_cast(o.dst_dtype, o.src_dtype, [&](auto to_tag, auto from_tag) {
    constexpr DType To = decltype(to_tag)::value;
    constexpr DType From = decltype(from_tag)::value;
    if (o.count == 0) return;
    TAGPS_ENFORCE(o.dst != nullptr && o.src != nullptr, "cast: null buffer");
    simd_parallel_for(
        o.count, kMinParallel,
        [&](auto begin, auto end) { detail::cast_avx2(To, From, o.dst, o.src, begin, end); },
        [&](auto begin, auto end) { detail::cast_ref<To, From>(o.dst, o.src, begin, end); });
  });
}

}  // namespace tagps::kernels
