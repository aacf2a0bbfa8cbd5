// Attention for decoding, one query at a time over exactly its visible keys: specdec's second
// hand-written kernel (the per-query torch formulation it replaces issued ~20 small ops per
// query group and layer, 7 ms of a 5-token verification step; this is one call per layer).
//
// Batch invariance by construction: each (row, query, head) is computed by one fixed sequence
// of fp32 operations over its own visible slots, in their listed order, whatever the number of
// rows, queries or threads (threads split (row, query, kv-head) items, never a reduction).
// The operations, which the pure-torch reference (specdec/runtime/attention.py) performs in
// the same order, bit for bit (plain C++, -ffp-contract=off: no fused multiply-add):
//   score_j = dot16(q, k_j) * scale       dot16: 16 lane sums a_l += q[16c+l] * k_j[16c+l] over
//                                         c = 0..D/16-1, then the fixed tree (l, l+8), (l, l+4),
//                                         (l, l+2), (0, 1)
//   (softcapped where cap > 0: score_j = softcap(score_j, cap), see softcap below)
//   m = max_j score_j;  p_j = exp16(score_j - m);  sum = p_0 + p_1 + ... (in j order)
//   out[d] = (p_0 v_0[d] + p_1 v_1[d] + ... in j order) / sum
// exp16 is the Cephes expf polynomial with fixed float constants (not libm's exp), so the
// reference can reproduce it with elementwise torch ops.
// Visible slots of query i: the range [lo_i, hi_i) then extra[extra_ptr[i] .. extra_ptr[i+1]).
// The cache holds fp32 or fp16 keys and values (KT): an fp16 one is read as its exact fp32
// values (every half is a float), so the operations above are the same; attend_block stores a
// block's keys and values rounded to the nearest half (ties to even), as torch's .half() does.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "exp16.h"
#include "rope.h"

namespace {

constexpr int kLanes = 16;
bool g_portable = false;  // tests: force the plain C++ loops where AVX-512 is there

inline float tof(float x) { return x; }
inline float tof(c10::Half x) { return static_cast<float>(x); }  // exact

template <typename KT>
inline float dot16(const float* q, const KT* k, int64_t D) {
  float a[kLanes] = {0.0f};
  for (int64_t c = 0; c < D; c += kLanes)
    for (int l = 0; l < kLanes; ++l) a[l] = a[l] + q[c + l] * tof(k[c + l]);
  for (int l = 0; l < 8; ++l) a[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) a[l] = a[l] + a[l + 4];
  for (int l = 0; l < 2; ++l) a[l] = a[l] + a[l + 2];
  return a[0] + a[1];
}


#ifdef __AVX512F__
// 16 keys' or values' elements as fp32 (an fp16 cache's converted exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The same operations, 16 lanes per instruction (identical results: lane-wise, same order).
template <typename KT>
inline float dot16_avx512(const float* q, const KT* k, int64_t D) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += kLanes) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(q + c), load16(k + c)));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// dot16 of q with 16 keys, times sc: the same lane sums, then each key's fixed tree (l, l+8),
// (l, l+4), (l, l+2), (0, 1) done for 16 keys at once by pairing registers — the same
// additions on the same operands as dot16_avx512's horizontal tree, ~4x fewer instructions.
// After the four levels lane 4t + p holds key 4p + t; a permutation puts them in key order.
template <typename KT>
inline void scores16_avx512(const float* q, const KT* kbase, const int64_t* slot, int64_t D, float sc, float* out) {
  __m512 a[kLanes];
  for (int u = 0; u < kLanes; ++u) a[u] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += kLanes) {
    const __m512 qv = _mm512_loadu_ps(q + c);
    for (int u = 0; u < kLanes; ++u) a[u] = _mm512_add_ps(a[u], _mm512_mul_ps(qv, load16(kbase + slot[u] * D + c)));
  }
  __m512 b[8], c4[4], d2[2];
  for (int i = 0; i < 8; ++i)  // (l, l+8): 256-bit halves of keys 2i | 2i+1
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // (l, l+4): 128-bit lane t = key 4i + t
    c4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // (l, l+2): lane t = [key 8i + t (2 values), key 8i + 4 + t (2 values)]
    d2[i] = _mm512_add_ps(_mm512_shuffle_ps(c4[2 * i], c4[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(c4[2 * i], c4[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d2[0], d2[1], _MM_SHUFFLE(2, 0, 2, 0)),  // (0, 1)
                                 _mm512_shuffle_ps(d2[0], d2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);  // key u <- lane 4(u%4) + u/4
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(order, e), _mm512_set1_ps(sc)));
}

// max over s[0..n) with std::max's semantics lane by lane: max_ps(x, m) is (x > m) ? x : m, so a
// NaN score is skipped and a NaN s[0] stays, as in the sequential loop; without NaNs the maximum
// is one value whatever the order (only a +0 against a -0 could differ, and s - m is then the same).
inline float max_avx512(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(s[0]);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) m = _mm512_max_ps(_mm512_loadu_ps(s + j), m);
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, tail, _mm512_maskz_loadu_ps(tail, s + j), m);
  }
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, m);
  float out = lanes[0];
  for (int l = 1; l < kLanes; ++l) out = std::max(out, lanes[l]);
  return out;
}

inline __m512 exp16_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(0x1.715476p+0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0x1.63p-1f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-0x1.bd0106p-13f)));
  __m512 p = _mm512_set1_ps(0x1.a0d2cep-13f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0x1.6e879cp-10f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0x1.111210p-7f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0x1.555382p-5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0x1.555554p-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0x1.0p-1f));
  __m512 y = _mm512_mul_ps(p, _mm512_mul_ps(r, r));
  y = _mm512_add_ps(y, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}
#endif

#ifdef __AVX512F__
// acc[r][d] = sum over j in order of p[r][j] * v_j[d] (the plain loop's operations, per element),
// 16 outputs at a time with the REP heads' accumulators in registers: each value row is loaded
// once per 16 lanes for all heads. pt is p transposed, [n][REP]: key j's REP weights side by side,
// read from one moving pointer (p's REP row pointers spilled to vector registers, measured: the
// loop's address arithmetic took more time than its multiplies).
// Two 16-lane chunks of D per pass (D is a multiple of 32 here, else one): half the passes over
// the value rows, each reading 128 contiguous bytes of a row.
template <int REP, int CB, typename KT>
void pv_pass(const float* pt, const KT* vbase, const int64_t* slot, int64_t n, int64_t D, int64_t c, float* acc) {
  __m512 a[CB][REP];
  for (int b = 0; b < CB; ++b)
    for (int r = 0; r < REP; ++r) a[b][r] = _mm512_setzero_ps();
  const float* pj = pt;
  for (int64_t j = 0; j < n; ++j, pj += REP) {
    const KT* row = vbase + slot[j] * D + c;
    for (int b = 0; b < CB; ++b) {
      const __m512 v = load16(row + b * kLanes);
      for (int r = 0; r < REP; ++r) a[b][r] = _mm512_add_ps(a[b][r], _mm512_mul_ps(_mm512_set1_ps(pj[r]), v));
    }
  }
  for (int b = 0; b < CB; ++b)
    for (int r = 0; r < REP; ++r) _mm512_storeu_ps(acc + r * D + c + b * kLanes, a[b][r]);
}

template <int REP, typename KT>
void pv_rep(const float* pt, const KT* vbase, const int64_t* slot, int64_t n, int64_t D, float* acc) {
  if (D % (2 * kLanes) == 0)
    for (int64_t c = 0; c < D; c += 2 * kLanes) pv_pass<REP, 2, KT>(pt, vbase, slot, n, D, c, acc);
  else
    for (int64_t c = 0; c < D; c += kLanes) pv_pass<REP, 1, KT>(pt, vbase, slot, n, D, c, acc);
}

template <typename KT>
void pv_avx512(int64_t rep, const float* p, const KT* vbase, const int64_t* slot, int64_t n, int64_t D, float* acc) {
  switch (rep) {
    case 1: return pv_rep<1, KT>(p, vbase, slot, n, D, acc);
    case 2: return pv_rep<2, KT>(p, vbase, slot, n, D, acc);
    case 3: return pv_rep<3, KT>(p, vbase, slot, n, D, acc);
    case 4: return pv_rep<4, KT>(p, vbase, slot, n, D, acc);
    case 5: return pv_rep<5, KT>(p, vbase, slot, n, D, acc);
    case 6: return pv_rep<6, KT>(p, vbase, slot, n, D, acc);
    case 7: return pv_rep<7, KT>(p, vbase, slot, n, D, acc);
    default: return pv_rep<8, KT>(p, vbase, slot, n, D, acc);
  }
}
#endif

// Software prefetch of the key and value rows of keys [j, j + count) (clamped to n): the cache of
// a layer is cold at every step (the step's weight stream evicts it), and the kernel reads 16
// key rows side by side, a pattern the hardware prefetchers follow poorly (measured: one query
// over 305 keys took 35 us per item cold, 10 us hot; 16 keys ahead saved 11-12% of the
// attention of 1- and 5-query blocks over 28 cold layers, none at 9). Keys go to L1, values to L2 (read after
// all the scores). Loads only: the arithmetic, hence the result, is unchanged.
template <typename KT>
inline void prefetch_rows(const KT* kbase, const KT* vbase, const int64_t* slot, int64_t j, int64_t count,
                          int64_t n, int64_t D) {
  const int64_t end = std::min(n, j + count);
  for (; j < end; ++j) {
    const char* kp = reinterpret_cast<const char*>(kbase + slot[j] * D);
    const char* vp = reinterpret_cast<const char*>(vbase + slot[j] * D);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KT)); b += 64) {
      _mm_prefetch(kp + b, _MM_HINT_T0);
      _mm_prefetch(vp + b, _MM_HINT_T1);
    }
  }
}

int64_t g_prefetch_keys = 16;

// cap * tanh(x / cap), with tanh(t) = sign(t) (1 - e) / (1 + e), e = exp16(-2|t|): fixed float
// operations the torch reference (specdec.runtime.attention.softcap) repeats bit for bit.
inline float softcap(float x, float cap) {
  const float t = x / cap;
  const float e = exp16(-2.0f * std::fabs(t));
  const float r = (1.0f - e) / (1.0f + e);
  return (t < 0.0f ? -r : r) * cap;
}  // keys ahead of the block being scored; 0: no software prefetch (measurements)

// One (row, query, kv head) item: the `rep` query heads sharing the kv head.
// scores: [rep, n] scratch. q: the first query head's vector; consecutive heads are D apart.
template <typename KT>
void attend_item(const float* q, const KT* kbase, const KT* vbase, float* o, int64_t rep, int64_t D,
                 int64_t n, const int64_t* slot, float sc, float cap, std::vector<float>& scores,
                 std::vector<float>& acc, std::vector<float>& weights, bool wide) {
  scores.resize(rep * n);
  acc.assign(rep * D, 0.0f);
  int64_t j0 = 0;
  prefetch_rows(kbase, vbase, slot, 0, g_prefetch_keys, n, D);
#ifdef __AVX512F__
  if (wide)
    for (; j0 + kLanes <= n; j0 += kLanes) {  // 16 keys at a time, the 16 trees side by side
      if (g_prefetch_keys) prefetch_rows(kbase, vbase, slot, j0 + g_prefetch_keys, kLanes, n, D);
      for (int64_t r = 0; r < rep; ++r) scores16_avx512(q + r * D, kbase, slot + j0, D, sc, scores.data() + r * n + j0);
    }
#endif
  for (int64_t j = j0; j < n; ++j) {  // each key row is read once for the `rep` heads sharing it
    const KT* kp = kbase + slot[j] * D;
    for (int64_t r = 0; r < rep; ++r) {
#ifdef __AVX512F__
      const float dot = wide ? dot16_avx512(q + r * D, kp, D) : dot16(q + r * D, kp, D);
#else
      const float dot = dot16(q + r * D, kp, D);
#endif
      scores[r * n + j] = dot * sc;
    }
  }
  if (cap > 0.0f)  // attention-logit softcapping (Gemma 2): cap * tanh(score / cap)
    for (int64_t j = 0; j < rep * n; ++j) scores[j] = softcap(scores[j], cap);
  std::vector<float> sum(rep, 0.0f);
  for (int64_t r = 0; r < rep; ++r) {
    float* s = scores.data() + r * n;
    int64_t j = 0;
#ifdef __AVX512F__
    if (wide) {
      const float m = max_avx512(s, n);
      const __m512 mv = _mm512_set1_ps(m);
      for (; j + kLanes <= n; j += kLanes) _mm512_storeu_ps(s + j, exp16_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
      if (j < n) {  // the tail in one masked pass: the same lane-wise operations
        const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(s + j, tail, exp16_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv)));
      }
      continue;
    }
#endif
    float m = s[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    for (; j < n; ++j) s[j] = exp16(s[j] - m);
  }
  const bool transposed = wide && rep <= 8;
  if (transposed) weights.resize(n * rep);
  for (int64_t j = 0; j < n; ++j)  // in j order per head; the heads are independent chains
    for (int64_t r = 0; r < rep; ++r) {
      sum[r] = sum[r] + scores[r * n + j];
      if (transposed) weights[j * rep + r] = scores[r * n + j];
    }
#ifdef __AVX512F__
  if (transposed) {
    pv_avx512(rep, weights.data(), vbase, slot, n, D, acc.data());
  } else
#endif
  {
    for (int64_t j = 0; j < n; ++j) {
      const KT* vp = vbase + slot[j] * D;
      for (int64_t r = 0; r < rep; ++r) {
        const float p = scores[r * n + j];
        float* a = acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] = a[d] + p * tof(vp[d]);
      }
    }
  }
  for (int64_t r = 0; r < rep; ++r)
    for (int64_t d = 0; d < D; ++d) o[r * D + d] = acc[r * D + d] / sum[r];
}

template <typename KT>
void attend_items(const float* Q, const KT* K, const KT* V, float* O, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                  int64_t D, int64_t qb, int64_t qt, int64_t kb, int64_t kh, int64_t vb, int64_t vh, const int64_t* LO,
                  const int64_t* HI, const int64_t* EP, const int64_t* EX, float sc, float cap) {
  const int64_t rep = Hq / Hkv;
  const bool wide = !g_portable;
  at::parallel_for(0, B * T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, weights;
    std::vector<int64_t> slots;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (T * Hkv), h = (item / T) % Hkv, t = item % T, i = b * T + t;  // a kv head's queries in turn: its keys stay in cache
      slots.clear();  // the range, then the extra slots
      for (int64_t j = LO[i]; j < HI[i]; ++j) slots.push_back(j);
      for (int64_t e = EP[i]; e < EP[i + 1]; ++e) slots.push_back(EX[e]);
      attend_item<KT>(Q + b * qb + t * qt + h * rep * D, K + b * kb + h * kh, V + b * vb + h * vh, O + (i * Hq + h * rep) * D,
                      rep, D, static_cast<int64_t>(slots.size()), slots.data(), sc, cap, scores, acc, weights, wide);
    }
  });
}

// One head's D values into the cache: as they are, or rounded to the nearest half (ties to even).
inline void store_head(float* dst, const float* src, int64_t D) { std::memcpy(dst, src, D * sizeof(float)); }
inline void store_head(c10::Half* dst, const float* src, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = c10::Half(src[d]);
}

// attend_block's first half: the block's queries rotated into Q [B, T, hq, D], its keys rotated
// and its values stored at their slots of K, V (a cache layer of KT).
template <typename KT>
void store_block(const torch::Tensor& qkv, const float* C, const float* SN, float* Q, KT* K, KT* V, const int64_t* SL,
                 int64_t hq, int64_t Hkv, int64_t D, int64_t kb, int64_t kh, int64_t vb, int64_t vh) {
  const int64_t B = qkv.size(0), T = qkv.size(1), sb = qkv.stride(0), st = qkv.stride(1);
  const float* X = qkv.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / qkv.size(2));  // few rows: no thread wake-up
  at::parallel_for(0, B * T, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(D);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T;
      const float* xr = X + b * sb + (bt % T) * st;
      const float* c = C + bt * D;
      const float* s = SN + bt * D;
      for (int64_t h = 0; h < hq; ++h) rope_head(xr + h * D, c, s, Q + (bt * hq + h) * D, D);
      for (int64_t h = 0; h < Hkv; ++h) {
        rope_head(xr + (hq + h) * D, c, s, rotated.data(), D);
        store_head(K + b * kb + h * kh + SL[bt] * D, rotated.data(), D);
        store_head(V + b * vb + h * vh + SL[bt] * D, xr + (hq + Hkv + h) * D, D);
      }
    }
  });
}

}  // namespace

// q [B, T, Hq, D] fp32 contiguous in (Hq, D); k, v [B, Hkv, S, D] fp32 or fp16 (both the same),
// contiguous in (S, D); lo, hi [B*T] int64; extra_ptr [B*T+1] int64; extra [nnz] int64; cap > 0:
// softcapped scores. Returns [B, T, Hq, D] fp32.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lo, torch::Tensor hi,
                     torch::Tensor extra_ptr, torch::Tensor extra, double scale, double cap = 0.0) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat && q.stride(3) == 1 && q.stride(2) == q.size(3),
              "q must be [B, T, Hq, D] fp32, contiguous in (Hq, D)");
  const bool half = k.scalar_type() == torch::kHalf;
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && (half || k.scalar_type() == torch::kFloat) && v.scalar_type() == k.scalar_type(),
              "k, v must be [B, Hkv, S, D], both fp32 or both fp16");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(D % kLanes == 0, "head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(k.size(0) == B && v.sizes() == k.sizes() && k.size(3) == D && Hq % Hkv == 0, "q, k, v shapes disagree");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D, "k, v must be contiguous in (S, D)");
  TORCH_CHECK(lo.numel() == B * T && hi.numel() == B * T && extra_ptr.numel() == B * T + 1, "visibility shapes disagree");
  for (const auto& t : {lo, hi, extra_ptr, extra})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous(), "visibility tensors must be contiguous int64");
  auto out = torch::empty({B, T, Hq, D}, q.options());
  const int64_t* LO = lo.data_ptr<int64_t>();
  const int64_t* HI = hi.data_ptr<int64_t>();
  const int64_t* EP = extra_ptr.data_ptr<int64_t>();
  const int64_t* EX = extra.numel() ? extra.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < B * T; ++i) {
    TORCH_CHECK(0 <= LO[i] && LO[i] <= HI[i] && HI[i] <= S && EP[i] <= EP[i + 1], "bad visible range for query ", i);
    for (int64_t e = EP[i]; e < EP[i + 1]; ++e) TORCH_CHECK(0 <= EX[e] && EX[e] < S, "bad visible slot ", EX[e]);
    TORCH_CHECK(HI[i] - LO[i] + EP[i + 1] - EP[i] > 0, "query ", i, " sees no key");
  }
  const float sc = static_cast<float>(scale), cp = static_cast<float>(cap);
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  if (half)
    attend_items<c10::Half>(Q, k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>(), O, B, T, Hq, Hkv, D, q.stride(0), q.stride(1),
                            k.stride(0), k.stride(1), v.stride(0), v.stride(1), LO, HI, EP, EX, sc, cp);
  else
    attend_items<float>(Q, k.data_ptr<float>(), v.data_ptr<float>(), O, B, T, Hq, Hkv, D, q.stride(0), q.stride(1),
                        k.stride(0), k.stride(1), v.stride(0), v.stride(1), LO, HI, EP, EX, sc, cp);
  return out;
}

// A llama block's attention sublayer in one call (the Python it replaces — rope, the split of
// q/k/v, two cache copies, views — cost ~35 us per layer): rotate the block's queries and keys
// (rope.h, the elementwise kernel's rope), store its keys and values at `slots` in this layer
// of the cache, then `attend`. The same float operations as those steps: the same bits.
// qkv [B, T, (Hq + 2 Hkv) D] fp32, unit inner stride; cos, sin [B, T, D] contiguous (signed
// sin); k, v [B, Hkv, S, D] fp32 or fp16 (a layer of the cache, contiguous in (S, D)), written in place;
// slots [B, T] int64, distinct within a row. Returns [B, T, Hq * D].
torch::Tensor attend_block(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                           torch::Tensor slots, torch::Tensor lo, torch::Tensor hi, torch::Tensor extra_ptr,
                           torch::Tensor extra, double scale, int64_t hq) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == torch::kFloat && qkv.stride(2) == 1,
              "qkv must be [B, T, W] fp32 with unit inner stride");
  const bool half = k.scalar_type() == torch::kHalf;
  TORCH_CHECK(k.dim() == 4 && (half || k.scalar_type() == torch::kFloat) && v.scalar_type() == k.scalar_type() &&
              v.sizes() == k.sizes(), "k, v must be [B, Hkv, S, D], both fp32 or both fp16");
  const int64_t B = qkv.size(0), T = qkv.size(1), Hkv = k.size(1), S = k.size(2), D = k.size(3);
  TORCH_CHECK(k.size(0) == B && hq > 0 && qkv.size(2) == (hq + 2 * Hkv) * D, "qkv must be [B, T, (hq + 2 Hkv) * D]");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D, "k, v must be contiguous in (S, D)");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat &&
              sin.scalar_type() == torch::kFloat && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "cos and sin must be contiguous fp32 [B, T, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == B * T, "slots must be [B, T] int64");
  const int64_t* SL = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(0 <= SL[i] && SL[i] < S, "slot ", SL[i], " is outside the cache's ", S);
  auto q = torch::empty({B, T, hq, D}, qkv.options());
  const float* C = cos.data_ptr<float>();
  const float* SN = sin.data_ptr<float>();
  float* Q = q.data_ptr<float>();
  if (half)
    store_block<c10::Half>(qkv, C, SN, Q, k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>(), SL, hq, Hkv, D, k.stride(0),
                           k.stride(1), v.stride(0), v.stride(1));
  else
    store_block<float>(qkv, C, SN, Q, k.data_ptr<float>(), v.data_ptr<float>(), SL, hq, Hkv, D, k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1));
  return attend(q, k, v, lo, hi, extra_ptr, extra, scale).view({B, T, hq * D});
}

#ifndef SPECDEC_STACK  // kernels/stack.cpp includes this file and defines its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "per-query attention over listed visible slots (batch invariant)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lo"), py::arg("hi"), py::arg("extra_ptr"), py::arg("extra"),
        py::arg("scale"), py::arg("cap") = 0.0);
  m.def("attend_block", &attend_block, "rope, cache write and attention of a block in one call (batch invariant)");
  m.def("force_portable", [](bool on) { g_portable = on; }, "tests: plain C++ loops instead of AVX-512");
  m.def("set_prefetch_keys", [](int64_t keys) { g_prefetch_keys = keys; }, "measurements: keys prefetched ahead (0: none)");
}
#endif
