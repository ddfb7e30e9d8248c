// AVX2/FMA/F16C vector traits; include only from *_avx2.cc files (compiled with -mavx2 -mfma -mf16c).
// Loads and stores are unaligned (loadu/storeu): callers pass numpy/torch buffers and offset views with
// any element alignment; on these CPUs unaligned access to aligned data costs nothing extra.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "common/dtype.h"

namespace tagps::kernels::detail {

template <DType D>
struct Vec;

template <>
struct Vec<DType::kFloat32> {
  using T = float;
  using V = __m256;
  static constexpr size_t kWidth = 8;
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
};

template <>
struct Vec<DType::kFloat64> {
  using T = double;
  using V = __m256d;
  static constexpr size_t kWidth = 4;
  static V load(const T* p) { return _mm256_loadu_pd(p); }
  static void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V set1(double x) { return _mm256_set1_pd(x); }
};

// float16 <-> float32 with F16C; vcvtps2ph with round-to-nearest-even, exceptions suppressed.
inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_half8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// bfloat16 <-> float32 with integer ops: widening is a 16-bit shift; narrowing rounds to nearest even
// (u + 0x7FFF + lsb) >> 16 and maps every NaN to 0x7FC0, exactly as tagps::float_to_bf16 (and torch).
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // packus interleaves the two 128-bit lanes; the permute puts the eight 16-bit values in order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <>
struct Vec<DType::kFloat16> {
  using T = uint16_t;
  using V = __m256;
  static constexpr size_t kWidth = 8;
  static V load(const T* p) { return load_half8(p); }
  static void store(T* p, V v) { store_half8(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
};

template <>
struct Vec<DType::kBFloat16> {
  using T = uint16_t;
  using V = __m256;
  static constexpr size_t kWidth = 8;
  static V load(const T* p) { return load_bf16x8(p); }
  static void store(T* p, V v) { store_bf16x8(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
};

template <>
struct Vec<DType::kInt32> {
  using T = int32_t;
  using V = __m256i;
  static constexpr size_t kWidth = 8;
  static V load(const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(T* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V mul(V a, V b) { return _mm256_mullo_epi32(a, b); }  // low 32 bits: wraps like the reference
  static V set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int32_t>(x)); }
};

// int64 has no AVX2 multiply; scale uses the scalar reference for it (see sum_avx2.cc).
template <>
struct Vec<DType::kInt64> {
  using T = int64_t;
  using V = __m256i;
  static constexpr size_t kWidth = 4;
  static V load(const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(T* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static V add(V a, V b) { return _mm256_add_epi64(a, b); }
};

}  // namespace tagps::kernels::detail

namespace tagps::kernels::detail {

// Vector counterparts of ScalarOps (ops.h), operation for operation: eight float or four double lanes.
template <typename E>
struct Avx2Ops;

template <>
struct Avx2Ops<float> {
  using T = float;
  using V = __m256;
  static constexpr size_t kWidth = 8;
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(T x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  // vmaxps returns its second operand when either is NaN; put a's NaN back.
  static V max_nan(V a, V b) {
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
};

template <>
struct Avx2Ops<double> {
  using T = double;
  using V = __m256d;
  static constexpr size_t kWidth = 4;
  static V load(const T* p) { return _mm256_loadu_pd(p); }
  static void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  static V set1(T x) { return _mm256_set1_pd(x); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V div(V a, V b) { return _mm256_div_pd(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_pd(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V neg(V a) { return _mm256_xor_pd(a, _mm256_set1_pd(-0.0)); }
  static V max_nan(V a, V b) {
    return _mm256_blendv_pd(_mm256_max_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
  }
};

}  // namespace tagps::kernels::detail
