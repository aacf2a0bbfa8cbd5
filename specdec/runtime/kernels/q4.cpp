// 4-bit weights x int8 activations, batch invariant: specdec's one hand-written kernel.
//
// Weights: groups of 32 inputs, w = scale * q - min with q in 0..15 (4 bits), scale and min in
// fp16, laid out per block of 8 output channels so one block's data is contiguous:
//   qweight [N/8, G, 128] uint8  (the 4-bit codes of 8 outputs x 32 inputs; see group_dot)
//   scales  [N/8, G, 8]     fp16 (stored as int16 bits)
//   mins    [N/8, G, 8]     fp16
// Activations: each row, each group of 32 inputs quantized on its own:
//   d = max|x| / 127, xq = round-half-even(x * (d > 0 ? 1/d : 0)) in -127..127, isum = sum(xq).
// Output element (m, n), groups accumulated in order g = 0..G-1 in fp32:
//   acc += d[m,g] * (scale[n,g] * float(idot) - min[n,g] * float(isum[m,g])),
//   idot = sum_j q[n,g,j] * xq[m,g,j]  (exact in int32).
// Every output element is that one fixed sequence of operations, whatever the number of rows M
// or threads (threads split the output channels, never K): results are bit-identical alone, in
// a block or in a batch, and equal to the pure-torch reference in specdec/runtime/q4.py.
// Compiled with -ffp-contract=off so no multiply-add is fused differently from the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 8;
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

// The block loop, compiled twice from q4_blocks.h: with AVX2 only, and with AVX-512 VNNI's
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

// Two blocks (16 outputs) per 512-bit register where AVX-512 is there: the same per-lane
// operations as q4_blocks.h (so the same results), half the instructions per output.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
static void q4_pairs_avx512(int64_t pair_begin, int64_t pair_end, int64_t M, int64_t G, int64_t N,
                            const uint8_t* W, const uint16_t* S, const uint16_t* Mn, const int8_t* XQ,
                            const float* D, const float* IS, const float* B, float* Y) {
  constexpr int64_t kMaxRows = 16;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int64_t K = G * kGroup;
  for (int64_t pr = pair_begin; pr < pair_end; ++pr) {
    const int64_t nb0 = 2 * pr, nb1 = 2 * pr + 1;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      __m512 acc[kMaxRows];
      for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t s0 = (nb0 * G + g) * kBlock, s1 = (nb1 * G + g) * kBlock;
        const __m256i* r0 = reinterpret_cast<const __m256i*>(W + s0 * 16);
        const __m256i* r1 = reinterpret_cast<const __m256i*>(W + s1 * 16);
        __m512i wv[8];
        for (int r = 0; r < 4; ++r) {
          const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(r0 + r)),
                                               _mm256_loadu_si256(r1 + r), 1);
          wv[2 * r] = _mm512_and_si512(v, mask);
          wv[2 * r + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
        const __m256i sh = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(S + s0))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(S + s1)), 1);
        const __m256i mh = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(Mn + s0))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(Mn + s1)), 1);
        const __m512 sc = _mm512_cvtph_ps(sh), mn = _mm512_cvtph_ps(mh);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t m = m0 + i;
          const int32_t* x4 = reinterpret_cast<const int32_t*>(XQ + m * K + g * kGroup);
          __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(x4[0]));
          __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(x4[4]));
          __m512i i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[2], _mm512_set1_epi32(x4[1]));
          __m512i i3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[3], _mm512_set1_epi32(x4[5]));
          i0 = _mm512_dpbusd_epi32(i0, wv[4], _mm512_set1_epi32(x4[2]));
          i1 = _mm512_dpbusd_epi32(i1, wv[5], _mm512_set1_epi32(x4[6]));
          i2 = _mm512_dpbusd_epi32(i2, wv[6], _mm512_set1_epi32(x4[3]));
          i3 = _mm512_dpbusd_epi32(i3, wv[7], _mm512_set1_epi32(x4[7]));
          const __m512i idot = _mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(i2, i3));
          const __m512 t = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(idot));
          const __m512 u = _mm512_mul_ps(mn, _mm512_set1_ps(IS[m * G + g]));
          acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(D[m * G + g]), _mm512_sub_ps(t, u)));
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        __m512 out = acc[i];
        if (B) out = _mm512_add_ps(out, _mm512_loadu_ps(B + nb0 * kBlock));
        _mm256_storeu_ps(Y + (m0 + i) * N + nb0 * kBlock, _mm512_castps512_ps256(out));
        _mm256_storeu_ps(Y + (m0 + i) * N + nb1 * kBlock, _mm512_extractf32x8_ps(out, 1));
      }
    }
  }
}
#pragma GCC pop_options

}  // namespace

// x [M, K] fp32 -> y [M, N] fp32. N = 8 * blocks. bias may be empty.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor mins, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [M, K] contiguous fp32");
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(2) == kBlock * 16, "qweight must be [N/8, G, 128]");
  const int64_t M = x.size(0), K = x.size(1), NB = qweight.size(0), G = qweight.size(1), N = NB * kBlock;
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous() && qweight.is_contiguous(), "weights must be contiguous");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto d = torch::empty({M, G}, x.options());
  auto isum = torch::empty({M, G}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), d.data_ptr<float>(), isum.data_ptr<float>());

  const uint8_t* W = qweight.data_ptr<uint8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  const uint16_t* Mn = reinterpret_cast<const uint16_t*>(mins.data_ptr<int16_t>());
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
  const bool vnni = isa >= 2, avx512 = isa == 3;
  if (avx512) {  // pairs of blocks in 512-bit registers; an odd last block in 256-bit ones
    at::parallel_for(0, NB / 2, 1, [&](int64_t begin, int64_t end) {
      q4_pairs_avx512(begin, end, M, G, N, W, S, Mn, XQ, D, IS, B, Y);
    });
    if (NB % 2) q4_blocks_vnni(NB - 1, NB, M, G, N, W, S, Mn, XQ, D, IS, B, Y);
    return y;
  }
  at::parallel_for(0, NB, 1, [&](int64_t nb_begin, int64_t nb_end) {
    if (vnni)
      q4_blocks_vnni(nb_begin, nb_end, M, G, N, W, S, Mn, XQ, D, IS, B, Y);
    else
      q4_blocks_avx2(nb_begin, nb_end, M, G, N, W, S, Mn, XQ, D, IS, B, Y);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "4-bit weight x per-group int8 activation linear (batch invariant)");
  m.def("uses_vnni", []() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"); });
  m.def("force_isa", [](int isa) { g_force_isa = isa; }, "tests: 0 = auto, 1 = AVX2, 2 = VNNI 256-bit, 3 = AVX-512");
}
