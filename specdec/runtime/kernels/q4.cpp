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
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;     // output channels per tile
constexpr int64_t kChunk = 320;   // bytes per tile and group: 256 of codes, 32 of scales, 32 of mins
int64_t g_prefetch = 5120;  // bytes ahead (16 chunks); see docs/BENCHMARKS.md §14 (tunable for measurements)
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
#define Q4_SUFFIX avx2
#define Q4_DOT4(acc, w, a) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)))
#include "q4_blocks.h"
#undef Q4_SUFFIX
#undef Q4_DOT4

#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
#define Q4_SUFFIX vnni
#define Q4_DOT4(acc, w, a) _mm256_dpbusd_epi32(acc, w, a)
#include "q4_blocks.h"
#undef Q4_SUFFIX
#undef Q4_DOT4
#pragma GCC pop_options

// One tile (16 outputs) per 512-bit register where AVX-512 is there: the same per-lane
// operations as q4_blocks.h (so the same results), half the instructions per output. Per row
// and group: 8 vpdpbusd reading the row's 4 activation bytes by embedded broadcast (inline asm:
// compilers emit a separate broadcast), 1 integer add, the float rescaling; the R rows of a
// call share each unpacked chunk and keep their accumulators in registers (R a template
// constant, so the row loop unrolls).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
static inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

template <int R>
static void q4_tile_rows_avx512(const uint8_t* chunk, int64_t G, int64_t K, const int8_t* XQ, const float* D,
                                const float* IS, const float* bias, float* Y, int64_t N) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, chunk += kChunk) {
    for (int64_t line = 0; line < kChunk; line += 64) _mm_prefetch(reinterpret_cast<const char*>(chunk) + g_prefetch + line, _MM_HINT_T0);
    __m512i wv[8];
    for (int r = 0; r < 4; ++r) {
      const __m512i v = _mm512_loadu_si512(chunk + 64 * r);
      wv[2 * r] = _mm512_and_si512(v, mask);
      wv[2 * r + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 288)));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + i * K + g * kGroup);
      // two independent integer chains (exact: their order does not matter), then one sum
      __m512i i0 = dpbusd_bcst(_mm512_setzero_si512(), wv[0], x4 + 0);
      __m512i i1 = dpbusd_bcst(_mm512_setzero_si512(), wv[1], x4 + 4);
      i0 = dpbusd_bcst(i0, wv[2], x4 + 1);
      i1 = dpbusd_bcst(i1, wv[3], x4 + 5);
      i0 = dpbusd_bcst(i0, wv[4], x4 + 2);
      i1 = dpbusd_bcst(i1, wv[5], x4 + 6);
      i0 = dpbusd_bcst(i0, wv[6], x4 + 3);
      i1 = dpbusd_bcst(i1, wv[7], x4 + 7);
      const __m512 t = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)));
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

}  // namespace

// x [..., K] fp32 -> y [..., N] fp32, N = 16 * tiles. bias may be empty.
torch::Tensor q4_linear(torch::Tensor x_in, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == torch::kFloat && x_in.is_contiguous(), "x must be [..., K] contiguous fp32");
  auto x = x_in.view({-1, x_in.size(-1)});
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kChunk && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "packed must be [N/16, G, 320] contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), NT = packed.size(0), G = packed.size(1), N = NT * kTile;
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat), "bias must be [N/16*16] fp32");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty(out_shape, x.options());
  if (M == 0) return y;
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
  m.def("q4_linear", &q4_linear, "4-bit weight x per-group int8 activation linear (batch invariant)");
  m.def("uses_vnni", []() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"); });
  m.def("set_prefetch", [](int64_t bytes) { g_prefetch = bytes; }, "measurements: software prefetch distance in bytes");
  m.def("force_isa", [](int isa) { g_force_isa = isa; }, "tests: 0 = auto, 1 = AVX2, 2 = VNNI 256-bit, 3 = AVX-512");
}
#endif
