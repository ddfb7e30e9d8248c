#include "kernels/rmsprop.h"

#include <cmath>

#include "common/cpu.h"
#include "common/error.h"
#include "common/parallel.h"
#include "kernels/ops.h"

namespace tagps::kernels {
namespace {

constexpr size_t kMinParallel = size_t{1} << 15;

}  // namespace

namespace detail {

template <typename T>
RmspropCoeffs<T> rmsprop_coeffs(const RmspropOptions<T>& o) {
  RmspropCoeffs<T> c{};
  c.wd_on = o.weight_decay != 0.0;
  c.wd = static_cast<T>(o.weight_decay);
  c.alpha = static_cast<T>(o.alpha);
  c.one_minus_alpha = static_cast<T>(1.0 - o.alpha);  // also the lerp weight of grad_avg
  c.lerp_small = std::fabs(c.one_minus_alpha) < T{0.5};
  c.lerp_w_minus_one = c.one_minus_alpha - T{1};
  c.eps = static_cast<T>(o.eps);
  c.momentum_on = o.momentum > 0.0;
  c.momentum = static_cast<T>(o.momentum);
  c.neg_lr = static_cast<T>(-o.lr);
  c.centered = o.centered;
  c.maximize = o.maximize;
  return c;
}

}  // namespace detail

namespace {

template <typename T>
void rmsprop_step_impl(const RmspropOptions<T>& o) {
  if (o.count == 0) return;
  TAGPS_ENFORCE(o.param && o.grad && o.square_avg, "rmsprop_step: null buffer");
  TAGPS_ENFORCE(!(o.momentum > 0.0) || o.momentum_buffer, "rmsprop_step: momentum > 0 needs momentum_buffer");
  TAGPS_ENFORCE(!o.centered || o.grad_avg, "rmsprop_step: centered needs grad_avg");
  const detail::RmspropCoeffs<T> c = detail::rmsprop_coeffs(o);
  simd_parallel_for(
      o.count, kMinParallel, [&](auto begin, auto end) { detail::rmsprop_avx2(o, c, begin, end); },
      [&](auto begin, auto end) { detail::rmsprop_apply<detail::ScalarOps<T>>(o, c, begin, end); });
}

}  // namespace

void rmsprop_step(const RmspropOptions<float>& options) { rmsprop_step_impl(options); }
void rmsprop_step(const RmspropOptions<double>& options) { rmsprop_step_impl(options); }

}  // namespace tagps::kernels
