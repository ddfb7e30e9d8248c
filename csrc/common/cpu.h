// CPU feature detection and the process-wide kernel settings (SIMD path, thread count).
// The settings are set from Python (tagps.kernels reads tagps.config); the core never reads the
// environment itself.
#pragma once

#include <string>

namespace tagps {

enum class Simd : int { kScalar = 0, kAvx2 = 1 };

// True when the library was built with the AVX2 variants and the CPU (and OS) supports AVX2, FMA and F16C.
bool cpu_has_avx2();

// The path the kernels use now.
Simd active_simd();
const char* simd_name(Simd simd);

// "auto" picks AVX2 when cpu_has_avx2(), else scalar; "avx2" throws Unsupported when the CPU lacks it;
// "scalar" forces the portable path. Anything else throws InvalidArgument.
void set_simd_mode(const std::string& mode);

// OpenMP threads for large arrays; 0 means all cores. Negative throws InvalidArgument.
void set_num_threads(int n);
// The thread count large arrays use (>= 1).
int num_threads();

}  // namespace tagps
