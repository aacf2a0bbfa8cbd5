// Rotary embedding of one head of size D, shared by the elementwise and attention kernels:
//   y[d] = x[d] * cos[d] + x[(d + D/2) mod D] * sin[d]
// with sin carrying rotate_half's sign (specdec/runtime/model.py rope_tables): two products and
// one sum per element, each rounded (-ffp-contract=off), the operations of model.apply_rope.
#pragma once
#include <cstdint>

inline void rope_head(const float* x, const float* c, const float* s, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + x[d + half] * s[d];
  for (int64_t d = half; d < D; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
}
