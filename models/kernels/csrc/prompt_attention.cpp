// A prompt's causal self-attention in fp32, on CPUs whose build has AVX-512 (models/kernels/csrc/gemm_micro.h:
// MOE_GEMM_AVX512): S queries at positions start .. start + S - 1 against the start + S keys before and at them (no
// padding; `start` > 0: a prompt's later chunk, its earlier keys cached).
//
// out[b, s, h] = sum_j p_j v[b, g, j] over keys j <= start + s, p = softmax(scale * q[b, h, s] . k[b, g, j]),
// g = h / (H / G): what torch's causal SDPA computes (from the first slot; later, with the bottom-right causal mask).
// torch's CPU flash attention calls a BLAS product per block of 64 queries and 64 keys; on an AMD CPU MKL takes its
// generic path for them (the small model's 512-token prompt: 3.2-3.8 ms a block, 70-80 GFLOP/s, a seventh to a
// quarter of the prompt). Here 16 queries are the 16 lanes of a vector: each key's
// score is 64 multiply-adds of a query tile against that key's values broadcast, and each value column's sum the
// same against the probabilities, with an online softmax over chunks of 64 keys (exp is SLEEF's, torch's own).
// Only the keys a tile can see are read. Tiles go to threads in pairs of equal total cost (early and late queries).
// A query's bits depend on its position alone: its lane sums key chunks from key 0, and a chunk wholly in its future
// leaves it as it was (scale 1, nothing added); so a prompt's chunks from `start` give the one call's bits.

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gemm_micro.h"

#ifdef MOE_GEMM_AVX512
#include <sleef.h>
#endif

namespace {

#ifdef MOE_GEMM_AVX512
constexpr int64_t QT = 16;  // queries per tile: one per lane
constexpr int64_t KC = 64;  // keys per chunk: the output is rescaled once per chunk

// A [B, heads, S, D] tensor's elements, the last dimension contiguous.
template <typename T>
struct Heads {
  const T* p;
  int64_t sb, sh, ss;
  explicit Heads(const at::Tensor& t)
      : p(t.data_ptr<T>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)) {}
  const T* row(int64_t b, int64_t h, int64_t s) const { return p + b * sb + h * sh + s * ss; }
};

struct Scratch {
  std::vector<float> qt, o, p;  // the tile's queries [D][16] (scaled), its outputs [D][16], a chunk's scores [KC][16]
};

// p[j][lanes] = qt . key j for n keys (rows of `key`), 8 keys a time: 8 accumulators against one load of qt per
// column.
void scores(const float* qt, const Heads<float>& k, int64_t b, int64_t g, int64_t first, int64_t n, int64_t D, float* p) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* r[8];
    for (int i = 0; i < 8; ++i) r[i] = k.row(b, g, first + j + i);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 q = _mm512_loadu_ps(qt + d * QT);
#define MOE_KEY(i) a##i = _mm512_fmadd_ps(q, _mm512_set1_ps(r[i][d]), a##i);
      MOE_KEY(0) MOE_KEY(1) MOE_KEY(2) MOE_KEY(3) MOE_KEY(4) MOE_KEY(5) MOE_KEY(6) MOE_KEY(7)
#undef MOE_KEY
    }
    const __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(p + (j + i) * QT, acc[i]);
  }
  for (; j < n; ++j) {
    const float* r = k.row(b, g, first + j);
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * QT), _mm512_set1_ps(r[d]), a);
    _mm512_storeu_ps(p + j * QT, a);
  }
}

// o[d][lanes] += sum_j p[j][lanes] * value j's column d, 16 columns a time (D a multiple of 16).
void weighted_values(const float* p, const Heads<float>& v, int64_t b, int64_t g, int64_t first, int64_t n, int64_t D,
                     float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_loadu_ps(o + (d0 + i) * QT);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_loadu_ps(p + j * QT);
      const float* r = v.row(b, g, first + j) + d0;
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(pj, _mm512_set1_ps(r[i]), acc[i]);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(o + (d0 + i) * QT, acc[i]);
  }
}

// Queries r0 .. r0 + 15 (those below S) of head h, at positions start + r0 ..: their outputs into y, [B, S, H, D]
// row-major.
template <typename T>
void tile(const Heads<T>& q, const Heads<float>& k, const Heads<float>& v, int64_t b, int64_t h, int64_t g, int64_t r0,
          int64_t start, int64_t S, int64_t H, int64_t D, float scale, Scratch& s, T* y) {
  const int64_t rows = std::min(QT, S - r0), a0 = start + r0, keys = a0 + rows;  // a0: lane 0's position
  for (int64_t r = 0; r < QT; ++r) {
    const T* src = q.row(b, h, r0 + std::min(r, rows - 1));  // lanes past S repeat the last query, never stored
    for (int64_t d = 0; d < D; ++d) s.qt[d * QT + r] = moe_cpu::widen(src[d]) * scale;
  }
  std::fill(s.o.begin(), s.o.end(), 0.f);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf, total = _mm512_setzero_ps();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t c0 = 0; c0 < keys; c0 += KC) {
    const int64_t n = std::min(KC, keys - c0);
    scores(s.qt.data(), k, b, g, c0, n, D, s.p.data());
    __m512 next = top;
    for (int64_t j = 0; j < n; ++j) {
      __m512 sj = _mm512_loadu_ps(s.p.data() + j * QT);
      if (c0 + j > a0) {  // key c0 + j is in the future of lanes r < c0 + j - a0
        const __mmask16 hidden = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(c0 + j - a0)));
        sj = _mm512_mask_mov_ps(sj, hidden, minus_inf);
        _mm512_storeu_ps(s.p.data() + j * QT, sj);
      }
      next = _mm512_max_ps(next, sj);
    }
    const __m512 shrink = Sleef_expf16_u10(_mm512_sub_ps(top, next));  // 0 on the first chunk
    __m512 added = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(s.p.data() + j * QT), next));
      _mm512_storeu_ps(s.p.data() + j * QT, pj);
      added = _mm512_add_ps(added, pj);
    }
    total = _mm512_add_ps(_mm512_mul_ps(total, shrink), added);
    top = next;
    if (c0 > 0) {
      for (int64_t d = 0; d < D; ++d) {
        _mm512_storeu_ps(&s.o[d * QT], _mm512_mul_ps(_mm512_loadu_ps(&s.o[d * QT]), shrink));
      }
    }
    weighted_values(s.p.data(), v, b, g, c0, n, D, s.o.data());
  }
  alignas(64) float inv[QT];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), total));
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = y + ((b * S + r0 + r) * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.o[d * QT + r] * inv[r]);
  }
}

struct Item {
  int64_t b, h, t;
};

template <typename T>
at::Tensor causal_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), G = k.size(1), T_ = (S + QT - 1) / QT;
  at::Tensor y = at::empty({B, S, H, D}, q.options());
  std::vector<Item> by_cost;  // tiles cost their keys: later tiles more
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) by_cost.push_back({b, h, t});
    }
  }
  std::vector<Item> items;  // cheapest, dearest, next cheapest, next dearest...: any even run costs about the same
  for (int64_t i = 0, j = static_cast<int64_t>(by_cost.size()) - 1; i <= j; ++i, --j) {
    items.push_back(by_cost[i]);
    if (i != j) items.push_back(by_cost[j]);
  }
  // Keys and values in fp32, once per call (a bf16 key is read by every query tile of its heads).
  const at::Tensor kf = k.to(at::kFloat), vf = v.to(at::kFloat);
  const Heads<T> qh(q);
  const Heads<float> kh(kf), vh(vf);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 2, [&](int64_t i0, int64_t i1) {
    Scratch s{std::vector<float>(D * QT), std::vector<float>(D * QT), std::vector<float>(KC * QT)};
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      tile(qh, kh, vh, it.b, it.h, it.h / (H / G), it.t * QT, start, S, H, D, scale, s, yp);
    }
  });
  return y.transpose(1, 2);  // [B, H, S, D], as SDPA returns it; the model's reshape to [B, S, H * D] is free
}
#endif

// q [B, H, S, D], k and v [B, G, start + S, D] (G dividing H; each last dimension contiguous), one dtype, fp32 or
// bf16.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && start >= 0 &&
                  start + q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "prompt_attention: q [B, H, S, D], k and v [B, G, start + S, D], got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes(), ", start ", start);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "prompt_attention: last dims contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prompt_attention: q, k and v all fp32 or all bf16");
#ifdef MOE_GEMM_AVX512
  TORCH_CHECK(q.size(3) % 16 == 0, "prompt_attention: a head dim that is a multiple of 16, got ", q.size(3));
  return q.scalar_type() == at::kFloat ? causal_tiles<float>(q, k, v, start)
                                          : causal_tiles<c10::BFloat16>(q, k, v, start);
#else
  TORCH_CHECK(false, "prompt_attention: built without AVX-512 (models/kernels/native.py: `prompt_attention_runs`)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, int start=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("prompt_attention", prompt_attention); }
