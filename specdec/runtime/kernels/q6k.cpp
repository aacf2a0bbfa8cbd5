// GGUF Q6_K weights, exactly as stored, x int8 activations: batch invariant.
//
// A Q6_K superblock of one row holds 256 weights: 6-bit codes u (0..63), one signed 8-bit scale
// sc per 16 weights and an fp16 d, with w = d * sc * (u - 32). Every such w is exact in fp32 (at
// most 11 + 7 + 5 significant bits): the weights multiplied here are the file's, bit for bit as
// gguf dequantizes them, in as many bytes as the file's (6.56 bits a weight).
//
// Layout, per tile of 16 output channels and superblock of 256 inputs (one contiguous run):
//   codes [16 groups][192]: with c(r) = u[o][16g + 4r + t] (r, t = 0..3, o = 0..15), group g's
//     byte 64p + 4o + t (p = 0, 1) holds the low 4 bits of c(2p) and, above them, of c(2p + 1);
//     byte 128 + 4o + t holds the top 2 bits of c(0), c(1), c(2), c(3) at bits 0, 2, 4, 6;
//   sc [16 groups][16] int8; d [16] fp16 - 3,360 bytes for 4,096 weights. Tiles follow each other.
// Unpacked, the codes of inputs 4r..4r+3 of the 16 outputs are one 64-byte row r (lane o = output
// o), the operand of the integer dot products below.
// Activations: each row, each superblock of 256 inputs quantized on its own (xd = max|x| / 127,
// xq = round-half-even(x / xd) in -127..127) with the code sum of each group of 16 (xs).
// Per row, output and superblock, exactly in int32 (|.| < 2^29):
//   isc = sum_g sc[g] * (sum_j u[g, j] * xq[g, j] - 32 * xs[g]);
// then in fp32, superblocks in order: acc = acc + xd[s] * (d * float(isc)).
// Every output element is that fixed sequence whatever the rows, threads or instruction set
// (threads split tiles, never K): equal to the pure-torch reference in specdec/runtime/q6k.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vnni.h"
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kTile = 16, kGroup = 16, kGroups = 16, kSuper = 256;
constexpr int64_t kGroupBytes = 192, kCodes = kGroups * kGroupBytes, kSbBytes = kCodes + kGroups * kTile + 2 * kTile;  // 3360
int64_t g_prefetch = 4 * 3360;  // bytes ahead: four superblocks (measured: docs/CHANGELOG.md, 'Q6_K per-superblock offsets')

// Code c(r) of byte position i (= 4o + t) of a group's packed codes p.
inline int32_t code(const uint8_t* p, int64_t r, int64_t i) {
  const int32_t low = (p[64 * (r / 2) + i] >> (4 * (r % 2))) & 0x0F;
  return low | (((p[128 + i] >> (2 * r)) & 0x03) << 4);
}
int g_force_isa = 0;        // tests: 0 = best, 1 = AVX2, 3 = AVX-512 VNNI, 4 = portable

// xq [M, K], xd [M, S], xs [M, K / 16] (the groups of 16's code sums, |xs| <= 2032: exact in int16)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, int16_t* xs) {
  const int64_t S = K / kSuper;
  at::parallel_for(0, M * S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kSuper;  // row m = i / S, superblock s = i % S: contiguous
      float amax = 0.0f;
      for (int64_t j = 0; j < kSuper; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float dd = amax / 127.0f;
      const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
      int8_t* dst = xq + i * kSuper;
      for (int64_t g = 0; g < kGroups; ++g) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          float v = std::nearbyint(src[g * kGroup + j] * id);
          v = std::min(127.0f, std::max(-127.0f, v));
          dst[g * kGroup + j] = static_cast<int8_t>(v);
          sum += dst[g * kGroup + j];
        }
        xs[i * kGroups + g] = static_cast<int16_t>(sum);
      }
      xd[i] = dd;
    }
  });
}

void tiles_portable(int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t N, const uint8_t* P, const int8_t* XQ,
                    const float* XD, const int16_t* XS, const float* B, float* Y) {
  const int64_t S = K / kSuper;
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t o = 0; o < kTile; ++o)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
          const uint8_t* p = P + (tile * S + s) * kSbBytes;
          const int8_t* sc = reinterpret_cast<const int8_t*>(p + kCodes);
          const uint16_t* d = reinterpret_cast<const uint16_t*>(p + kCodes + kGroups * kTile);
          const int8_t* xq = XQ + m * K + s * kSuper;
          int32_t isc = 0;
          for (int64_t g = 0; g < kGroups; ++g) {
            int32_t idot = 0;
            for (int64_t r = 0; r < 4; ++r)
              for (int64_t t = 0; t < 4; ++t) idot += code(p + g * kGroupBytes, r, 4 * o + t) * xq[g * kGroup + 4 * r + t];
            isc += sc[g * kTile + o] * (idot - 32 * XS[(m * S + s) * kGroups + g]);
          }
          acc = acc + XD[m * S + s] * (_cvtsh_ss(d[o]) * static_cast<float>(isc));
        }
        if (B) acc = acc + B[tile * kTile + o];
        Y[m * N + tile * kTile + o] = acc;
      }
}

// AVX2: per half tile (8 outputs), per group, per row: 4 vpmaddubsw (u <= 63, |xq| <= 127: a pair
// sums to at most 16002, two registers' sum to 32004, exact in int16), 2 vpmaddwd by ones.
constexpr int kRowsAvx2 = 4;

template <int R>
void tile_avx2(const uint8_t* P, int64_t S, int64_t K, int64_t h, const int8_t* XQ, const float* XD,
               const int16_t* XS, const float* bias, float* Y, int64_t N) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* p = P + s * kSbBytes;
    __m256i isc[R];
    for (int i = 0; i < R; ++i) isc[i] = _mm256_setzero_si256();
    for (int64_t g = 0; g < kGroups; ++g) {
      const uint8_t* codes = p + g * kGroupBytes + 32 * h;
      _mm_prefetch(reinterpret_cast<const char*>(codes) + g_prefetch, _MM_HINT_T0);
      const __m256i lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      const __m256i lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 128));
      const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
      const auto top = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), m2), 4); };
      const __m256i w0 = _mm256_or_si256(_mm256_and_si256(lo0, m4), top(0));
      const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4), top(2));
      const __m256i w2 = _mm256_or_si256(_mm256_and_si256(lo1, m4), top(4));
      const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4), top(6));
      const __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kCodes + g * kTile + 8 * h)));
      for (int i = 0; i < R; ++i) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + i * K + s * kSuper + g * kGroup);
        const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(x4[0])),
                                            _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x4[1])));
        const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(w2, _mm256_set1_epi32(x4[2])),
                                            _mm256_maddubs_epi16(w3, _mm256_set1_epi32(x4[3])));
        const __m256i idot = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
        const __m256i t = _mm256_sub_epi32(idot, _mm256_set1_epi32(32 * XS[(i * S + s) * kGroups + g]));
        isc[i] = _mm256_add_epi32(isc[i], _mm256_mullo_epi32(t, scv));
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kCodes + kGroups * kTile + 16 * h)));
    for (int i = 0; i < R; ++i)
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_set1_ps(XD[i * S + s]), _mm256_mul_ps(dv, _mm256_cvtepi32_ps(isc[i]))));
  }
  for (int i = 0; i < R; ++i) {
    __m256 out = acc[i];
    if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + 8 * h));
    _mm256_storeu_ps(Y + i * N + 8 * h, out);
  }
}

template <int R>
void dispatch_avx2(int rows, const uint8_t* P, int64_t S, int64_t K, int64_t h, const int8_t* XQ, const float* XD,
                   const int16_t* XS, const float* bias, float* Y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tile_avx2<R>(P, S, K, h, XQ, XD, XS, bias, Y, N);
    return dispatch_avx2<R - 1>(rows, P, S, K, h, XQ, XD, XS, bias, Y, N);
  }
}

void tiles_avx2(int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t N, const uint8_t* P, const int8_t* XQ,
                const float* XD, const int16_t* XS, const float* B, float* Y) {
  const int64_t S = K / kSuper;
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAvx2) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsAvx2, M - m0));
        dispatch_avx2<kRowsAvx2>(rows, P + tile * S * kSbBytes, S, K, h, XQ + m0 * K, XD + m0 * S,
                                 XS + m0 * S * kGroups, B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N);
      }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
// AVX-512 VNNI: a whole tile per register. Per group and row: one chain of 4 vpdpbusd reading the
// row's activation bytes by embedded broadcast (vnni.h), the multiply by the group's scales and
// an add. The offset's part, -32 * sum_g sc[g] * xs[g], is taken once per superblock and row
// instead of once per group: 8 vpdpwssd over the scales in
// group pairs (built once per tile and superblock, shared by the rows) with the row's pairs of
// int16 code sums by embedded broadcast. The same integers as the reference (integer sums in
// another order, |.| < 2^31 throughout), so the same results; a multi-row call is bound by these
// per-row instructions (measured: docs/CHANGELOG.md, 'Q6_K per-superblock offsets').
constexpr int kRows512 = 8;

// A tile superblock's scales sc [16 groups][16 outputs] (int8) as 8 registers of int16 pairs:
// pairs[q] lane o = (sc[2q][o], sc[2q + 1][o]), the operand of vpdpwssd against (xs[2q], xs[2q + 1]).
static inline void scale_pairs(const int8_t* sc, __m512i pairs[8]) {
  for (int q = 0; q < 8; ++q) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 * q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 * q + 16));
    pairs[q] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
  }
}

// The 16 outputs' unpacked 6-bit codes of a group: w[r] = inputs 4r..4r+3 (u8, one lane an output).
static inline void unpack_group(const uint8_t* codes, __m512i w[4]) {
  const __m512i lo0 = _mm512_loadu_si512(codes), lo1 = _mm512_loadu_si512(codes + 64), hi = _mm512_loadu_si512(codes + 128);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
  const auto top = [&](int shift) { return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, shift), m2), 4); };
  w[0] = _mm512_or_si512(_mm512_and_si512(lo0, m4), top(0));
  w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), m4), top(2));
  w[2] = _mm512_or_si512(_mm512_and_si512(lo1, m4), top(4));
  w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), m4), top(6));
}

template <int R>
void tile_avx512(const uint8_t* P, int64_t S, int64_t K, const int8_t* XQ, const float* XD, const int16_t* XS,
                 const float* bias, float* Y, int64_t N) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* p = P + s * kSbBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + kCodes);
    __m512i isc[R];
    for (int i = 0; i < R; ++i) isc[i] = _mm512_setzero_si512();
    for (int64_t g = 0; g < kGroups; ++g) {
      const uint8_t* codes = p + g * kGroupBytes;
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes) + g_prefetch + line, _MM_HINT_T0);
      __m512i w[4];
      unpack_group(codes, w);
      const __m512i scv = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * kTile)));
      for (int i = 0; i < R; ++i) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + i * K + s * kSuper + g * kGroup);
        __m512i a = dpbusd_bcst(_mm512_setzero_si512(), w[0], x4 + 0);
        a = dpbusd_bcst(a, w[1], x4 + 1);
        a = dpbusd_bcst(a, w[2], x4 + 2);
        a = dpbusd_bcst(a, w[3], x4 + 3);
        isc[i] = _mm512_add_epi32(isc[i], _mm512_mullo_epi32(a, scv));
      }
    }
    __m512i pairs[8];
    scale_pairs(sc, pairs);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kCodes + kGroups * kTile)));
    for (int i = 0; i < R; ++i) {
      const int32_t* xs2 = reinterpret_cast<const int32_t*>(XS + (i * S + s) * kGroups);  // (xs[2q], xs[2q + 1])
      __m512i j0 = dpwssd_bcst(_mm512_setzero_si512(), pairs[0], xs2 + 0);
      __m512i j1 = dpwssd_bcst(_mm512_setzero_si512(), pairs[1], xs2 + 1);
      for (int q = 2; q < 8; q += 2) {
        j0 = dpwssd_bcst(j0, pairs[q], xs2 + q);
        j1 = dpwssd_bcst(j1, pairs[q + 1], xs2 + q + 1);
      }
      const __m512i t = _mm512_sub_epi32(isc[i], _mm512_slli_epi32(_mm512_add_epi32(j0, j1), 5));
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(XD[i * S + s]), _mm512_mul_ps(dv, _mm512_cvtepi32_ps(t))));
    }
  }
  for (int i = 0; i < R; ++i) {
    __m512 out = acc[i];
    if (bias) out = _mm512_add_ps(out, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(Y + i * N, out);
  }
}

template <int R>
void dispatch_avx512(int rows, const uint8_t* P, int64_t S, int64_t K, const int8_t* XQ, const float* XD,
                     const int16_t* XS, const float* bias, float* Y, int64_t N) {
  if constexpr (R > 0) {
    if (rows == R) return tile_avx512<R>(P, S, K, XQ, XD, XS, bias, Y, N);
    return dispatch_avx512<R - 1>(rows, P, S, K, XQ, XD, XS, bias, Y, N);
  }
}

void tiles_avx512(int64_t t0, int64_t t1, int64_t M, int64_t K, int64_t N, const uint8_t* P, const int8_t* XQ,
                  const float* XD, const int16_t* XS, const float* B, float* Y) {
  const int64_t S = K / kSuper;
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t m0 = 0; m0 < M; m0 += kRows512) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows512, M - m0));
      dispatch_avx512<kRows512>(rows, P + tile * S * kSbBytes, S, K, XQ + m0 * K, XD + m0 * S, XS + m0 * S * kGroups,
                                B ? B + tile * kTile : nullptr, Y + m0 * N + tile * kTile, N);
    }
}
#pragma GCC pop_options

}  // namespace

// x [..., K] fp32 contiguous (K a multiple of 256), packed [N/16, K/256 * 3360] uint8 -> y [..., N].
torch::Tensor q6k_linear(torch::Tensor x_in, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.is_contiguous(), "x must be [..., K] contiguous fp32");
  auto x = x_in.view({-1, x_in.size(-1)});
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0), N = NT * kTile, S = K / kSuper;
  TORCH_CHECK(K % kSuper == 0, "Q6_K layers need in_features divisible by 256, got ", K);
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(1) == S * kSbBytes, "packed must be [N/16, K/256 * 3360] contiguous uint8");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "bias must be [N/16*16] fp32");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty(out_shape, x.options());
  if (M == 0) return y;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto xd = torch::empty({M, S}, x.options());
  auto xs = torch::empty({M, K / kGroup}, x.options().dtype(torch::kShort));
  quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<int16_t>());
  static const bool has_avx512 = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                 __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512dq");
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  const int isa = g_force_isa ? g_force_isa : (has_avx512 ? 3 : has_avx2 ? 1 : 4);
  TORCH_CHECK((isa != 3 || has_avx512) && (isa != 1 || has_avx2), "this CPU cannot run the forced instruction set");
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XD = xd.data_ptr<float>();
  const int16_t* XS = xs.data_ptr<int16_t>();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NT, 1, [&](int64_t begin, int64_t end) {
    if (isa == 3)
      tiles_avx512(begin, end, M, K, N, P, XQ, XD, XS, B, Y);
    else if (isa == 1)
      tiles_avx2(begin, end, M, K, N, P, XQ, XD, XS, B, Y);
    else
      tiles_portable(begin, end, M, K, N, P, XQ, XD, XS, B, Y);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q6k_linear", &q6k_linear, "GGUF Q6_K weights (exact) x int8 activations (batch invariant)");
  m.def("force_isa", [](int isa) { g_force_isa = isa; }, "tests: 0 = best, 1 = AVX2, 3 = AVX-512 VNNI, 4 = portable");
  m.def("set_prefetch", [](int64_t bytes) { g_prefetch = bytes; }, "measurements: software prefetch distance in bytes");
}
