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

template <typename T>
SgdCoeffs<T> sgd_coeffs(const SgdOptions<T>& o) {
  SgdCoeffs<T> c{};
  c.wd_on = o.weight_decay != 0.0;
  c.wd = static_cast<T>(o.weight_decay);
  c.momentum_on = o.momentum != 0.0;
  c.momentum = static_cast<T>(o.momentum);
  c.one_minus_dampening = static_cast<T>(1.0 - o.dampening);
  c.neg_lr = static_cast<T>(-o.lr);
  c.nesterov = o.nesterov;
  c.maximize = o.maximize;
  c.first_step = o.first_step;
  return c;
}

}  // namespace detail

namespace {

template <typename T>
void sgd_step_impl(const SgdOptions<T>& o) {
  if (o.count == 0) return;
  TAGPS_ENFORCE(o.param && o.grad, "sgd_step: null buffer");
  TAGPS_ENFORCE(o.momentum == 0.0 || o.momentum_buffer, "sgd_step: momentum != 0 needs momentum_buffer");
  const detail::SgdCoeffs<T> c = detail::sgd_coeffs(o);
  simd_parallel_for(
      o.count, kMinParallel, [&](auto begin, auto end) { detail::sgd_avx2(o, c, begin, end); },
      [&](auto begin, auto end) { detail::sgd_apply<detail::ScalarOps<T>>(o, c, begin, end); });
}

}  // namespace

void sgd_step(const SgdOptions<float>& options) { sgd_step_impl(options); }
void sgd_step(const SgdOptions<double>& options) { sgd_step_impl(options); }

}  // namespace tagps::kernels
