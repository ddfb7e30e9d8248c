// AVX2 variant of rmsprop_step: the shared update template on eight lanes, the scalar one for the tail.
#include "kernels/ops.h"
#include "kernels/rmsprop.h"
#include "kernels/vec_avx2.h"

namespace tagps::kernels::detail {

namespace {

template <typename T>
void rmsprop_vec(const RmspropOptions<T>& o, const RmspropCoeffs<T>& c, size_t begin, size_t end) {
  const size_t i = rmsprop_apply<Avx2Ops<T>>(o, c, begin, end);
  rmsprop_apply<ScalarOps<T>>(o, c, i, end);
}

}  // namespace

void rmsprop_avx2(const RmspropOptions<float>& o, const RmspropCoeffs<float>& c, size_t begin, size_t end) {
  rmsprop_vec(o, c, begin, end);
}

void rmsprop_avx2(const RmspropOptions<double>& o, const RmspropCoeffs<double>& c, size_t begin, size_t end) {
  rmsprop_vec(o, c, begin, end);
}

}  // namespace tagps::kernels::detail
