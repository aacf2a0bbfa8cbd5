// exp16: the Cephes expf polynomial with fixed float constants (not libm's exp), for x <= 0, one
// rounding per operation (compile with -ffp-contract=off), so the pure-torch references
// (specdec.runtime.lanes.exp16) reproduce it bit for bit. Shared by attention.cpp (softmax)
// and elementwise.cpp (SiLU).
#pragma once
#include <cstdint>
#include <cstring>

inline float exp16(float x) {  // x <= 0
  // round-half-even of x * log2(e) by adding and subtracting 1.5 * 2^23 (exact for |v| < 2^22),
  // branch-free so the loops vectorize
  const float n = (x * 0x1.715476p+0f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0x1.63p-1f;
  r = r - n * -0x1.bd0106p-13f;
  float p = 0x1.a0d2cep-13f;
  p = p * r + 0x1.6e879cp-10f;
  p = p * r + 0x1.111210p-7f;
  p = p * r + 0x1.555382p-5f;
  p = p * r + 0x1.555554p-3f;
  p = p * r + 0x1.0p-1f;
  float y = p * (r * r);
  y = y + r;
  y = y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.0f ? 0.0f : y * two_n;
}
