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

  static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
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
}
