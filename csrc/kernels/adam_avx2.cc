// AVX2 variant of adam_step: the shared update template on eight lanes, the scalar template for the tail.
#include "kernels/adam.h"
#include "kernels/ops.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

void adam_avx2(const AdamOptions& o, const AdamCoeffs& c, size_t begin, size_t end) {
  const size_t i = adam_apply<Avx2Ops>(o, c, begin, end);
  adam_apply<ScalarOps>(o, c, i, end);
}

}  // namespace tagps::kernels::detail
