#include "kernels/adam.h"

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
AdamCoeffs<T> adam_coeffs(const AdamOptions<T>& o) {
  // Python-side float arithmetic in double, then the rounding to T torch applies to scalar operands.
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(o.step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(o.step));
  AdamCoeffs<T> c{};
  c.decay_on = o.weight_decay != 0.0 && o.decoupled_weight_decay;
  c.wd_on = o.weight_decay != 0.0 && !o.decoupled_weight_decay;
  c.decay = static_cast<T>(1.0 - o.lr * o.weight_decay);
  c.wd = static_cast<T>(o.weight_decay);
  c.w = static_cast<T>(1.0 - o.beta1);
  c.w_minus_one = c.w - T{1};  // torch's lerp computes weight - 1 in the tensor's type
  c.lerp_small = std::fabs(c.w) < T{0.5};
  c.beta2 = static_cast<T>(o.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - o.beta2);
  c.bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  c.eps = static_cast<T>(o.eps);
  c.neg_step_size = static_cast<T>(-(o.lr / bc1));
  c.amsgrad = o.amsgrad;
  c.maximize = o.maximize;
  return c;
}

}  // namespace detail

namespace {

template <typename T>
void adam_step_impl(const AdamOptions<T>& o) {
  TAGPS_ENFORCE_GE(o.step, int64_t{1}, "adam_step: step is 1-based");
  if (o.count == 0) return;
  TAGPS_ENFORCE(o.param && o.grad && o.exp_avg && o.exp_avg_sq, "adam_step: null buffer");
  TAGPS_ENFORCE(!o.amsgrad || o.max_exp_avg_sq, "adam_step: amsgrad needs max_exp_avg_sq");
  const detail::AdamCoeffs<T> c = detail::adam_coeffs(o);
  simd_parallel_for(
      o.count, kMinParallel, [&](auto begin, auto end) { detail::adam_avx2(o, c, begin, end); },
      [&](auto begin, auto end) { detail::adam_apply<detail::ScalarOps<T>>(o, c, begin, end); });
}

}  // namespace

void adam_step(const AdamOptions<float>& options) { adam_step_impl(options); }
void adam_step(const AdamOptions<double>& options) { adam_step_impl(options); }

}  // namespace tagps::kernels
