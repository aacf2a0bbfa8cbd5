// 4-bit weights x int8 activations, batch invariant: specdec's one hand-written kernel.
//
// Weights: groups of 32 inputs, w = scale * q - min with q in 0..15 (4 bits), scale and min in
// fp16, laid out per tile of 16 output channels and group, one contiguous 320-byte chunk each:
//   packed [N/16, G, 320] uint8: 256 bytes of codes (see tile_codes), 16 fp16 scales, 16 fp16 mins.
// A tile's chunks follow each other group by group, so a thread reads one sequential stream
// (prefetched g_prefetch bytes ahead) — a single-row product is then bound by memory bandwidth.
// Activations: each row, each group of 32 inputs quantized on its own:
//   d = max|x| / 127, xq = round-half-even(x * (d > 0 ? 1/d : 0)) in -127..127, isum = sum(xq).
// Output element (m, n), groups accumulated in order g = 0..G-1 in fp32:
//   acc += d[m,g] * (scale[n,g] * float(idot) - min[n,g] * float(isum[m,g])),
//   idot = sum_j q[n,g,j] * xq[m,g,j]  (exact in int32).
// Every output element is that one fixed sequence of operations, whatever the number of rows M
// or threads (threads split the output tiles, never K): results are bit-identical alone, in
// a block or in a batch, and equal to the pure-torch reference in specdec/runtime/q4.py.
// Compiled with -ffp-contract=off so no multiply-add is fused differently from the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vnni.h"
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;     // output channels per tile
constexpr int64_t kChunk = 320;   // bytes per tile and group: 256 of codes, 32 of scales, 32 of mins
// Bytes ahead (16 chunks), tunable for measurements; see docs/CHANGELOG.md, 'runtime at llama.cpp's bytes'.
int64_t g_prefetch = 5120;
// q4k, bytes ahead in a call of several rows: each chunk then takes longer to compute, and a
// farther stream keeps the memory busy meanwhile (measured: a Qwen2.5-7B 5-token forward 0.89x of
// 5120's time, its 1-token forward 1.06x, on Zen 5; docs/CHANGELOG.md, 'prefetch by rows').
int64_t g_prefetch_rows = 10240;
int g_force_isa = 0;  // tests: 0 = the best this CPU has, 1 = AVX2, 2 = VNNI (256-bit), 3 = AVX-512

// Per-row, per-group int8 quantization of x [M, K] (fp32, contiguous).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* d, float* isum) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + (i / G) * K + (i % G) * kGroup;
      float amax = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float dd = amax / 127.0f;
      const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
      int32_t s = 0;
      int8_t* dst = xq + i * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        float v = std::nearbyint(src[j] * id);
        v = std::min(127.0f, std::max(-127.0f, v));
        dst[j] = static_cast<int8_t>(v);
        s += dst[j];
      }
      d[i] = dd;
      isum[i] = static_cast<float>(s);
    }
  });
}

// The 256-bit tile loop, compiled twice from q4_blocks.h: with AVX2 only, and with AVX-512 VNNI's
// dpbusd for the integer dots. Both compute the same exact integers, so results are identical.
//
// AVX2 has no dpbusd: vpmaddubsw gives, per int16 lane, the sum of two products of a code (0..15)
// and an activation (-127..127), at most 2 * 15 * 127 = 3810 in magnitude, so the eight such
// registers of a group add up exactly in int16 (<= 30480 < 32767), and one vpmaddwd by ones then
// gives each output's int32 dot: the same integers as a vpmaddwd per register, with 9
// multiplies per row and group instead of 16 (the multiply ports bound a many-row call here).
static inline __m256i q4_sum16_avx2(const __m256i wv[8], const int32_t* x4) {
  __m256i s0 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(x4[0]));
  __m256i s1 = _mm256_maddubs_epi16(wv[1], _mm256_set1_epi32(x4[4]));
  s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[2], _mm256_set1_epi32(x4[1])));
  s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[3], _mm256_set1_epi32(x4[5])));
  s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[4], _mm256_set1_epi32(x4[2])));
  s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[5], _mm256_set1_epi32(x4[6])));
  s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[6], _mm256_set1_epi32(x4[3])));
  s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[7], _mm256_set1_epi32(x4[7])));
  return _mm256_add_epi16(s0, s1);  // [8 outputs x 2 int16]
}

static inline __m256i q4_idot_avx2(const __m256i wv[8], const int32_t* x4) {
  return _mm256_madd_epi16(q4_sum16_avx2(wv, x4), _mm256_set1_epi16(1));
}

// The codes of half h (outputs 8h..8h+7) of a chunk's 256 bytes as 8 registers of 4-bit values
// (u8): wv[2r] the low nibbles of row r (inputs 4r..4r+3), wv[2r+1] the high ones (16+4r..).
static inline void unpack_half(const uint8_t* codes, int64_t h, __m256i wv[8]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * r + 32 * h));
    wv[2 * r] = _mm256_and_si256(v, mask);
    wv[2 * r + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
}
#define Q4_SUFFIX avx2
#define Q4_IDOT(wv, x4) q4_idot_avx2(wv, x4)
#include "q4_blocks.h"
#undef Q4_SUFFIX
#undef Q4_IDOT

#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
// four independent dpbusd chains (exact: their order does not matter), then one sum
static inline __m256i q4_idot_vnni(const __m256i wv[8], const int32_t* x4) {
  __m256i i0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[0], _mm256_set1_epi32(x4[0]));
  __m256i i1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[1], _mm256_set1_epi32(x4[4]));
  __m256i i2 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[2], _mm256_set1_epi32(x4[1]));
  __m256i i3 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[3], _mm256_set1_epi32(x4[5]));
  i0 = _mm256_dpbusd_epi32(i0, wv[4], _mm256_set1_epi32(x4[2]));
  i1 = _mm256_dpbusd_epi32(i1, wv[5], _mm256_set1_epi32(x4[6]));
  i2 = _mm256_dpbusd_epi32(i2, wv[6], _mm256_set1_epi32(x4[3]));
  i3 = _mm256_dpbusd_epi32(i3, wv[7], _mm256_set1_epi32(x4[7]));
  return _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
}
#define Q4_SUFFIX vnni
#define Q4_IDOT(wv, x4) q4_idot_vnni(wv, x4)
#include "q4_blocks.h"
#undef Q4_SUFFIX
#undef Q4_IDOT
#pragma GCC pop_options

// One tile (16 outputs) per 512-bit register where AVX-512 is there: the same per-lane
// operations as q4_blocks.h (so the same results), half the instructions per output. Per row
// and group: 8 vpdpbusd reading the row's 4 activation bytes by embedded broadcast (inline asm:
// compilers emit a separate broadcast), 1 integer add, the float rescaling; the R rows of a
// call share each unpacked chunk and keep their accumulators in registers (R a template
// constant, so the row loop unrolls).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
// A chunk's 256 bytes of codes as 8 registers of 4-bit values (u8), in the order of tile_codes.
static inline void unpack_codes(const uint8_t* codes, __m512i wv[8]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * r);
    wv[2 * r] = _mm512_and_si512(v, mask);
    wv[2 * r + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
}

// The 16 outputs' exact integer dots with one row's 32 int8 activations x4: 8 vpdpbusd in two
// independent chains (their order does not matter: integers), then one sum.
static inline __m512i group_dots(const __m512i wv[8], const int32_t* x4) {
  __m512i i0 = dpbusd_bcst(_mm512_setzero_si512(), wv[0], x4 + 0);
  __m512i i1 = dpbusd_bcst(_mm512_setzero_si512(), wv[1], x4 + 4);
  i0 = dpbusd_bcst(i0, wv[2], x4 + 1);
  i1 = dpbusd_bcst(i1, wv[3], x4 + 5);
  i0 = dpbusd_bcst(i0, wv[4], x4 + 2);
  i1 = dpbusd_bcst(i1, wv[5], x4 + 6);
  i0 = dpbusd_bcst(i0, wv[6], x4 + 3);
  i1 = dpbusd_bcst(i1, wv[7], x4 + 7);
  return _mm512_add_epi32(i0, i1);
}

template <int R>
static void q4_tile_rows_avx512(const uint8_t* chunk, int64_t G, int64_t K, const int8_t* XQ, const float* D,
                                const float* IS, const float* bias, float* Y, int64_t N) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, chunk += kChunk) {
    for (int64_t line = 0; line < kChunk; line += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk) + g_prefetch + line, _MM_HINT_T0);
    __m512i wv[8];
    unpack_codes(chunk, wv);
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 288)));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + i * K + g * kGroup);
      const __m512 t = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(group_dots(wv, x4)));
      const __m512 u = _mm512_mul_ps(mn, _mm512_set1_ps(IS[i * G + g]));
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(D[i * G + g]), _mm512_sub_ps(t, u)));
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    __m512 out = acc[i];
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(Y + i * N, out);
  }
}

template <int R>
static void q4_rows_dispatch(int rows, const uint8_t* chunk, int64_t G, int64_t K, const int8_t* XQ, const float* D,
                             const float* IS, const float* bias, float* Y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return q4_tile_rows_avx512<R>(chunk, G, K, XQ, D, IS, bias, Y, N);
    return q4_rows_dispatch<R - 1>(rows, chunk, G, K, XQ, D, IS, bias, Y, N);
  }
}

constexpr int64_t kMaxRows512 = 16;  // accumulators in registers: 16 + 8 weights + constants <= 32 (measured: no slower than 12 at 1-12 rows, faster at 13-16)

static void q4_tiles_avx512(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                            const uint8_t* P, const int8_t* XQ, const float* D, const float* IS,
                            const float* B, float* Y) {
  const int64_t K = G * kGroup;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile)
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows512) {
      const int rows = static_cast<int>(std::min(kMaxRows512, M - m0));
      q4_rows_dispatch<kMaxRows512>(rows, P + tile * G * kChunk, G, K, XQ + m0 * K, D + m0 * G, IS + m0 * G,
                                    B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N);
    }
}
#pragma GCC pop_options


// ---- The superblock format (dtype q4k): integer sub-scales, as GGUF's Q4_K ----
//
// Per tile of 16 outputs and superblock of up to 8 groups (256 inputs), one contiguous run of bytes:
//   codes [ng][256] (tile_codes, as above) | sc [ng][16] uint8 | m [ceil(ng/2)][16][2] int8 (pairs of
//   groups, zero-padded) | d [16] fp16 | dmin [16] fp16,
// so w[n, 32g + j] = d[n] * sc[g][n] * q - dmin[n] * m[g][n]. A tile's superblocks follow each other.
// Activations: each row, each superblock quantized on its own (d = max|x|/127, xq = round(x / d)),
// with the int16 sums of the codes of each group (xs, [M, S, 8], zero-padded). Per row and
// superblock, exactly in integers: isc = sum_g sc[g] * idot_g, imin = sum_g m[g] * xs[g]; then in fp32,
// superblocks in order: acc += xd[m, s] * (d * float(isc) - dmin * float(imin)).
// The float work is once per superblock instead of once per group (the q4 format above): what makes
// a multi-row call cheaper (docs/CHANGELOG.md, 'q4k').
constexpr int64_t kSuper = 8;  // groups per superblock

inline int64_t sb_bytes(int64_t ng) { return ng * (kTile * kGroup / 2) + ng * kTile + ((ng + 1) / 2) * 2 * kTile + 4 * kTile; }

// The parts of a tile's superblock of ng groups that starts at p (the layout above).
struct SuperblockParts {
  const uint8_t* sc;  // [ng][16] uint8 sub-scales
  const uint8_t* mm;  // [ceil(ng/2)][16][2] int8 mins, by pairs of groups
  const uint8_t* dd;  // [16] fp16 d, then [16] fp16 dmin; the next superblock follows
};

inline SuperblockParts superblock_parts(const uint8_t* p, int64_t ng) {
  const uint8_t* sc = p + ng * (kTile * kGroup / 2);
  const uint8_t* mm = sc + ng * kTile;
  return {sc, mm, mm + ((ng + 1) / 2) * 2 * kTile};
}

inline int64_t tile_bytes_sb(int64_t G) {
  const int64_t full = G / kSuper, rest = G % kSuper;
  return full * sb_bytes(kSuper) + (rest ? sb_bytes(rest) : 0);
}

// Per-row, per-superblock int8 quantization of x [M, K]: xq [M, K], xd [M, S], xs [M, S, 8].
void quantize_rows_sb(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, int16_t* xs) {
  const int64_t G = K / kGroup, S = (G + kSuper - 1) / kSuper;
  at::parallel_for(0, M * S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / S, s = i % S, g0 = s * kSuper, ng = std::min(kSuper, G - g0);
      const float* src = x + m * K + g0 * kGroup;
      float amax = 0.0f;
      for (int64_t j = 0; j < ng * kGroup; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float dd = amax / 127.0f;
      const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
      int8_t* dst = xq + m * K + g0 * kGroup;
      int16_t* sums = xs + i * kSuper;
      for (int64_t g = 0; g < kSuper; ++g) {
        int32_t sum = 0;
        for (int64_t j = 0; g < ng && j < kGroup; ++j) {
          float v = std::nearbyint(src[g * kGroup + j] * id);
          v = std::min(127.0f, std::max(-127.0f, v));
          dst[g * kGroup + j] = static_cast<int8_t>(v);
          sum += dst[g * kGroup + j];
        }
        sums[g] = static_cast<int16_t>(sum);
      }
      xd[i] = dd;
    }
  });
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
// quantize_rows_sb with 16 lanes per instruction: the same per-element operations (x * id, round to
// nearest even, clamp, convert), |x|'s maximum (exact in any order; a NaN is skipped as std::max
// skips it: max_ps returns its second operand when one is NaN) and exact integer sums — the same
// codes, scales and sums (tested through the kernel's reference).
void quantize_rows_sb_avx512(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, int16_t* xs) {
  const int64_t G = K / kGroup, S = (G + kSuper - 1) / kSuper;
  at::parallel_for(0, M * S, 16, [&](int64_t begin, int64_t end) {
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i sign = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / S, s = i % S, g0 = s * kSuper, ng = std::min(kSuper, G - g0);
      const float* src = x + m * K + g0 * kGroup;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t j = 0; j < ng * kGroup; j += 16)
        amax = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(src + j)), sign)), amax);
      const float dd = _mm512_reduce_max_ps(amax) / 127.0f;
      const float idf = dd > 0.0f ? 1.0f / dd : 0.0f;
      const __m512 id = _mm512_set1_ps(idf);
      int8_t* dst = xq + m * K + g0 * kGroup;
      int16_t* sums = xs + i * kSuper;
      for (int64_t g = 0; g < kSuper; ++g) {
        if (g >= ng) {
          sums[g] = 0;
          continue;
        }
        __m512i c[2];
        for (int h = 0; h < 2; ++h) {
          const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(src + g * kGroup + 16 * h), id),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          c[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * kGroup + 16 * h), _mm512_cvtepi32_epi8(c[h]));
        }
        sums[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(_mm512_add_epi32(c[0], c[1])));
      }
      xd[i] = dd;
    }
  });
}
#pragma GCC pop_options

// Plain C++ (any CPU; tests): the same integers and the same float operations, one output at a time.
static void q4k_tiles_portable(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                               const uint8_t* P, const int8_t* XQ, const float* XD, const int16_t* XS,
                               const float* B, float* Y) {
  const int64_t K = G * kGroup, S = (G + kSuper - 1) / kSuper, TB = tile_bytes_sb(G);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile)
    for (int64_t o = 0; o < kTile; ++o)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        const uint8_t* p = P + tile * TB;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t ng = std::min(kSuper, G - s * kSuper);
          const SuperblockParts parts = superblock_parts(p, ng);
          const uint8_t* sc = parts.sc;
          const int8_t* mm = reinterpret_cast<const int8_t*>(parts.mm);
          const uint16_t* dd = reinterpret_cast<const uint16_t*>(parts.dd);
          int32_t isc = 0, imin = 0;
          for (int64_t g = 0; g < ng; ++g) {
            const uint8_t* codes = p + g * 256;
            const int8_t* xq = XQ + m * K + (s * kSuper + g) * kGroup;
            int32_t idot = 0;
            for (int64_t r = 0; r < 4; ++r)
              for (int64_t t = 0; t < 4; ++t) {
                const uint8_t b = codes[64 * r + 4 * o + t];
                idot += (b & 0x0F) * xq[4 * r + t] + (b >> 4) * xq[16 + 4 * r + t];
              }
            isc += static_cast<int32_t>(sc[g * kTile + o]) * idot;
            imin += static_cast<int32_t>(mm[(g / 2) * 2 * kTile + 2 * o + g % 2]) * XS[(m * S + s) * kSuper + g];
          }
          const float fs = _cvtsh_ss(dd[o]) * static_cast<float>(isc);
          const float fm = _cvtsh_ss(dd[kTile + o]) * static_cast<float>(imin);
          acc = acc + XD[m * S + s] * (fs - fm);
          p += sb_bytes(ng);
        }
        if (B) acc = acc + B[tile * kTile + o];
        Y[m * N + tile * kTile + o] = acc;
      }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
// One tile, R rows, 16 outputs per 512-bit register; per row and group 8 vpdpbusd, an integer add,
// a multiply by the sub-scales and an add; per row and superblock the mins' dot products
// (vpdpwssd on group pairs) and the float rescaling.
// vpdpwssd with the row's pair of int16 group sums read by embedded broadcast (a separate
// broadcast from a general register cost ~12% of a many-row call, measured).
template <int R>
static void q4k_tile_rows_avx512(const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD,
                                 const int16_t* XS, const float* bias, float* Y, int64_t N, int64_t ahead) {
  const int64_t S = (G + kSuper - 1) / kSuper;
  alignas(64) float accb[R * kTile];
  for (int i = 0; i < R * kTile; ++i) accb[i] = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ng = std::min(kSuper, G - s * kSuper);
    const auto [sc, mm, dd] = superblock_parts(p, ng);
    __m512i isc[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) isc[i] = _mm512_setzero_si512();
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* chunk = p + g * 256;
      if (ahead)  // the first pass over a tile streams it from memory; later passes read it from L1
        for (int64_t line = 0; line < 320; line += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk) + ahead + line, _MM_HINT_T0);
      __m512i wv[8];
      unpack_codes(chunk, wv);
      const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kTile * g)));
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + i * K + (s * kSuper + g) * kGroup);
        isc[i] = _mm512_add_epi32(isc[i], _mm512_mullo_epi32(group_dots(wv, x4), scv));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd)));
    const __m512 dmv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + 32)));
    const int64_t np = (ng + 1) / 2;
    __m512i mp[kSuper / 2];
    for (int64_t q = 0; q < np; ++q) mp[q] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mm + 32 * q)));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int32_t* xs2 = reinterpret_cast<const int32_t*>(XS + (i * S + s) * kSuper);
      __m512i imin = _mm512_setzero_si512();
      if (np == 4) {  // a whole superblock: two chains, the pairs' sums read by embedded broadcast
        __m512i j0 = dpwssd_bcst(_mm512_setzero_si512(), mp[0], xs2 + 0);
        __m512i j1 = dpwssd_bcst(_mm512_setzero_si512(), mp[1], xs2 + 1);
        j0 = dpwssd_bcst(j0, mp[2], xs2 + 2);
        j1 = dpwssd_bcst(j1, mp[3], xs2 + 3);
        imin = _mm512_add_epi32(j0, j1);
      } else {
        for (int64_t q = 0; q < np; ++q) imin = dpwssd_bcst(imin, mp[q], xs2 + q);
      }
      const __m512 fs = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(isc[i]));
      const __m512 fm = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(imin));
      const __m512 a = _mm512_load_ps(accb + i * kTile);
      _mm512_store_ps(accb + i * kTile, _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(XD[i * S + s]), _mm512_sub_ps(fs, fm))));
    }
    p = dd + 64;
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    __m512 out = _mm512_load_ps(accb + i * kTile);
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(Y + i * N, out);
  }
}

template <int R>
static void q4k_rows_dispatch(int rows, const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD,
                              const int16_t* XS, const float* bias, float* Y, int64_t N, int64_t ahead) {
  if constexpr (R > 0) {
    if (rows == R) return q4k_tile_rows_avx512<R>(p, G, K, XQ, XD, XS, bias, Y, N, ahead);
    return q4k_rows_dispatch<R - 1>(rows, p, G, K, XQ, XD, XS, bias, Y, N, ahead);
  }
}

// Rows per call of the tile loop: the integer accumulators of R rows stay in registers with the 8
// unpacked weight registers up to ~11 rows; beyond that they spill (measured: 16 rows at a time cost
// 1.2x 8 at a time on a 300-row prefill). So up to 11 rows go in one pass, more in passes of 8.
constexpr int64_t kRowsSb = 8, kMaxRowsSb = 11;

static void q4k_tiles_avx512(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                             const uint8_t* P, const int8_t* XQ, const float* XD, const int16_t* XS,
                             const float* B, float* Y) {
  const int64_t K = G * kGroup, S = (G + kSuper - 1) / kSuper, TB = tile_bytes_sb(G);
  const int64_t ahead = M == 1 ? g_prefetch : g_prefetch_rows;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile)
    for (int64_t m0 = 0, rows = 0; m0 < M; m0 += rows) {
      rows = M - m0 <= kMaxRowsSb ? M - m0 : kRowsSb;
      q4k_rows_dispatch<kMaxRowsSb>(static_cast<int>(rows), P + tile * TB, G, K, XQ + m0 * K, XD + m0 * S,
                                    XS + m0 * S * kSuper, B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N,
                                    m0 == 0 ? ahead : 0);
    }
}
#pragma GCC pop_options

// ---- q4k with AVX2 only (no VNNI): a whole tile (two 256-bit halves of 8 outputs) per pass ----
// The same integers as the reference, grouped so that each load serves two multiplies. Per
// group, quarter by quarter (r = 0..3): the two 32-byte code loads of row r of the chunk
// (outputs 0-7 and 8-15) give four registers of 4-bit codes (low nibbles: inputs 4r..4r+3,
// high: 16+4r..), and each pass row's two broadcasts (its activations 4r.. and 16+4r..) meet
// both halves: 4 vpmaddubsw per 2 broadcasts, where a half at a time needs 8 broadcasts for 8.
// On Zen 3 the broadcasts and the multiplies both take vector pipes, so this is what bounds a
// multi-row call (measured: docs/CHANGELOG.md, 'q4k AVX2 whole tiles'). A row's 8 vpmaddubsw
// results per half sum exactly in int16 (at most 8 * 3810 = 30480), widened by one vpmaddwd by
// the group's sub-scales (each output's sc in both int16 halves of its lane: sc * (s0 + s1) =
// sc * idot, exact in int32); the mins' dots by vpmaddwd on group pairs; the float rescaling
// once per superblock, as the reference orders it.
//
// Registers: the 0x0F mask, 4 code registers, 2R int16 sums and a broadcast: R = 4 fits the 16
// ymm registers. The empty asm after each row pins the sums in registers: without it GCC
// hoists all of a group's multiplies and spills their products (one Zen 3 core, 5-32 rows in
// cache: 48-52 GMAC/s against 67-75 with it).
template <int R>
static void q4k_tile_rows_avx2(const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD,
                               const int16_t* XS, const float* bias, float* Y, int64_t N, bool prefetch) {
  const int64_t S = (G + kSuper - 1) / kSuper;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  alignas(32) float acc[R][kTile];
  for (int i = 0; i < R; ++i)
    for (int64_t o = 0; o < kTile; ++o) acc[i][o] = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ng = std::min(kSuper, G - s * kSuper);
    const auto [sc, mm, dd] = superblock_parts(p, ng);
    __m256i isc[R][2];  // per row and half: sum_g sc * idot, exact in int32
    for (int i = 0; i < R; ++i) isc[i][0] = isc[i][1] = _mm256_setzero_si256();
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* chunk = p + g * 256;
      if (prefetch)  // the first pass over a tile streams it from memory; later passes read it from cache
        for (int64_t line = 0; line < 256; line += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk) + g_prefetch + line, _MM_HINT_T0);
      const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + (s * kSuper + g) * kGroup);  // row i at x4 + i * K / 4
      __m256i s0[R], s1[R];  // int16 sums of the halves (outputs 0-7, 8-15)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * r + 32));
        const __m256i w0l = _mm256_and_si256(v0, mask), w1l = _mm256_and_si256(v1, mask);
        const __m256i w0h = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
        const __m256i w1h = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i bl = _mm256_set1_epi32(x4[i * K / 4 + r]);
          if (r == 0) {
            s0[i] = _mm256_maddubs_epi16(w0l, bl);
            s1[i] = _mm256_maddubs_epi16(w1l, bl);
          } else {
            s0[i] = _mm256_add_epi16(s0[i], _mm256_maddubs_epi16(w0l, bl));
            s1[i] = _mm256_add_epi16(s1[i], _mm256_maddubs_epi16(w1l, bl));
          }
          const __m256i bh = _mm256_set1_epi32(x4[i * K / 4 + 4 + r]);
          s0[i] = _mm256_add_epi16(s0[i], _mm256_maddubs_epi16(w0h, bh));
          s1[i] = _mm256_add_epi16(s1[i], _mm256_maddubs_epi16(w1h, bh));
          asm volatile("" : "+x"(s0[i]), "+x"(s1[i]));
        }
      }
      // sc of outputs 0-7 and 8-15 as int16, each in both halves of its 32-bit lane
      const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kTile * g));
      const __m256i c0 = _mm256_cvtepu8_epi32(scb), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(scb, 8));
      const __m256i scv0 = _mm256_or_si256(c0, _mm256_slli_epi32(c0, 16));
      const __m256i scv1 = _mm256_or_si256(c1, _mm256_slli_epi32(c1, 16));
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        isc[i][0] = _mm256_add_epi32(isc[i][0], _mm256_madd_epi16(s0[i], scv0));
        isc[i][1] = _mm256_add_epi32(isc[i][1], _mm256_madd_epi16(s1[i], scv1));
      }
    }
    const int64_t np = (ng + 1) / 2;
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + 16 * h)));
      const __m256 dmv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + 32 + 16 * h)));
      __m256i mp[kSuper / 2];
      for (int64_t q = 0; q < np; ++q)  // (m[2q][o], m[2q+1][o]) of outputs 8h..8h+7 as int16 pairs
        mp[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mm + 32 * q + 16 * h)));
      for (int i = 0; i < R; ++i) {
        const int32_t* xs2 = reinterpret_cast<const int32_t*>(XS + (i * S + s) * kSuper);
        __m256i imin = _mm256_setzero_si256();
        for (int64_t q = 0; q < np; ++q) imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mp[q], _mm256_set1_epi32(xs2[q])));
        const __m256 fs = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(isc[i][h]));
        const __m256 fm = _mm256_mul_ps(dmv, _mm256_cvtepi32_ps(imin));
        const __m256 a = _mm256_load_ps(acc[i] + 8 * h);
        _mm256_store_ps(acc[i] + 8 * h, _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(XD[i * S + s]), _mm256_sub_ps(fs, fm))));
      }
    }
    p = dd + 64;
  }
  for (int i = 0; i < R; ++i)
    for (int64_t h = 0; h < 2; ++h) {
      __m256 out = _mm256_load_ps(acc[i] + 8 * h);
      if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + 8 * h));
      _mm256_storeu_ps(Y + i * N + 8 * h, out);
    }
}

template <int R>
static void q4k_tile_dispatch_avx2(int rows, const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD,
                                   const int16_t* XS, const float* bias, float* Y, int64_t N, bool prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return q4k_tile_rows_avx2<R>(p, G, K, XQ, XD, XS, bias, Y, N, prefetch);
    return q4k_tile_dispatch_avx2<R - 1>(rows, p, G, K, XQ, XD, XS, bias, Y, N, prefetch);
  }
}

constexpr int64_t kRowsAvx2 = 4;  // the most rows whose sums fit the registers (see above)

static void q4k_tiles_avx2(int64_t tile_begin, int64_t tile_end, int64_t M, int64_t G, int64_t N,
                           const uint8_t* P, const int8_t* XQ, const float* XD, const int16_t* XS,
                           const float* B, float* Y) {
  const int64_t K = G * kGroup, S = (G + kSuper - 1) / kSuper, TB = tile_bytes_sb(G);
  const int64_t passes = (M + kRowsAvx2 - 1) / kRowsAvx2, per = (M + passes - 1) / passes;  // balanced: 5 rows = 3 + 2
  for (int64_t tile = tile_begin; tile < tile_end; ++tile)
    for (int64_t m0 = 0; m0 < M; m0 += per) {
      const int rows = static_cast<int>(std::min(per, M - m0));
      q4k_tile_dispatch_avx2<kRowsAvx2>(rows, P + tile * TB, G, K, XQ + m0 * K, XD + m0 * S, XS + m0 * S * kSuper,
                                        B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N, m0 == 0);
    }
}

// x [M, K] (2-D view) times a superblock-format weight [NT, tile bytes] into y.
void q4k_linear_into(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0), G = K / kGroup, N = NT * kTile;
  const int64_t S = (G + kSuper - 1) / kSuper;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto xd = torch::empty({M, S}, x.options());
  auto xs = torch::empty({M, S, kSuper}, x.options().dtype(torch::kShort));
  static const bool has_avx512 = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                 __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512dq");
  const bool wide = has_avx512 && (g_force_isa == 0 || g_force_isa == 3);
  (wide ? quantize_rows_sb_avx512 : quantize_rows_sb)(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(),
                                                      xd.data_ptr<float>(), xs.data_ptr<int16_t>());
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XD = xd.data_ptr<float>();
  const int16_t* XS = xs.data_ptr<int16_t>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  const bool avx2 = !wide && has_avx2 && g_force_isa != 4;
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    if (wide)
      q4k_tiles_avx512(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
    else if (avx2)
      q4k_tiles_avx2(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
    else
      q4k_tiles_portable(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
  });
}
}  // namespace

// x [..., K] fp32 -> y [..., N] fp32, N = 16 * tiles. bias may be empty.
torch::Tensor q4_linear(torch::Tensor x_in, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.is_contiguous(), "x must be [..., K] contiguous fp32");
  auto x = x_in.view({-1, x_in.size(-1)});
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() &&
              ((packed.dim() == 3 && packed.size(2) == kChunk) || packed.dim() == 2),
              "packed must be [N/16, G, 320] (q4) or [N/16, tile bytes] (q4k) contiguous uint8");
  const bool superblocks = packed.dim() == 2;
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0), N = NT * kTile;
  const int64_t G = superblocks ? K / kGroup : packed.size(1);
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  TORCH_CHECK(!superblocks || packed.size(1) == tile_bytes_sb(G), "a q4k weight for ", K, " inputs has ",
              tile_bytes_sb(G), " bytes per tile, got ", packed.size(1));
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "bias must be [N/16*16] fp32");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty(out_shape, x.options());
  if (M == 0) return y;
  if (superblocks) {
    q4k_linear_into(x, packed, bias, y);
    return y;
  }
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto d = torch::empty({M, G}, x.options());
  auto isum = torch::empty({M, G}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), d.data_ptr<float>(), isum.data_ptr<float>());

  const uint8_t* P = packed.data_ptr<uint8_t>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* D = d.data_ptr<float>();
  const float* IS = isum.data_ptr<float>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();

  static const bool has_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  static const bool has_avx512 = has_vnni && __builtin_cpu_supports("avx512f") &&
                                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  const int best = has_avx512 ? 3 : (has_vnni ? 2 : 1);
  const int isa = g_force_isa ? std::min(g_force_isa, best) : best;
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    if (isa == 3)
      q4_tiles_avx512(begin, end, M, G, N, P, XQ, D, IS, B, Y);
    else if (isa == 2)
      q4_tiles_vnni(begin, end, M, G, N, P, XQ, D, IS, B, Y);
    else
      q4_tiles_avx2(begin, end, M, G, N, P, XQ, D, IS, B, Y);
  });
  return y;
}

#ifndef SPECDEC_STACK  // kernels/stack.cpp includes this file and defines its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "4-bit weight x int8 activation linear, q4 or q4k layout (batch invariant)");
  m.def("uses_vnni", []() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"); });
  m.def("set_prefetch", [](int64_t bytes, int64_t rows_bytes) { g_prefetch = bytes; g_prefetch_rows = rows_bytes; },
        "measurements: software prefetch distance in bytes (one-row calls; q4k calls of several rows)");
  m.def("force_isa", [](int isa) { g_force_isa = isa; }, "tests: 0 = auto, 1 = AVX2, 2 = VNNI 256-bit, 3 = AVX-512, 4 = q4k portable loop");
}
#endif
