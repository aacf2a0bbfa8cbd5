// AVX-512 VNNI dot products with the second operand read by embedded broadcast ({1to16}): the
// q4, blocks and q6k kernels' inner instruction. Compilers emit a separate broadcast from the
// intrinsics (an instruction more per row and operand), hence inline asm. The same integers as
// _mm512_dpbusd_epi32 / _mm512_dpwssd_epi32 with _mm512_set1_epi32(*x).
#pragma once

#include <immintrin.h>
#include <cstdint>

// acc + per 32-bit lane the sum of 4 products u8(w) * s8(*x)
__attribute__((target("avx512f,avx512vnni"))) static inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// acc + per 32-bit lane the sum of 2 products s16(w) * s16(*x)
__attribute__((target("avx512f,avx512vnni"))) static inline __m512i dpwssd_bcst(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}
