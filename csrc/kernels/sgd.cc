#include "kernels/sgd.h"

#include "common/cpu.h"
#include "common/error.h"
#include "common/parallel.h"
#include "kernels/ops.h"

namespace tagps::kernels {
namespace {

constexpr size_t kMinParallel = size_t{1} << 15;

}  // namespace

namespace detail {

SgdCoeffs sgd_coeffs(const SgdOptions& o) {
  SgdCoeffs c{};
  c.wd_on = o.weight_decay != 0.0;
  c.wd = static_cast<float>(o.weight_decay);
  c.momentum_on = o.momentum != 0.0;
  c.momentum = static_cast<float>(o.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - o.dampening);
  c.neg_lr = static_cast<float>(-o.lr);
  c.nesterov = o.nesterov;
  c.maximize = o.maximize;
  c.first_step = o.first_step;
  return c;
}

}  // namespace detail

void sgd_step(const SgdOptions& o) {
  if (o.count == 0) return;
  TAGPS_ENFORCE(o.param && o.grad, "sgd_step: null buffer");
  TAGPS_ENFORCE(o.momentum == 0.0 || o.momentum_buffer, "sgd_step: momentum != 0 needs momentum_buffer");
  const detail::SgdCoeffs c = detail::sgd_coeffs(o);
  [[maybe_unused]] const bool avx2 = active_simd() == Simd::kAvx2;
  parallel_for(o.count, kMinParallel, [&](size_t begin, size_t end) {
#if defined(TAGPS_HAVE_AVX2_BUILD)
    if (avx2) return detail::sgd_avx2(o, c, begin, end);
#endif
    detail::sgd_apply<detail::ScalarOps>(o, c, begin, end);
  });
}

}  // namespace tagps::kernels
