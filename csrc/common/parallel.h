// Splits an element range across OpenMP threads when it is large enough to pay for the fork.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>

#include "common/cpu.h"

namespace tagps {

// Chunk sizes are multiples of this many elements (a multiple of every vector width, and of 64 bytes
// for all dtypes), so every chunk starts on the same alignment as the whole array.
inline constexpr size_t kChunkAlign = 64;

// Calls fn(begin, end) over disjoint chunks covering [0, n): one call on the calling thread when
// n < min_parallel or one thread is configured; otherwise OpenMP threads take chunks of at least
// min_parallel / 2 elements, about kChunksPerThread per thread, from a shared queue (dynamic schedule).
// Many small chunks instead of one per thread keep a thread that the OS deschedules (the machine is
// shared with torch's and other processes' threads) from holding up the whole call: the others take its
// remaining chunks. fn must not throw (validate before calling).
inline constexpr size_t kChunksPerThread = 8;

template <typename Fn>
void parallel_for(size_t n, size_t min_parallel, const Fn& fn) {
  const size_t threads = static_cast<size_t>(num_threads());
  if (n < min_parallel || threads <= 1) {
    if (n > 0) fn(size_t{0}, n);
    return;
  }
  size_t chunk = std::max<size_t>(min_parallel / 2, n / (threads * kChunksPerThread));
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const size_t chunks = (n + chunk - 1) / chunk;
  const int team = static_cast<int>(std::min(threads, chunks));
  const long long count = static_cast<long long>(chunks);
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
  for (long long c = 0; c < count; ++c) {
    const size_t begin = static_cast<size_t>(c) * chunk;
    fn(begin, std::min(n, begin + chunk));
  }
}

// parallel_for over one elementwise kernel with two implementations: every chunk runs avx2(begin, end)
// when the AVX2 path is active (tagps.kernels.set_simd_mode), else scalar(begin, end). The choice is made
// once per call, so a call never mixes the paths. Pass generic lambdas (auto begin, auto end): a build
// without the *_avx2.cc files (non-x86) then never instantiates the avx2 one.
template <typename Avx2Fn, typename ScalarFn>
void simd_parallel_for(size_t n, size_t min_parallel, const Avx2Fn& avx2, const ScalarFn& scalar) {
#if defined(TAGPS_HAVE_AVX2_BUILD)
  if (active_simd() == Simd::kAvx2) return parallel_for(n, min_parallel, avx2);
#endif
  parallel_for(n, min_parallel, scalar);
}

}  // namespace tagps
