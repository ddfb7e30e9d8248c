// AVX2 variant of rmsprop_step: the shared update template on eight lanes, the scalar one for the tail.
#include "kernels/ops.h"
#include "kernels/rmsprop.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

void rmsprop_avx2(const RmspropOptions& o, const RmspropCoeffs& c, size_t begin, size_t end) {
  const size_t i = rmsprop_apply<Avx2Ops>(o, c, begin, end);
  rmsprop_apply<ScalarOps>(o, c, i, end);
}

}  // namespace tagps::kernels::detail
