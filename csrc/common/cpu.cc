#include "common/cpu.h"

#include <omp.h>

#include <atomic>

#include "common/error.h"

namespace tagps {
namespace {

bool detect_avx2() {
#if defined(TAGPS_HAVE_AVX2_BUILD) && (defined(__x86_64__) || defined(__i386__))
  // __builtin_cpu_supports also checks that the OS saves the YMM registers (XCR0).
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<int> g_simd{detect_avx2() ? static_cast<int>(Simd::kAvx2) : static_cast<int>(Simd::kScalar)};
std::atomic<int> g_threads{0};

}  // namespace

bool cpu_has_avx2() {
  static const bool has = detect_avx2();
  return has;
}

Simd active_simd() { return static_cast<Simd>(g_simd.load(std::memory_order_relaxed)); }

const char* simd_name(Simd simd) { return simd == Simd::kAvx2 ? "avx2" : "scalar"; }

void set_simd_mode(const std::string& mode) {
  if (mode == "auto") {
    g_simd = static_cast<int>(cpu_has_avx2() ? Simd::kAvx2 : Simd::kScalar);
  } else if (mode == "avx2") {
    if (!cpu_has_avx2()) {
      throw Unsupported(
          "SIMD mode 'avx2' requested but this CPU or build lacks AVX2+FMA+F16C; use 'auto' or 'scalar'");
    }
    g_simd = static_cast<int>(Simd::kAvx2);
  } else if (mode == "scalar") {
    g_simd = static_cast<int>(Simd::kScalar);
  } else {
    throw InvalidArgument(detail::concat("SIMD mode must be 'auto', 'avx2' or 'scalar', got '", mode, "'"));
  }
}

void set_num_threads(int n) {
  TAGPS_ENFORCE_GE(n, 0, "number of threads (0 = all cores)");
  g_threads = n;
}

int num_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_num_procs();
}

}  // namespace tagps
