// Fused Adam / AdamW step on float32 or float64 buffers with torch.optim.Adam's (single-tensor) semantics
// and order of operations.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tagps::kernels {

template <typename T>
struct AdamOptions {
  T* param = nullptr;
  const T* grad = nullptr;
  T* exp_avg = nullptr;
  T* exp_avg_sq = nullptr;
  T* max_exp_avg_sq = nullptr;  // required when amsgrad
  size_t count = 0;
  int64_t step = 1;  // 1-based step count (after this update), for bias correction
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  // AdamW
};

// One step, per element (g = -grad when maximize; constants rounded to T as torch does):
//   AdamW: p *= 1 - lr*wd             Adam: g = fma(p, wd, g)
//   m = fma(1-beta1, g - m, m)         (torch's lerp; fma(-beta1, g - m, g) when 1-beta1 >= 0.5)
//   v = fma((1-beta2)*g, g, v*beta2)  (torch's addcmul)
//   amsgrad: vmax = max(vmax, v), use vmax for v below
//   p = p + (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps),  bc_k = 1 - beta_k^step
void adam_step(const AdamOptions<float>& options);
void adam_step(const AdamOptions<double>& options);

namespace detail {

template <typename T>
struct AdamCoeffs {
  T decay, wd, w, w_minus_one, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  bool decay_on, wd_on, lerp_small, amsgrad, maximize;
};

template <typename T>
AdamCoeffs<T> adam_coeffs(const AdamOptions<T>& o);

// Updates elements [begin, end) in steps of Ops::kWidth and returns where it stopped (end for ScalarOps).
template <class Ops>
size_t adam_apply(const AdamOptions<typename Ops::T>& o, const AdamCoeffs<typename Ops::T>& c, size_t begin,
                  size_t end) {
  using V = typename Ops::V;
  const V decay = Ops::set1(c.decay), wd = Ops::set1(c.wd), w = Ops::set1(c.w);
  const V w_minus_one = Ops::set1(c.w_minus_one), beta2 = Ops::set1(c.beta2);
  const V one_minus_beta2 = Ops::set1(c.one_minus_beta2), bc2_sqrt = Ops::set1(c.bc2_sqrt);
  const V eps = Ops::set1(c.eps), neg_step_size = Ops::set1(c.neg_step_size);
  size_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
    V p = Ops::load(o.param + i);
    V g = Ops::load(o.grad + i);
    if (c.maximize) g = Ops::neg(g);
    if (c.decay_on) p = Ops::mul(p, decay);
    if (c.wd_on) g = Ops::fmadd(p, wd, g);
    V m = Ops::load(o.exp_avg + i);
    m = c.lerp_small ? Ops::fmadd(w, Ops::sub(g, m), m) : Ops::fmadd(w_minus_one, Ops::sub(g, m), g);
    const V v = Ops::fmadd(Ops::mul(one_minus_beta2, g), g, Ops::mul(Ops::load(o.exp_avg_sq + i), beta2));
    V s = v;
    if (c.amsgrad) {
      s = Ops::max_nan(Ops::load(o.max_exp_avg_sq + i), v);
      Ops::store(o.max_exp_avg_sq + i, s);
    }
    const V denom = Ops::add(Ops::div(Ops::sqrt(s), bc2_sqrt), eps);
    p = Ops::add(p, Ops::div(Ops::mul(neg_step_size, m), denom));
    Ops::store(o.param + i, p);
    Ops::store(o.exp_avg + i, m);
    Ops::store(o.exp_avg_sq + i, v);
  }
  return i;
}

void adam_avx2(const AdamOptions<float>& o, const AdamCoeffs<float>& c, size_t begin, size_t end);
void adam_avx2(const AdamOptions<double>& o, const AdamCoeffs<double>& c, size_t begin, size_t end);

}  // namespace detail
}  // namespace tagps::kernels
