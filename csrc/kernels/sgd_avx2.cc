// AVX2 variant of sgd_step: the shared update template on eight lanes, the scalar one for the tail.
#include "kernels/ops.h"
#include "kernels/sgd.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

void sgd_avx2(const SgdOptions& o, const SgdCoeffs& c, size_t begin, size_t end) {
  const size_t i = sgd_apply<Avx2Ops>(o, c, begin, end);
  sgd_apply<ScalarOps>(o, c, i, end);
}

}  // namespace tagps::kernels::detail
