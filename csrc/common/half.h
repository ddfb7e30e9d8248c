// Scalar float16 / bfloat16 <-> float32 conversions, round-to-nearest-even.
// They are bit-for-bit what the AVX2 paths produce: F16C's vcvtps2ph/vcvtph2ps for float16 (NaN payloads
// kept, made quiet) and torch's c10::BFloat16 rounding for bfloat16 (every NaN becomes 0x7FC0).
#pragma once

#include <cstdint>
#include <cstring>

namespace tagps {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // inf, or NaN made quiet
    return bits_float(sign | 0x7f800000u | (mant != 0 ? (mant | 0x200u) << 13 : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return bits_float(sign | float_bits(mag));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf, or NaN: keep the top 10 payload bits and set the quiet bit
    return static_cast<uint16_t>(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u | ((u >> 13) & 0x3ffu) : 0u));
  }
  if (u >= 0x47800000u) {  // >= 65536: overflows to inf (65520..65536 rounds up below)
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (u < 0x38800000u) {  // below 2^-14: subnormal or zero. Adding 0.5 aligns the 10 mantissa bits at the
    // bottom of the float and the FPU rounds to nearest even; subtracting the magic's bits leaves them.
    const float magic = 0.5f;
    const uint32_t r = float_bits(bits_float(u) + magic) - float_bits(magic);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias the exponent by -112 and add the rounding bias
  return static_cast<uint16_t>(sign | (u >> 13));
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace tagps
