// GGUF's 32-weight block types x int8 activations, exactly as the file stores them, batch invariant:
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and Q5_K and IQ4_XS (whose superblocks are 8 groups of 32
// with integer sub-scales). One kernel family: a type is a code width (4, 5 or 8 bits), a scale
// rule, and for the IQ4 types a table of 16 values the 4-bit codes index.
//
// Weights, per group of 32 inputs and output n, with codes u:
//   SYM    (Q4_0, Q5_0, Q8_0): w = d * (u - z)                    d fp16; z = 8, 16, 128
//   AFFINE (Q4_1, Q5_1):       w = d * u + m                      d, m fp16
//   KQ     (Q5_K):             w = (d * sc) * u - dmin * mn       sc, mn 6-bit per group; d, dmin
//                                                                 fp16 per superblock of 8 groups
//   NL     (IQ4_XS):           w = (d * (ls - 32)) * (u - 128)    ls 6-bit per group; d fp16 per
//                                                                 superblock of 8 groups
// (Q8_0's signed codes are stored as u = q + 128, so every code is an unsigned byte; IQ4_NL (SYM,
// z = 128) and IQ4_XS keep 4-bit indices i, and the kernels multiply u = kIQ4[i] = value + 128.)
//
// Layout, per tile of 16 outputs: its groups in order, one contiguous chunk each; a KQ tile has a
// 64-byte header (d [16] fp16, dmin [16] fp16) before each superblock's 8 chunks, an NL tile a
// 32-byte one (d [16] fp16). A chunk:
//   codes: 4 and 5 bits: 256 bytes, byte 64r + 4o + t (r, t = 0..3) holds input 4r + t of output o
//          in its low nibble and input 16 + 4r + t in its high nibble (the q4 kernels' layout);
//          8 bits: 512 bytes, byte 64r + 4o + t (r = 0..7) holds input 4r + t;
//   5 bits: + 64 bytes of top bits, byte 4o + t: bit r = input 4r + t's, bit 4 + r = input 16 + 4r + t's;
//   scales: SYM d [16] fp16; AFFINE d [16], m [16] fp16; KQ sc [16], mn [16] uint8; NL ls [16] uint8.
// Each type takes exactly its file's bytes per weight, but Q5_K (5.625 bits against 5.5) and IQ4_XS
// (4.3125 against 4.25): their 6-bit sub-scales are kept a byte each.
//
// Activations: each row, each group of 32 quantized on its own: xd = max|x| / 127, xq =
// round-half-even(x * (xd > 0 ? 1 / xd : 0)) clamped to -127..127, xs = sum(xq) (int32).
// Per row, output and group, exactly in int32: idot = sum_j u_j * xq_j (|idot| < 2^20); then in
// fp32, groups in order:
//   SYM    t = d * float(idot - z * xs)
//   AFFINE t = d * float(idot) + m * float(xs)
//   KQ     t = (d * float(sc)) * float(idot) - (dmin * float(mn)) * float(xs)
//   NL     t = (d * float(ls - 32)) * float(idot - 128 * xs)
//   acc = acc + xd * t;   y = acc (+ bias).
// Every output element is that fixed sequence whatever the rows, threads or instruction set
// (threads split tiles, never K): equal to the pure-torch reference in specdec/runtime/blocks.py.
// Compiled with -ffp-contract=off: no multiply-add is fused.
//
// blocks_repack writes the layout from the file's own blocks (a byte shuffle, no arithmetic).
// half_linear multiplies F16 and BF16 matrices as stored (see its section).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vnni.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTile = 16, kGroup = 32, kSuper = 8;
enum Rule { SYM, AFFINE, KQ, NL };
enum Type { T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q5_K, T_IQ4_NL, T_IQ4_XS, T_COUNT };

template <int T> struct Traits;
template <> struct Traits<T_Q4_0> { static constexpr int bits = 4, rule = SYM, zero = 8, block = 18, lut = 0; };
template <> struct Traits<T_Q4_1> { static constexpr int bits = 4, rule = AFFINE, zero = 0, block = 20, lut = 0; };
template <> struct Traits<T_Q5_0> { static constexpr int bits = 5, rule = SYM, zero = 16, block = 22, lut = 0; };
template <> struct Traits<T_Q5_1> { static constexpr int bits = 5, rule = AFFINE, zero = 0, block = 24, lut = 0; };
template <> struct Traits<T_Q8_0> { static constexpr int bits = 8, rule = SYM, zero = 128, block = 34, lut = 0; };
template <> struct Traits<T_Q5_K> { static constexpr int bits = 5, rule = KQ, zero = 0, block = 176, lut = 0; };
template <> struct Traits<T_IQ4_NL> { static constexpr int bits = 4, rule = SYM, zero = 128, block = 18, lut = 1; };
template <> struct Traits<T_IQ4_XS> { static constexpr int bits = 4, rule = NL, zero = 128, block = 136, lut = 1; };

// IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl) + 128: the unsigned codes multiplied.
alignas(16) constexpr uint8_t kIQ4[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

constexpr bool super_rule(int rule) { return rule == KQ || rule == NL; }  // scales per superblock of 8 groups
constexpr int64_t header_bytes(int rule) { return rule == KQ ? 64 : rule == NL ? 32 : 0; }
constexpr int64_t code_bytes(int bits) { return bits == 8 ? 512 : bits == 5 ? 256 + 64 : 256; }
constexpr int64_t chunk_bytes(int bits, int rule) { return code_bytes(bits) + (rule == AFFINE ? 64 : rule == NL ? 16 : 32); }

template <int T>
constexpr int64_t tile_bytes(int64_t G) {
  using X = Traits<T>;
  return G * chunk_bytes(X::bits, X::rule) + (G / kSuper) * header_bytes(X::rule);
}

int64_t g_prefetch = 2048;  // bytes ahead of the chunk being read
int g_force_isa = 0;        // tests: 0 = best, 1 = AVX2, 3 = AVX-512 VNNI, 4 = portable

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// ---------------------------------------------------------------- activations
void quantize_scalar(const float* x, int64_t begin, int64_t end, int8_t* xq, float* xd, int32_t* xs) {
  for (int64_t i = begin; i < end; ++i) {  // i = m * G + g: contiguous groups of 32
    const float* src = x + i * kGroup;
    float amax = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float dd = amax / 127.0f;
    const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      float v = std::nearbyint(src[j] * id);
      v = std::min(127.0f, std::max(-127.0f, v));
      xq[i * kGroup + j] = static_cast<int8_t>(v);
      sum += xq[i * kGroup + j];
    }
    xd[i] = dd;
    xs[i] = sum;
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
// The same per-element operations 16 lanes at a time (max|x| is exact in any order; NaN skipped
// as std::max skips it), so the same codes, scales and sums.
void quantize_avx512(const float* x, int64_t begin, int64_t end, int8_t* xq, float* xd, int32_t* xs) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i sign = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t i = begin; i < end; ++i) {
    const float* src = x + i * kGroup;
    const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
    const auto abs = [&](__m512 v) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), sign)); };
    const float dd = _mm512_reduce_max_ps(_mm512_max_ps(abs(b), _mm512_max_ps(abs(a), _mm512_setzero_ps()))) / 127.0f;
    const __m512 id = _mm512_set1_ps(dd > 0.0f ? 1.0f / dd : 0.0f);
    __m512i c[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(h ? b : a, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * kGroup + 16 * h), _mm512_cvtepi32_epi8(c[h]));
    }
    xd[i] = dd;
    xs[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(c[0], c[1]));
  }
}
#pragma GCC pop_options

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq");
  return yes;
}
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return yes;
}

void quantize(const float* x, int64_t M, int64_t G, int8_t* xq, float* xd, int32_t* xs, bool vector) {
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    if (vector && has_avx512())
      quantize_avx512(x, begin, end, xq, xd, xs);
    else
      quantize_scalar(x, begin, end, xq, xd, xs);
  });
}

// ---------------------------------------------------------------- portable
template <int T>
inline int32_t code_at(const uint8_t* chunk, int64_t o, int64_t l) {
  using X = Traits<T>;
  if constexpr (X::bits == 8) return chunk[64 * (l / 4) + 4 * o + l % 4];
  const int64_t half = l / 16, r = (l % 16) / 4, t = l % 4;
  const uint8_t b = chunk[64 * r + 4 * o + t];
  int32_t c = half ? b >> 4 : b & 0x0F;
  if constexpr (X::bits == 5) c |= ((chunk[256 + 4 * o + t] >> (4 * half + r)) & 1) << 4;
  if constexpr (X::lut) c = kIQ4[c];
  return c;
}

template <int T>
void tiles_portable(int64_t t0, int64_t t1, int64_t M, int64_t G, int64_t N, const uint8_t* P, const int8_t* XQ,
                    const float* XD, const int32_t* XS, const float* B, float* Y) {
  using X = Traits<T>;
  constexpr int64_t CB = code_bytes(X::bits), CH = chunk_bytes(X::bits, X::rule);
  const int64_t K = G * kGroup, TB = tile_bytes<T>(G);
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t o = 0; o < kTile; ++o)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f, d = 0.0f, dmin = 0.0f;
        const uint8_t* p = P + tile * TB;
        for (int64_t g = 0; g < G; ++g) {
          if (super_rule(X::rule) && g % kSuper == 0) {
            d = _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[o]);
            if (X::rule == KQ) dmin = _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[kTile + o]);
            p += header_bytes(X::rule);
          }
          const int8_t* xq = XQ + m * K + g * kGroup;
          int32_t idot = 0;
          for (int64_t l = 0; l < kGroup; ++l) idot += code_at<T>(p, o, l) * xq[l];
          const int32_t xs = XS[m * G + g];
          const uint16_t* h = reinterpret_cast<const uint16_t*>(p + CB);
          float t;
          if constexpr (X::rule == SYM) {
            t = _cvtsh_ss(h[o]) * static_cast<float>(idot - X::zero * xs);
          } else if constexpr (X::rule == AFFINE) {
            t = _cvtsh_ss(h[o]) * static_cast<float>(idot) + _cvtsh_ss(h[kTile + o]) * static_cast<float>(xs);
          } else if constexpr (X::rule == NL) {
            t = (d * static_cast<float>(static_cast<int32_t>(p[CB + o]) - 32)) * static_cast<float>(idot - X::zero * xs);
          } else {
            const float a = d * static_cast<float>(p[CB + o]), b = dmin * static_cast<float>(p[CB + kTile + o]);
            t = a * static_cast<float>(idot) - b * static_cast<float>(xs);
          }
          acc = acc + XD[m * G + g] * t;
          p += CH;
        }
        if (B) acc = acc + B[tile * kTile + o];
        Y[m * N + tile * kTile + o] = acc;
      }
}

// ---------------------------------------------------------------- AVX-512 VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")
// wv[2r]: inputs 4r..4r+3 of the 16 outputs (one 32-bit lane each), wv[2r + 1]: inputs 16 + 4r..
template <int T>
static inline void codes512(const uint8_t* chunk, __m512i wv[8]) {
  using X = Traits<T>;
  if constexpr (X::bits == 8) {
    for (int r = 0; r < 4; ++r) {
      wv[2 * r] = _mm512_loadu_si512(chunk + 64 * r);
      wv[2 * r + 1] = _mm512_loadu_si512(chunk + 64 * (4 + r));
    }
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < 4; ++r) {
      const __m512i v = _mm512_loadu_si512(chunk + 64 * r);
      wv[2 * r] = _mm512_and_si512(v, m4);
      wv[2 * r + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if constexpr (X::bits == 5) {
      const __m512i hb = _mm512_loadu_si512(chunk + 256), one = _mm512_set1_epi8(0x01);
      for (int r = 0; r < 4; ++r) {
        wv[2 * r] = _mm512_or_si512(wv[2 * r], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, r), one), 4));
        wv[2 * r + 1] = _mm512_or_si512(wv[2 * r + 1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 + r), one), 4));
      }
    }
    if constexpr (X::lut) {  // index -> value + 128, one byte shuffle per register
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4)));
      for (int r = 0; r < 8; ++r) wv[r] = _mm512_shuffle_epi8(table, wv[r]);
    }
  }
}

static inline __m512i dots512(const __m512i wv[8], const int32_t* x4) {
  __m512i i0 = dpbusd_bcst(_mm512_setzero_si512(), wv[0], x4 + 0);
  __m512i i1 = dpbusd_bcst(_mm512_setzero_si512(), wv[1], x4 + 4);
  for (int r = 1; r < 4; ++r) {
    i0 = dpbusd_bcst(i0, wv[2 * r], x4 + r);
    i1 = dpbusd_bcst(i1, wv[2 * r + 1], x4 + 4 + r);
  }
  return _mm512_add_epi32(i0, i1);
}

template <int T, int R>
static void rows512(const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD, const int32_t* XS,
                    const float* bias, float* Y, int64_t N) {
  using X = Traits<T>;
  constexpr int64_t CB = code_bytes(X::bits), CH = chunk_bytes(X::bits, X::rule);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (super_rule(X::rule) && g % kSuper == 0) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      if (X::rule == KQ) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      p += header_bytes(X::rule);
    }
    for (int64_t line = 0; line < CH; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + g_prefetch + line, _MM_HINT_T0);
    __m512i wv[8];
    codes512<T>(p, wv);
    __m512 s0, s1;
    if constexpr (X::rule == KQ) {
      s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + CB)))));
      s1 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + CB + 16)))));
    } else if constexpr (X::rule == NL) {
      const __m512i ls = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + CB)));
      s0 = s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
    } else {
      s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + CB)));
      s1 = X::rule == AFFINE ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + CB + 32))) : s0;
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i idot = dots512(wv, reinterpret_cast<const int32_t*>(XQ + i * K + g * kGroup));
      const int32_t xs = XS[i * G + g];
      __m512 t;
      if constexpr (X::rule == SYM || X::rule == NL) {
        t = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(_mm512_sub_epi32(idot, _mm512_set1_epi32(X::zero * xs))));
      } else {
        const __m512 a = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(idot));
        const __m512 b = _mm512_mul_ps(s1, _mm512_set1_ps(static_cast<float>(xs)));
        t = X::rule == AFFINE ? _mm512_add_ps(a, b) : _mm512_sub_ps(a, b);
      }
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(XD[i * G + g]), t));
    }
    p += CH;
  }
  for (int i = 0; i < R; ++i) {
    __m512 out = acc[i];
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(Y + i * N, out);
  }
}

template <int T, int R>
static void dispatch512(int rows, const uint8_t* p, int64_t G, int64_t K, const int8_t* XQ, const float* XD,
                        const int32_t* XS, const float* bias, float* Y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return rows512<T, R>(p, G, K, XQ, XD, XS, bias, Y, N);
    return dispatch512<T, R - 1>(rows, p, G, K, XQ, XD, XS, bias, Y, N);
  }
}

constexpr int kRows512 = 8;

template <int T>
void tiles_avx512(int64_t t0, int64_t t1, int64_t M, int64_t G, int64_t N, const uint8_t* P, const int8_t* XQ,
                  const float* XD, const int32_t* XS, const float* B, float* Y) {
  const int64_t K = G * kGroup, TB = tile_bytes<T>(G);
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t m0 = 0; m0 < M; m0 += kRows512) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows512, M - m0));
      dispatch512<T, kRows512>(rows, P + tile * TB, G, K, XQ + m0 * K, XD + m0 * G, XS + m0 * G,
                               B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N);
    }
}
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX2
// Per half tile (8 outputs). vpmaddubsw sums two u8 x s8 products into int16 with saturation:
// 4- and 5-bit codes (<= 31) keep any four such sums below 2^15 (4 * 2 * 31 * 127 = 31496);
// 8-bit codes (and the IQ4 types' looked-up values) are split into nibbles, dot = dot(low) + 16 *
// dot(high), each exact the same way.
template <int T>
static inline void codes256(const uint8_t* chunk, int64_t h, __m256i wv[8]) {
  using X = Traits<T>;
  const uint8_t* c = chunk + 32 * h;
  if constexpr (X::bits == 8) {
    for (int r = 0; r < 4; ++r) {
      wv[2 * r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
      wv[2 * r + 1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * (4 + r)));
    }
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < 4; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
      wv[2 * r] = _mm256_and_si256(v, m4);
      wv[2 * r + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if constexpr (X::bits == 5) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256 + 32 * h)), one = _mm256_set1_epi8(0x01);
      for (int r = 0; r < 4; ++r) {
        wv[2 * r] = _mm256_or_si256(wv[2 * r], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, r), one), 4));
        wv[2 * r + 1] = _mm256_or_si256(wv[2 * r + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4 + r), one), 4));
      }
    }
    if constexpr (X::lut) {
      const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4)));
      for (int r = 0; r < 8; ++r) wv[r] = _mm256_shuffle_epi8(table, wv[r]);
    }
  }
}

static inline __m256i dots256_small(const __m256i wv[8], const int32_t* x4) {
  __m256i s0 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(x4[0]));
  __m256i s1 = _mm256_maddubs_epi16(wv[1], _mm256_set1_epi32(x4[4]));
  for (int r = 1; r < 4; ++r) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[2 * r], _mm256_set1_epi32(x4[r])));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[2 * r + 1], _mm256_set1_epi32(x4[4 + r])));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
}

template <int T>
static inline __m256i dots256(const __m256i wv[8], const int32_t* x4) {
  if constexpr (Traits<T>::bits == 8 || Traits<T>::lut) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo[8], hi[8];
    for (int r = 0; r < 8; ++r) {
      lo[r] = _mm256_and_si256(wv[r], m4);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(wv[r], 4), m4);
    }
    return _mm256_add_epi32(dots256_small(lo, x4), _mm256_slli_epi32(dots256_small(hi, x4), 4));
  } else {
    return dots256_small(wv, x4);
  }
}

constexpr int kRowsAvx2 = 4;

template <int T, int R>
static void rows256(const uint8_t* p, int64_t G, int64_t K, int64_t h, const int8_t* XQ, const float* XD,
                    const int32_t* XS, const float* bias, float* Y, int64_t N) {
  using X = Traits<T>;
  constexpr int64_t CB = code_bytes(X::bits), CH = chunk_bytes(X::bits, X::rule);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (super_rule(X::rule) && g % kSuper == 0) {
      d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      if (X::rule == KQ) dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
      p += header_bytes(X::rule);
    }
    _mm_prefetch(reinterpret_cast<const char*>(p) + g_prefetch, _MM_HINT_T0);
    __m256i wv[8];
    codes256<T>(p, h, wv);
    __m256 s0, s1;
    if constexpr (X::rule == KQ) {
      s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + CB + 8 * h)))));
      s1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + CB + 16 + 8 * h)))));
    } else if constexpr (X::rule == NL) {
      const __m256i ls = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + CB + 8 * h)));
      s0 = s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
    } else {
      s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + CB + 16 * h)));
      s1 = X::rule == AFFINE ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + CB + 32 + 16 * h))) : s0;
    }
    for (int i = 0; i < R; ++i) {
      const __m256i idot = dots256<T>(wv, reinterpret_cast<const int32_t*>(XQ + i * K + g * kGroup));
      const int32_t xs = XS[i * G + g];
      __m256 t;
      if constexpr (X::rule == SYM || X::rule == NL) {
        t = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_sub_epi32(idot, _mm256_set1_epi32(X::zero * xs))));
      } else {
        const __m256 a = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(idot));
        const __m256 b = _mm256_mul_ps(s1, _mm256_set1_ps(static_cast<float>(xs)));
        t = X::rule == AFFINE ? _mm256_add_ps(a, b) : _mm256_sub_ps(a, b);
      }
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_set1_ps(XD[i * G + g]), t));
    }
    p += CH;
  }
  for (int i = 0; i < R; ++i) {
    __m256 out = acc[i];
    if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + 8 * h));
    _mm256_storeu_ps(Y + i * N + 8 * h, out);
  }
}

template <int T, int R>
static void dispatch256(int rows, const uint8_t* p, int64_t G, int64_t K, int64_t h, const int8_t* XQ, const float* XD,
                        const int32_t* XS, const float* bias, float* Y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return rows256<T, R>(p, G, K, h, XQ, XD, XS, bias, Y, N);
    return dispatch256<T, R - 1>(rows, p, G, K, h, XQ, XD, XS, bias, Y, N);
  }
}

template <int T>
void tiles_avx2(int64_t t0, int64_t t1, int64_t M, int64_t G, int64_t N, const uint8_t* P, const int8_t* XQ,
                const float* XD, const int32_t* XS, const float* B, float* Y) {
  const int64_t K = G * kGroup, TB = tile_bytes<T>(G);
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAvx2) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsAvx2, M - m0));
        dispatch256<T, kRowsAvx2>(rows, P + tile * TB, G, K, h, XQ + m0 * K, XD + m0 * G, XS + m0 * G,
                                  B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N);
      }
}

// ---------------------------------------------------------------- the product
template <int T>
torch::Tensor linear_t(const torch::Tensor& x_in, const torch::Tensor& packed, const torch::Tensor& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.is_contiguous(), "x must be [..., K] contiguous fp32");
  auto x = x_in.view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0), N = NT * kTile, G = K / kGroup;
  TORCH_CHECK(K % (super_rule(Traits<T>::rule) ? kGroup * kSuper : kGroup) == 0, "in_features ", K, " is not whole blocks");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(1) == tile_bytes<T>(G), "packed must be [N/16, tile bytes] contiguous uint8");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "bias must be [N/16*16] fp32");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty(out_shape, x.options());
  if (M == 0) return y;
  const int isa = g_force_isa ? g_force_isa : (has_avx512() ? 3 : has_avx2() ? 1 : 4);
  TORCH_CHECK((isa != 3 || has_avx512()) && (isa != 1 || has_avx2()), "this CPU cannot run the forced instruction set");
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto xd = torch::empty({M, G}, x.options());
  auto xs = torch::empty({M, G}, x.options().dtype(torch::kInt));
  quantize(x.data_ptr<float>(), M, G, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<int32_t>(), isa != 4);
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XD = xd.data_ptr<float>();
  const int32_t* XS = xs.data_ptr<int32_t>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    if (isa == 3)
      tiles_avx512<T>(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
    else if (isa == 1)
      tiles_avx2<T>(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
    else
      tiles_portable<T>(begin, end, M, G, N, P, XQ, XD, XS, B, Y);
  });
  return y;
}

// ---------------------------------------------------------------- repack from the file's blocks
// The 32 codes of group j of block b, as unsigned bytes (Q8_0: q + 128).
template <int T>
inline void group_codes(const uint8_t* b, int64_t j, uint8_t c[32]) {
  using X = Traits<T>;
  if constexpr (T == T_Q8_0) {
    for (int l = 0; l < 32; ++l) c[l] = b[2 + l] ^ 0x80;
  } else if constexpr (T == T_Q5_K) {  // d, dmin, 12 bytes of scales, qh [32], qs [128]
    const uint8_t* qs = b + 48 + (j / 2) * 32;
    for (int l = 0; l < 32; ++l) c[l] = ((qs[l] >> (4 * (j % 2))) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
  } else if constexpr (T == T_IQ4_XS) {  // d, scales_h u16, scales_l [4], qs [128]: group j's in qs[16j..]
    const uint8_t* qs = b + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      c[l] = qs[l] & 0x0F;
      c[16 + l] = qs[l] >> 4;
    }
  } else {  // d [, m] [, qh u32], qs [16]: weight l < 16 in qs[l]'s low nibble, 16 + l in its high
    const int64_t at = X::rule == AFFINE ? 4 : 2;
    const uint8_t* qs = b + at + (X::bits == 5 ? 4 : 0);
    const uint32_t qh = X::bits == 5 ? load32(b + at) : 0;
    for (int l = 0; l < 16; ++l) {
      c[l] = (qs[l] & 0x0F) | (((qh >> l) & 1) << 4);
      c[16 + l] = (qs[l] >> 4) | (((qh >> (16 + l)) & 1) << 4);
    }
  }
}

inline void k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 0x3F;
    *m = s[j + 4] & 0x3F;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group g of output o (block b holds it) into its tile chunk.
template <int T>
void place(const uint8_t* b, int64_t j, int64_t o, uint8_t* chunk) {
  using X = Traits<T>;
  constexpr int64_t CB = code_bytes(X::bits);
  uint8_t c[32];
  group_codes<T>(b, j, c);
  if constexpr (X::bits == 8) {
    for (int r = 0; r < 8; ++r) std::memcpy(chunk + 64 * r + 4 * o, c + 4 * r, 4);
  } else {
    for (int r = 0; r < 4; ++r)
      for (int t = 0; t < 4; ++t) {
        const int l = 4 * r + t;
        chunk[64 * r + 4 * o + t] = (c[l] & 0x0F) | ((c[16 + l] & 0x0F) << 4);
        if constexpr (X::bits == 5) chunk[256 + 4 * o + t] |= ((c[l] >> 4) << r) | ((c[16 + l] >> 4) << (4 + r));
      }
  }
  if constexpr (X::rule == KQ) {
    k_scale_min(b + 4, static_cast<int>(j), chunk + CB + o, chunk + CB + kTile + o);
  } else if constexpr (X::rule == NL) {  // the 6-bit sub-scale: 4 low bits in scales_l, 2 high in scales_h
    const uint16_t high = static_cast<uint16_t>(b[2] | (b[3] << 8));
    chunk[CB + o] = static_cast<uint8_t>(((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4));
  } else {
    std::memcpy(chunk + CB + 2 * o, b, 2);
    if constexpr (X::rule == AFFINE) std::memcpy(chunk + CB + 32 + 2 * o, b + 2, 2);
  }
}

template <int T>
void repack_t(const torch::Tensor& src, const torch::Tensor& rows, torch::Tensor& out, int64_t tile0) {
  using X = Traits<T>;
  constexpr int64_t CH = chunk_bytes(X::bits, X::rule);
  constexpr int64_t per_block = super_rule(X::rule) ? kSuper : 1;  // groups in one file block
  TORCH_CHECK(src.dtype() == torch::kUInt8 && src.dim() == 2 && src.is_contiguous(), "src: contiguous uint8 [R, row bytes]");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.dim() == 2 && out.is_contiguous(), "out: contiguous uint8 [tiles, bytes]");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1, "rows: int64 [n]");
  const int64_t n = rows.size(0), R = src.size(0), row_bytes = src.size(1);
  TORCH_CHECK(row_bytes % X::block == 0, "src rows are not whole blocks");
  const int64_t G = row_bytes / X::block * per_block, tiles = (n + kTile - 1) / kTile, TB = tile_bytes<T>(G);
  TORCH_CHECK(out.size(1) == TB, "out's tiles do not match src's blocks");
  TORCH_CHECK(tile0 >= 0 && tile0 + tiles <= out.size(0), "out has too few tiles");
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < R, "row index out of range");
  const uint8_t* base = src.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>() + tile0 * TB;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = dst + t * TB;
      std::memset(tile, 0, TB);
      for (int64_t o = 0; o < kTile && t * kTile + o < n; ++o) {
        const uint8_t* row = base + ids[t * kTile + o] * row_bytes;
        uint8_t* p = tile;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = row + (g / per_block) * X::block;
          if (super_rule(X::rule) && g % kSuper == 0) {
            std::memcpy(p + 2 * o, b, 2);
            if (X::rule == KQ) std::memcpy(p + 32 + 2 * o, b + 2, 2);
            p += header_bytes(X::rule);
          }
          place<T>(b, g % per_block, o, p);
          p += CH;
        }
      }
    }
  });
}

template <template <int> class F, typename... A>
auto by_type(int64_t type, A&&... a) {
  TORCH_CHECK(type >= 0 && type < T_COUNT, "unknown block type ", type);
  switch (type) {
    case T_Q4_0: return F<T_Q4_0>::run(a...);
    case T_Q4_1: return F<T_Q4_1>::run(a...);
    case T_Q5_0: return F<T_Q5_0>::run(a...);
    case T_Q5_1: return F<T_Q5_1>::run(a...);
    case T_Q8_0: return F<T_Q8_0>::run(a...);
    case T_IQ4_NL: return F<T_IQ4_NL>::run(a...);
    case T_IQ4_XS: return F<T_IQ4_XS>::run(a...);
    default: return F<T_Q5_K>::run(a...);
  }
}

template <int T> struct Linear { static torch::Tensor run(const torch::Tensor& x, const torch::Tensor& p, const torch::Tensor& b) { return linear_t<T>(x, p, b); } };
template <int T> struct Repack { static int64_t run(const torch::Tensor& s, const torch::Tensor& r, torch::Tensor& o, int64_t t0) { repack_t<T>(s, r, o, t0); return 0; } };
template <int T> struct TileBytes { static int64_t run(int64_t G) { return tile_bytes<T>(G); } };

// ---------------------------------------------------------------- 16-bit floats (F16, BF16)
// w [N, K] as stored (uint16: IEEE half or bfloat16), x [M, K] fp32. Per row and output, 16 lanes:
// lane j sums w[k] * x[k] over k = j mod 16 in order (one rounding per multiply and per add), then
// the lanes are summed as a fixed tree (j + 8, then + 4, + 2, + 1). Every instruction set does
// exactly these operations, whatever the rows beside it.
constexpr int kLanes = 16, kRowsHalf = 4;

inline float half_value(uint16_t v, bool bf16) {
  if (!bf16) return _cvtsh_ss(v);
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float lane_tree(float* a) {
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) a[j] = a[j] + a[j + width];
  return a[0];
}

void half_portable(int64_t n0, int64_t n1, int64_t M, int64_t K, const uint16_t* W, const float* X, const float* B,
                   float* Y, int64_t N, bool bf16) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float lanes[kLanes] = {0.0f};
      for (int64_t k = 0; k < K; k += kLanes)
        for (int j = 0; j < kLanes; ++j) lanes[j] = lanes[j] + half_value(W[n * K + k + j], bf16) * X[m * K + k + j];
      float acc = lane_tree(lanes);
      if (B) acc = acc + B[n];
      Y[m * N + n] = acc;
    }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,f16c")
inline __m512 half16_512(const uint16_t* w, bool bf16) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  if (!bf16) return _mm512_cvtph_ps(raw);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

void half_avx512(int64_t n0, int64_t n1, int64_t M, int64_t K, const uint16_t* W, const float* X, const float* B,
                 float* Y, int64_t N, bool bf16) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += kRowsHalf) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsHalf, M - m0));
      __m512 acc[kRowsHalf];
      for (int i = 0; i < kRowsHalf; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kLanes) {
        _mm_prefetch(reinterpret_cast<const char*>(W + n * K + k) + 1024, _MM_HINT_T0);
        const __m512 w = half16_512(W + n * K + k, bf16);
        for (int i = 0; i < rows; ++i) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(w, _mm512_loadu_ps(X + (m0 + i) * K + k)));
      }
      for (int i = 0; i < rows; ++i) {
        alignas(64) float lanes[kLanes];
        _mm512_store_ps(lanes, acc[i]);
        float out = lane_tree(lanes);
        if (B) out = out + B[n];
        Y[(m0 + i) * N + n] = out;
      }
    }
}
#pragma GCC pop_options

inline __m256 half8_256(const uint16_t* w, bool bf16) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if (!bf16) return _mm256_cvtph_ps(raw);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

void half_avx2(int64_t n0, int64_t n1, int64_t M, int64_t K, const uint16_t* W, const float* X, const float* B,
               float* Y, int64_t N, bool bf16) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += kRowsHalf) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsHalf, M - m0));
      __m256 lo[kRowsHalf], hi[kRowsHalf];  // lanes 0-7 and 8-15
      for (int i = 0; i < kRowsHalf; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += kLanes) {
        _mm_prefetch(reinterpret_cast<const char*>(W + n * K + k) + 1024, _MM_HINT_T0);
        const __m256 w0 = half8_256(W + n * K + k, bf16), w1 = half8_256(W + n * K + k + 8, bf16);
        for (int i = 0; i < rows; ++i) {
          const float* x = X + (m0 + i) * K + k;
          lo[i] = _mm256_add_ps(lo[i], _mm256_mul_ps(w0, _mm256_loadu_ps(x)));
          hi[i] = _mm256_add_ps(hi[i], _mm256_mul_ps(w1, _mm256_loadu_ps(x + 8)));
        }
      }
      for (int i = 0; i < rows; ++i) {
        float lanes[kLanes];
        _mm256_storeu_ps(lanes, lo[i]);
        _mm256_storeu_ps(lanes + 8, hi[i]);
        float out = lane_tree(lanes);
        if (B) out = out + B[n];
        Y[(m0 + i) * N + n] = out;
      }
    }
}

}  // namespace

// x [..., K] fp32 contiguous, packed [N/16, tile bytes] uint8 (blocks_repack's layout) -> y [..., N16].
torch::Tensor blocks_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t type) {
  return by_type<Linear>(type, x, packed, bias);
}

void blocks_repack(int64_t type, torch::Tensor src, torch::Tensor rows, torch::Tensor out, int64_t tile0) {
  by_type<Repack>(type, src, rows, out, tile0);
}

int64_t blocks_tile_bytes(int64_t type, int64_t groups) { return by_type<TileBytes>(type, groups); }

// x [..., K] fp32 contiguous (K a multiple of 16), w [N, K] int16 (F16 or BF16 bits) -> y [..., N].
torch::Tensor half_linear(torch::Tensor x_in, torch::Tensor w, torch::Tensor bias, bool bf16) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.is_contiguous(), "x must be [..., K] contiguous fp32");
  auto x = x_in.view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kLanes == 0, "16-bit float layers need in_features divisible by 16, got ", K);
  TORCH_CHECK(w.scalar_type() == torch::kShort && w.is_contiguous() && w.dim() == 2 && w.size(1) == K, "w must be [N, K] contiguous int16");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "bias must be [N] fp32");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty(out_shape, x.options());
  if (M == 0) return y;
  const int isa = g_force_isa ? g_force_isa : (has_avx512() ? 3 : has_avx2() ? 1 : 4);
  TORCH_CHECK((isa != 3 || has_avx512()) && (isa != 1 || has_avx2()), "this CPU cannot run the forced instruction set");
  const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<int16_t>());
  const float* X = x.data_ptr<float>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (isa == 3)
      half_avx512(begin, end, M, K, W, X, B, Y, N, bf16);
    else if (isa == 1)
      half_avx2(begin, end, M, K, W, X, B, Y, N, bf16);
    else
      half_portable(begin, end, M, K, W, X, B, Y, N, bf16);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocks_linear", &blocks_linear, "GGUF 32-weight block types (exact) x int8 activations (batch invariant)");
  m.def("blocks_repack", &blocks_repack, "GGUF blocks of one type -> the kernel's tiles (type, src, rows, out, tile0)");
  m.def("half_linear", &half_linear, "GGUF F16 or BF16 weights as stored x fp32 activations (batch invariant)");
  m.def("blocks_tile_bytes", &blocks_tile_bytes, "bytes of one tile of 16 outputs over `groups` groups of 32");
  m.def("force_isa", [](int isa) { g_force_isa = isa; }, "tests: 0 = best, 1 = AVX2, 3 = AVX-512 VNNI, 4 = portable");
  m.def("set_prefetch", [](int64_t bytes) { g_prefetch = bytes; }, "measurements: software prefetch distance in bytes");
}
