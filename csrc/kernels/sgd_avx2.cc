// AVX2 variant of sgd_step: the shared update template on eight lanes, the scalar one for the tail.
#include "kernels/ops.h"
#include "kernels/sgd.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

namespace {

template <typename T>
void sgd_vec(const SgdOptions<T>& o, const SgdCoeffs<T>& c, size_t begin, size_t end) {
  const size_t i = sgd_apply<Avx2Ops<T>>(o, c, begin, end);
  sgd_apply<ScalarOps<T>>(o, c, i, end);
}

}  // namespace

void sgd_avx2(const SgdOptions<float>& o, const SgdCoeffs<float>& c, size_t begin, size_t end) {
  sgd_vec(o, c, begin, end);
}

void sgd_avx2(const SgdOptions<double>& o, const SgdCoeffs<double>& c, size_t begin, size_t end) {
  sgd_vec(o, c, begin, end);
}

}  // namespace tagps::kernels::detail
