// The 256-bit tile loop of q4.cpp, included once per instruction set (Q4_SUFFIX, Q4_DOT4).
//
// A chunk (one tile of 16 outputs, one group of 32 inputs) starts with 256 bytes of codes:
// bytes 64r + 4o + t (r, t = 0..3, o = 0..15) hold q[o][4r + t] in the low nibble and
// q[o][16 + 4r + t] in the high one. A 256-bit register holds half of a 64-byte row r, i.e. the
// outputs 8h..8h+7 of half h, and one 32-bit lane of Q4_DOT4 (u8 x s8, 4 products summed into
// int32) belongs to ONE output: no horizontal reductions; lanes = outputs. The halves are done
// one after the other (the second reads the tile from cache).

#define Q4_CAT2(a, b) a##_##b
#define Q4_CAT(a, b) Q4_CAT2(a, b)

static void Q4_CAT(q4_tiles, Q4_SUFFIX)(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                                        const uint8_t* P, const int8_t* XQ, const float* D, const float* IS,
                                        const float* B, float* Y) {
  constexpr int64_t kMaxRows = 16;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int64_t K = G * kGroup;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t n0 = tile * kTile + 8 * h;  // first output of this half
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // up to 16 rows share each unpacked group
        const int64_t rows = std::min(kMaxRows, M - m0);
        __m256 acc[kMaxRows];
        for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_setzero_ps();
        const uint8_t* chunk = P + tile * G * kChunk;
        for (int64_t g = 0; g < G; ++g, chunk += kChunk) {
          for (int64_t line = 0; line < kChunk; line += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk) + g_prefetch + line, _MM_HINT_T0);
          __m256i wv[8];
          for (int r = 0; r < 4; ++r) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r + 32 * h));
            wv[2 * r] = _mm256_and_si256(v, mask);
            wv[2 * r + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          }
          const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h)));
          const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 288 + 16 * h)));
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
          if (B) out = _mm256_add_ps(out, _mm256_loadu_ps(B + n0));
          _mm256_storeu_ps(Y + (m0 + i) * N + n0, out);
        }
      }
    }
  }
}
