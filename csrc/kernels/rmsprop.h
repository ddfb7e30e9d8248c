// Fused RMSprop step on float32 or float64 buffers with torch.optim.RMSprop's (single-tensor) semantics
// and order of operations.
#pragma once

#include <cstddef>

namespace tagps::kernels {

template <typename T>
struct RmspropOptions {
  T* param = nullptr;
  const T* grad = nullptr;
  T* square_avg = nullptr;
  T* momentum_buffer = nullptr;  // required when momentum > 0
  T* grad_avg = nullptr;         // required when centered
  size_t count = 0;
  double lr = 1e-2;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  bool centered = false;
  bool maximize = false;
};

// One step, per element (g = -grad when maximize):
//   g = fma(p, wd, g);  sq = fma((1-alpha)*g, g, sq*alpha)
//   centered: ga = fma(1-alpha, g - ga, ga); avg = sqrt(fma(-ga, ga, sq)) + eps   else sqrt(sq) + eps
//   momentum > 0: buf = buf*momentum + g/avg; p = fma(buf, -lr, p)          else p = p + (-lr*g)/avg
void rmsprop_step(const RmspropOptions<float>& options);
void rmsprop_step(const RmspropOptions<double>& options);

namespace detail {

template <typename T>
struct RmspropCoeffs {
  T wd, alpha, one_minus_alpha, lerp_w_minus_one, eps, momentum, neg_lr;
  bool wd_on, centered, lerp_small, momentum_on, maximize;
};

template <typename T>
RmspropCoeffs<T> rmsprop_coeffs(const RmspropOptions<T>& o);

template <class Ops>
size_t rmsprop_apply(const RmspropOptions<typename Ops::T>& o, const RmspropCoeffs<typename Ops::T>& c,
                     size_t begin, size_t end) {
  using V = typename Ops::V;
  const V wd = Ops::set1(c.wd), alpha = Ops::set1(c.alpha), one_minus_alpha = Ops::set1(c.one_minus_alpha);
  const V lerp_w_minus_one = Ops::set1(c.lerp_w_minus_one), eps = Ops::set1(c.eps);
  const V momentum = Ops::set1(c.momentum), neg_lr = Ops::set1(c.neg_lr);
  size_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
    V p = Ops::load(o.param + i);
    V g = Ops::load(o.grad + i);
    if (c.maximize) g = Ops::neg(g);
    if (c.wd_on) g = Ops::fmadd(p, wd, g);
    const V sq = Ops::fmadd(Ops::mul(one_minus_alpha, g), g, Ops::mul(Ops::load(o.square_avg + i), alpha));
    Ops::store(o.square_avg + i, sq);
    V avg;
    if (c.centered) {
      V ga = Ops::load(o.grad_avg + i);
      ga = c.lerp_small ? Ops::fmadd(one_minus_alpha, Ops::sub(g, ga), ga)
                        : Ops::fmadd(lerp_w_minus_one, Ops::sub(g, ga), g);
      Ops::store(o.grad_avg + i, ga);
      avg = Ops::sqrt(Ops::fmadd(Ops::neg(ga), ga, sq));
    } else {
      avg = Ops::sqrt(sq);
    }
    avg = Ops::add(avg, eps);
    if (c.momentum_on) {
      const V buf = Ops::add(Ops::mul(Ops::load(o.momentum_buffer + i), momentum), Ops::div(g, avg));
      Ops::store(o.momentum_buffer + i, buf);
      p = Ops::fmadd(buf, neg_lr, p);
    } else {
      p = Ops::add(p, Ops::div(Ops::mul(neg_lr, g), avg));
    }
    Ops::store(o.param + i, p);
  }
  return i;
}

void rmsprop_avx2(const RmspropOptions<float>& o, const RmspropCoeffs<float>& c, size_t begin, size_t end);
void rmsprop_avx2(const RmspropOptions<double>& o, const RmspropCoeffs<double>& c, size_t begin, size_t end);

}  // namespace detail
}  // namespace tagps::kernels
