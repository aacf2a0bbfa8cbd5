// A llama decoder's layers in one call: the same kernels, in the same order, as a Python loop over
// `Block._forward_fused` (so the same bits), without ~9 Python-level calls per layer. A draft
// model's 1-token step spent ~1.5 ms of ~8 ms in those calls (24 layers x 9 calls, docs/CHANGELOG.md, 'all layers in one call').
//
// Per layer, exactly Block._forward_fused:
//   h = rms_norm(x, norm_in); qkv = q4(h, Wqkv) + b; a = attend_block(qkv, rope, cache layer, visibility)
//   x = x + q4(a, Wo) + b;  h = rms_norm(x, norm_post);  x = x + q4(silu_mul(q4(h, Wgu)), Wdown)
// The kernels are compiled into this module from their own sources (included below, each in its
// own namespace), so every operation is the one the per-layer path calls.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "exp16.h"
#include "rope.h"

#define SPECDEC_STACK 1
namespace sd_q4 {
#include "q4.cpp"
}
namespace sd_attention {
#include "attention.cpp"
}
namespace sd_elementwise {
#include "elementwise.cpp"
}

namespace {

// One layer's tensors, as Block and its Q4Linear layers hold them.
enum Part { kNormIn, kQkv, kQkvBias, kO, kOBias, kNormPost, kGateUp, kDown, kParts };

struct Stack {
  std::vector<std::array<torch::Tensor, kParts>> layers;
  torch::Tensor none = torch::empty({0});
  double eps, scale;
  int64_t heads;

  Stack(std::vector<std::vector<torch::Tensor>> parts, double eps_, double scale_, int64_t heads_)
      : eps(eps_), scale(scale_), heads(heads_) {
    for (auto& p : parts) {
      TORCH_CHECK(p.size() == kParts, "a layer has ", static_cast<int64_t>(kParts), " tensors, got ", p.size());
      std::array<torch::Tensor, kParts> a;
      for (int i = 0; i < kParts; ++i) a[i] = p[i];
      layers.push_back(a);
    }
  }

  // x [B, T, E] fp32; k, v [L, B, Hkv, S, D] (the cache, written in place at `slots`);
  // cos, sin [B, T, 1, D]; slots [B, T]; the global visibility (lo, hi, extra_ptr, extra).
  torch::Tensor forward(torch::Tensor x, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor slots, torch::Tensor lo, torch::Tensor hi, torch::Tensor extra_ptr,
                        torch::Tensor extra) const {
    TORCH_CHECK(k.dim() == 5 && k.size(0) == static_cast<int64_t>(layers.size()) && v.sizes() == k.sizes(),
                "k, v must be [layers, B, Hkv, S, D]");
    x = x.contiguous();
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& L = layers[i];
      auto h = sd_elementwise::rms_norm(x, L[kNormIn], eps);
      auto qkv = sd_q4::q4_linear(h, L[kQkv], L[kQkvBias]);
      auto a = sd_attention::attend_block(qkv, cos, sin, k.select(0, i), v.select(0, i), slots, lo, hi, extra_ptr,
                                          extra, scale, heads);
      x = x + sd_q4::q4_linear(a, L[kO], L[kOBias]);
      h = sd_elementwise::rms_norm(x, L[kNormPost], eps);
      x = x + sd_q4::q4_linear(sd_elementwise::silu_mul(sd_q4::q4_linear(h, L[kGateUp], none)), L[kDown], none);
    }
    return x;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Stack>(m, "Stack")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, double, double, int64_t>(),
           "per layer: norm_in, qkv packed, qkv bias, o packed, o bias, norm_post, gate_up packed, down packed; eps, "
           "attention scale, query heads")
      .def("forward", &Stack::forward, "every layer of a block (see Block._forward_fused), in one call");
  m.def("set_prefetch_keys", [](int64_t keys) { sd_attention::g_prefetch_keys = keys; },
        "measurements: the attention's keys prefetched ahead (0: none)");
}
