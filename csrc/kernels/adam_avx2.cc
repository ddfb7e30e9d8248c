// AVX2 variant of adam_step: the shared update template on eight lanes, the scalar template for the tail.
#include "kernels/adam.h"
#include "kernels/ops.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

namespace {

template <typename T>
void adam_vec(const AdamOptions<T>& o, const AdamCoeffs<T>& c, size_t begin, size_t end) {
  const size_t i = adam_apply<Avx2Ops<T>>(o, c, begin, end);
  adam_apply<ScalarOps<T>>(o, c, i, end);
}

}  // namespace

void adam_avx2(const AdamOptions<float>& o, const AdamCoeffs<float>& c, size_t begin, size_t end) {
  adam_vec(o, c, begin, end);
}

void adam_avx2(const AdamOptions<double>& o, const AdamCoeffs<double>& c, size_t begin, size_t end) {
  adam_vec(o, c, begin, end);
}

}  // namespace tagps::kernels::detail
