// A block's elementwise steps between its linear layers, one call each instead of 3-6 small torch
// ops (each ~3-20 us here, ~10 ms of a 1.5B decoding step in all): RMSNorm, the SiLU gate and
// rotary embedding. Row by row, one fixed sequence of fp32 operations per output (plain C++,
// -ffp-contract=off: no fused multiply-add), so a row's result never depends on the other rows
// of the call; specdec/runtime/elementwise.py performs the same operations in plain torch, and
// the tests check the two bit for bit.
//   rms_norm:  s = sum16(x*x) (16 lane sums over the row in steps of 16, then the fixed tree
//              (l, l+8), (l, l+4), (l, l+2), (0, 1)), r = 1 / sqrt(s * (1/E) + eps) (1/E rounded to fp32 once),
//              y = (x * r) * w
//   silu_mul:  [g | u] -> g * sigma(g) * u with e = exp16(-|g|), sigma = 1/(1+e) for g >= 0,
//              e/(1+e) otherwise (exp16.h: the Cephes polynomial the attention kernel uses too; exp of a
//              non-positive number only), computed as (g * sigma) * u
//   rope:      the first H heads of a [.., W] row (head size D): x * cos + roll(x, D/2) * sin
//              (sin carries the sign of rotate_half, see specdec/runtime/model.py)

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp16.h"
#include "rope.h"

namespace {

constexpr int kLanes = 16;


// Rows of a call run on one thread unless the call is large (prefill): per-call thread wake-ups
// cost more than the work for a few rows.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(width, 1)); }

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.is_contiguous() && w.is_contiguous(),
              "rms_norm: contiguous fp32 x [..., E] and w [E]");
  const int64_t E = x.size(-1), M = E ? x.numel() / E : 0;
  TORCH_CHECK(w.numel() == E && E % kLanes == 0, "rms_norm: w must be [E], E a multiple of 16");
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const float inv_e = 1.0f / static_cast<float>(E), feps = static_cast<float>(eps);
  at::parallel_for(0, M, grain(E), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = X + m * E;
      float a[kLanes] = {0.0f};
      for (int64_t c = 0; c < E; c += kLanes)
        for (int l = 0; l < kLanes; ++l) a[l] = a[l] + xr[c + l] * xr[c + l];
      for (int l = 0; l < 8; ++l) a[l] = a[l] + a[l + 8];
      for (int l = 0; l < 4; ++l) a[l] = a[l] + a[l + 4];
      for (int l = 0; l < 2; ++l) a[l] = a[l] + a[l + 2];
      const float r = 1.0f / std::sqrt((a[0] + a[1]) * inv_e + feps);
      float* yr = Y + m * E;
      for (int64_t e = 0; e < E; ++e) yr[e] = (xr[e] * r) * W[e];
    }
  });
  return y;
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == torch::kFloat && gu.is_contiguous() && gu.size(-1) % 2 == 0,
              "silu_mul: contiguous fp32 [..., 2I] (gate, then up)");
  const int64_t I = gu.size(-1) / 2, M = I ? gu.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  auto y = torch::empty(shape, gu.options());
  const float* G = gu.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = G + m * 2 * I;
      const float* u = g + I;
      float* yr = Y + m * I;
      for (int64_t i = 0; i < I; ++i) {
        const float e = exp16(-std::fabs(g[i]));
        const float sig = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
        yr[i] = (g[i] * sig) * u[i];
      }
    }
  });
  return y;
}

// x [B, T, W] (any row stride, unit inner stride); cos/sin [B, T, D] contiguous; rotates the
// first `heads` heads of size D -> [B, T, heads, D] contiguous.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1, "rope: fp32 x [B, T, W], unit inner stride");
  const int64_t B = x.size(0), T = x.size(1), D = cos.size(-1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "rope: cos and sin must be contiguous [B, T, D]");
  TORCH_CHECK(heads * D <= x.size(2) && D % 2 == 0, "rope: heads * D exceeds the row");
  auto y = torch::empty({B, T, heads, D}, x.options());
  const float* X = x.data_ptr<float>();
  const float* C = cos.data_ptr<float>();
  const float* S = sin.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t sb = x.stride(0), st = x.stride(1);
  at::parallel_for(0, B * T, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const float* xr = X + (bt / T) * sb + (bt % T) * st;
      const float* c = C + bt * D;
      const float* s = S + bt * D;
      float* yr = Y + bt * heads * D;
      for (int64_t h = 0; h < heads; ++h) rope_head(xr + h * D, c, s, yr + h * D, D);
    }
  });
  return y;
}

// Index of the first maximum of each row of x [..., N] (torch.argmax's answer for finite rows):
// a max pass (vectorizes), then the first index holding it. torch's argmax tracks indices in
// one scalar pass, ~270 us per 152k-wide row here (docs/CHANGELOG.md, 'Fewer ops per layer').
torch::Tensor argmax(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
              "argmax: contiguous fp32 [..., N], N > 0");
  const int64_t N = x.size(-1), M = x.numel() / N;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  auto out = torch::empty(shape, x.options().dtype(torch::kLong));
  const float* X = x.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* r = X + m * N;
      float a[kLanes];
      for (int l = 0; l < kLanes; ++l) a[l] = r[0];
      int64_t i = 0;
      for (; i + kLanes <= N; i += kLanes)
        for (int l = 0; l < kLanes; ++l) a[l] = r[i + l] > a[l] ? r[i + l] : a[l];
      float best = a[0];
      for (int l = 1; l < kLanes; ++l) best = a[l] > best ? a[l] : best;
      for (; i < N; ++i) best = r[i] > best ? r[i] : best;
      int64_t c = 0;  // the first block of 16 holding the maximum (the compare vectorizes), then its index
      for (; c + kLanes <= N; c += kLanes) {
        int hit = 0;
        for (int l = 0; l < kLanes; ++l) hit |= r[c + l] == best;
        if (hit) break;
      }
      while (r[c] != best) ++c;
      O[m] = c;
    }
  });
  return out;
}

#ifndef SPECDEC_STACK  // kernels/stack.cpp includes this file and defines its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax", &argmax, "first index of each row's maximum");
  m.def("rms_norm", &rms_norm, "RMSNorm, fixed-order fp32 (batch invariant)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up from [..., 2I]");
  m.def("rope", &rope, "rotary embedding of the first heads of each row");
}
#endif
