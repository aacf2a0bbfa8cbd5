// The block loop of q4.cpp, included once per instruction set (Q4_SUFFIX, Q4_DOT4).
//
// One group (32 inputs) of one block of 8 outputs is 128 bytes. Register r (r = 0..3) holds, for
// output o (32-bit lane o) and t = 0..3, code q[o][4r + t] in the low nibble of byte 4o + t and
// q[o][16 + 4r + t] in the high nibble. One 32-bit lane of Q4_DOT4 (u8 x s8, 4 products summed
// into int32) therefore belongs to ONE output: no horizontal reductions; lanes = outputs.

#define Q4_CAT2(a, b) a##_##b
#define Q4_CAT(a, b) Q4_CAT2(a, b)

static void Q4_CAT(q4_blocks, Q4_SUFFIX)(int64_t nb_begin, int64_t nb_end, int64_t M, int64_t G, int64_t N,
                                         const uint8_t* W, const uint16_t* S, const uint16_t* Mn, const int8_t* XQ,
                                         const float* D, const float* IS, const float* B, float* Y) {
  constexpr int64_t kMaxRows = 16;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int64_t K = G * kGroup;
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // up to 16 rows share each unpacked weight group
      const int64_t rows = std::min(kMaxRows, M - m0);
      __m256 acc[kMaxRows];
      for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t sg = (nb * G + g) * kBlock;
        const __m256i* raw = reinterpret_cast<const __m256i*>(W + sg * 16);
        __m256i wv[8];
        for (int r = 0; r < 4; ++r) {
          const __m256i v = _mm256_loadu_si256(raw + r);
          wv[2 * r] = _mm256_and_si256(v, mask);
          wv[2 * r + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + sg)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Mn + sg)));
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t m = m0 + i;
          const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + m * K + g * kGroup);
          // four independent integer chains (exact: their order does not matter), then one sum
          __m256i i0 = Q4_DOT4(_mm256_setzero_si256(), wv[0], _mm256_set1_epi32(x4[0]));
          __m256i i1 = Q4_DOT4(_mm256_setzero_si256(), wv[1], _mm256_set1_epi32(x4[4]));
          __m256i i2 = Q4_DOT4(_mm256_setzero_si256(), wv[2], _mm256_set1_epi32(x4[1]));
          __m256i i3 = Q4_DOT4(_mm256_setzero_si256(), wv[3], _mm256_set1_epi32(x4[5]));
          i0 = Q4_DOT4(i0, wv[4], _mm256_set1_epi32(x4[2]));
          i1 = Q4_DOT4(i1, wv[5], _mm256_set1_epi32(x4[6]));
          i2 = Q4_DOT4(i2, wv[6], _mm256_set1_epi32(x4[3]));
          i3 = Q4_DOT4(i3, wv[7], _mm256_set1_epi32(x4[7]));
          const __m256i idot = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
          const __m256 t = _mm256_mul_ps(sc, _mm256_cvtepi32_ps(idot));
          const __m256 u = _mm256_mul_ps(mn, _mm256_set1_ps(IS[m * G + g]));
          acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_set1_ps(D[m * G + g]), _mm256_sub_ps(t, u)));
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        __m256 out = acc[i];
        if (B) out = _mm256_add_ps(out, _mm256_loadu_ps(B + nb * kBlock));
        _mm256_storeu_ps(Y + (m0 + i) * N + nb * kBlock, out);
      }
    }
  }
}
