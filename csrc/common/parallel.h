// Splits an element range across OpenMP threads when it is large enough to pay for the fork.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>

#include "common/cpu.h"

namespace tagps {

// Chunk boundaries are multiples of this many elements (a multiple of every vector width, and of 64
// bytes for all dtypes), so every chunk but the last starts on the same alignment as the whole array.
inline constexpr size_t kChunkAlign = 64;

// Calls fn(begin, end) over disjoint chunks covering [0, n): one call on the calling thread when
// n < min_parallel or one thread is configured, else one contiguous chunk per OpenMP thread, each at
// least min_parallel / 2 elements. fn must not throw (validate before calling).
template <typename Fn>
void parallel_for(size_t n, size_t min_parallel, const Fn& fn) {
  const size_t threads = static_cast<size_t>(num_threads());
  if (n < min_parallel || threads <= 1) {
    if (n > 0) fn(size_t{0}, n);
    return;
  }
  const size_t useful = std::max<size_t>(1, n / std::max<size_t>(1, min_parallel / 2));
  const int team = static_cast<int>(std::min(threads, useful));
#pragma omp parallel num_threads(team)
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    const size_t nt = static_cast<size_t>(omp_get_num_threads());
    size_t per = (n + nt - 1) / nt;
    per = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const size_t begin = std::min(n, t * per);
    const size_t end = std::min(n, begin + per);
    if (begin < end) fn(begin, end);
  }
}

}  // namespace tagps
