// Element-wise float32/float64 operations with one lane. The optimizer updates are written once as
// templates over an "ops" type; instantiated with ScalarOps they are the portable reference, with
// Avx2Ops (vec_avx2.h) the vector loop. Both issue the same correctly rounded IEEE operations in the same
// order (no approximate reciprocal or square root; fmadd is a true fused multiply-add on both, std::fma
// and vfmadd), so the two paths give bitwise equal results. fmadd is used exactly where torch's
// vectorized CPU kernels fuse (add with alpha, lerp, addcmul), which keeps the updates within rounding
// of torch.optim.
#pragma once

#include <cmath>
#include <cstddef>


namespace tagps::kernels::detail {

template <typename E>
struct ScalarOps {
  using T = E;
  using V = E;
  static constexpr size_t kWidth = 1;
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V set1(T x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  // a * b + c, rounded once.
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  // IEEE negation flips the sign bit (what torch's neg does, NaN included).
  static V neg(V a) { return -a; }
  // max that propagates NaN like torch.maximum.
  static V max_nan(V a, V b) { return std::isnan(a) ? a : (a > b ? a : b); }
};

}  // namespace tagps::kernels::detail
