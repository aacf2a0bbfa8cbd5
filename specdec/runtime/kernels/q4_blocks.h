// The 256-bit tile loop of q4.cpp, included once per instruction set (Q4_SUFFIX, Q4_IDOT).
//
// Q4_IDOT(wv, x4): the exact int32 dots of the 8 outputs of a half tile (wv: its 8 registers of
// codes) with one row's 32 int8 activations (x4: as 8 int32 of 4 bytes each).
//
// A chunk (one tile of 16 outputs, one group of 32 inputs) starts with 256 bytes of codes:
// bytes 64r + 4o + t (r, t = 0..3, o = 0..15) hold q[o][4r + t] in the low nibble and
// q[o][16 + 4r + t] in the high one. A 256-bit register holds half of a 64-byte row r, i.e. the
// outputs 8h..8h+7 of half h, and one 32-bit lane of Q4_IDOT (u8 x s8 products summed into
// int32) belongs to ONE output: no horizontal reductions; lanes = outputs. The halves are done
// one after the other (the second reads the tile from cache).

#define Q4_CAT2(a, b) a##_##b
#define Q4_CAT(a, b) Q4_CAT2(a, b)

static void Q4_CAT(q4_tiles, Q4_SUFFIX)(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                                        const uint8_t* P, const int8_t* XQ, const float* D, const float* IS,
                                        const float* B, float* Y) {
  constexpr int64_t kMaxRows = 16;
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
          unpack_half(chunk, h, wv);
          const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h)));
          const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 288 + 16 * h)));
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t m = m0 + i;
            const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + m * K + g * kGroup);
            const __m256i idot = Q4_IDOT(wv, x4);  // the 8 outputs' exact integer dots with this row's 32 inputs
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
