// Fused SGD step (momentum, dampening, Nesterov, weight decay) on float32 or float64 buffers with
// torch.optim.SGD's (single-tensor) semantics.
#pragma once

#include <cstddef>

namespace tagps::kernels {

template <typename T>
struct SgdOptions {
  T* param = nullptr;
  const T* grad = nullptr;
  T* momentum_buffer = nullptr;  // required when momentum != 0
  size_t count = 0;
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
  // The buffer holds no history yet: it is set to the gradient (torch clones the first gradient).
  bool first_step = false;
};

// One step, per element (g = -grad when maximize; fma where torch's add-with-alpha uses one):
//   g = fma(p, wd, g)
//   momentum != 0: buf = first_step ? g : fma(g, 1-dampening, buf*momentum)
//                  g = nesterov ? fma(buf, momentum, g) : buf
//   p = fma(g, -lr, p)
void sgd_step(const SgdOptions<float>& options);
void sgd_step(const SgdOptions<double>& options);

namespace detail {

template <typename T>
struct SgdCoeffs {
  T wd, momentum, one_minus_dampening, neg_lr;
  bool wd_on, momentum_on, nesterov, maximize, first_step;
};

template <typename T>
SgdCoeffs<T> sgd_coeffs(const SgdOptions<T>& o);

template <class Ops>
size_t sgd_apply(const SgdOptions<typename Ops::T>& o, const SgdCoeffs<typename Ops::T>& c, size_t begin,
                 size_t end) {
  using V = typename Ops::V;
  const V wd = Ops::set1(c.wd), momentum = Ops::set1(c.momentum);
  const V one_minus_dampening = Ops::set1(c.one_minus_dampening), neg_lr = Ops::set1(c.neg_lr);
  size_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
    V p = Ops::load(o.param + i);
    V g = Ops::load(o.grad + i);
    if (c.maximize) g = Ops::neg(g);
    if (c.wd_on) g = Ops::fmadd(p, wd, g);
    if (c.momentum_on) {
      const V buf = c.first_step ? g
                                 : Ops::fmadd(g, one_minus_dampening,
                                              Ops::mul(Ops::load(o.momentum_buffer + i), momentum));
      Ops::store(o.momentum_buffer + i, buf);
      g = c.nesterov ? Ops::fmadd(buf, momentum, g) : buf;
    }
    Ops::store(o.param + i, Ops::fmadd(g, neg_lr, p));
  }
  return i;
}

void sgd_avx2(const SgdOptions<float>& o, const SgdCoeffs<float>& c, size_t begin, size_t end);
void sgd_avx2(const SgdOptions<double>& o, const SgdCoeffs<double>& c, size_t begin, size_t end);

}  // namespace detail
}  // namespace tagps::kernels
