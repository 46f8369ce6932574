// A block's small steps besides its weight products, one op each where eager torch takes several: the norm, a
// decode step's attention from its q/k/v product (`attend_one`: per-head norms, RoPE, the cache write, the
// one-query attention), RoPE with the cache write for prompts, the mixture's grouping of token copies by expert, the
// experts' SwiGLU, the weighted sum back per token and the expert-load count. Each op replaces a chain of 5-15 torch
// ops whose dispatch and temporaries cost more than their arithmetic at decode sizes (8-15 us a chain on a 2-core
// AMD EPYC Zen 4, against 1-3 us here).
//
// Bits: every op but the norm rounds where the torch chain it replaces rounds (the products and sums of bf16
// values are made in fp32 and rounded to the activations' dtype after each torch op; -ffp-contract=off keeps the
// compiler from fusing a multiply and an add), so they give that chain's bits. The norm sums its squares in its own
// order (16 lanes, then the lanes in order), fixed per row whatever the batch; torch's mean sums in another.

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "block_glue.h"
#include "int8_rows.h"  // MOE_MATVEC_AVX2

#ifdef MOE_MATVEC_AVX2
#include <sleef.h>
#endif

namespace {

constexpr int LANES = 16;

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  float lanes[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lanes[l] += v * v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    lanes[l] += v * v;
  }
  float total = 0.f;
  for (int l = 0; l < LANES; ++l) total += lanes[l];
  return total;
}

}  // namespace

// RMSNorm of each row in fp32: y = x / sqrt(mean(x^2) + eps); the weight applied after the cast back to x's dtype
// (Llama, Mixtral), or before it in fp32 (gpt-oss: `weight_in_fp32`).
at::Tensor moe_cpu::rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps, bool weight_in_fp32) {
  TORCH_CHECK(x_in.size(-1) == w_in.numel(), "rms_norm: the weight has ", w_in.numel(), " values for rows of ",
              x_in.size(-1));
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(w_in.scalar_type() == x.scalar_type(), "rms_norm: the weight's dtype is not the rows'");
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float eps_f = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * D;
        const float scale = 1.f / std::sqrt(sum_of_squares(row, D) / static_cast<float>(D) + eps_f);
        for (int64_t i = 0; i < D; ++i) {
          const float y = static_cast<float>(row[i]) * scale;
          op[r * D + i] = weight_in_fp32 ? scalar_t(static_cast<float>(wp[i]) * y)
                                         : scalar_t(static_cast<float>(wp[i]) * static_cast<float>(scalar_t(y)));
        }
      }
    });
  });
  return out;
}

namespace {

// x [.., Dh] turned by RoPE as torch computes x * cos + cat(-x2, x1) * sin: each product rounded, then the sum.
template <typename T>
void turn(const T* x, const T* cos, const T* sin, T* out, int64_t Dh) {
  const int64_t half = Dh / 2;
  for (int64_t i = 0; i < Dh; ++i) {
    const float other = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const T a = T(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const T b = T(other * static_cast<float>(sin[i]));
    out[i] = T(static_cast<float>(a) + static_cast<float>(b));
  }
}

}  // namespace

// q [B, S, H, Dh], k and v [B, S, G, Dh] (views: the last dim contiguous), cos and sin [B or 1, 1, S, Dh]: writes
// the turned k and v into the caches [B, G, L, Dh] at slots start..start+S and returns the turned q [B, H, S, Dh].
at::Tensor moe_cpu::rotary_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache,
                                      at::Tensor v_cache, int64_t start) {
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), Dh = q.size(3), G = k.size(2), L = k_cache.size(2);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "rotary_into_cache: rows not contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && start >= 0 && start + S <= L,
              "rotary_into_cache: slots ", start, "..", start + S, " of a contiguous cache of ", L);
  const auto t = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == t && v.scalar_type() == t && k_cache.scalar_type() == t &&
                  v_cache.scalar_type() == t && cos_in.scalar_type() == t && sin_in.scalar_type() == t,
              "rotary_into_cache: q, k, v, the caches and the tables in one dtype");
  const at::Tensor cos = cos_in.expand({B, 1, S, Dh}), sin = sin_in.expand({B, 1, S, Dh});
  TORCH_CHECK(cos.stride(3) == 1 && sin.stride(3) == 1, "rotary_into_cache: tables not contiguous");
  at::Tensor out = at::empty({B, H, S, Dh}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_into_cache", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    scalar_t *op = out.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B * S, 16, [&](int64_t begin, int64_t end) {
      for (int64_t bs = begin; bs < end; ++bs) {
        const int64_t b = bs / S, s = bs % S;
        const scalar_t* c = cp + b * cos.stride(0) + s * cos.stride(2);
        const scalar_t* n = sp + b * sin.stride(0) + s * sin.stride(2);
        for (int64_t h = 0; h < H; ++h) {
          turn(qp + b * q.stride(0) + s * q.stride(1) + h * q.stride(2), c, n, op + ((b * H + h) * S + s) * Dh, Dh);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t slot = ((b * G + g) * L + start + s) * Dh;
          turn(kp + b * k.stride(0) + s * k.stride(1) + g * k.stride(2), c, n, kc + slot, Dh);
          std::memcpy(vc + slot, vp + b * v.stride(0) + s * v.stride(1) + g * v.stride(2), Dh * sizeof(scalar_t));
        }
      }
    });
  });
  return out;
}

namespace moe_cpu {

// A decode step's attention from its fused q/k/v product qkv [B, 1, (H + 2G) Dh]: q and k normalised per head where
// the family does (`q_norm`, `k_norm`), turned by RoPE, k and v written into the caches at `start`, one query per
// sequence against slots 0..start (`mask`: [B or 1, 1, 1, start + 1]); [B, 1, H Dh]. The ops the modular path
// calls one by one, in one call: the same bits.
at::Tensor attend_one(const at::Tensor& qkv, int64_t H, int64_t G, const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                      const std::optional<at::Tensor>& mask) {
  const int64_t B = qkv.size(0), Dh = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && qkv.size(2) == (H + 2 * G) * Dh,
              "attend_one: qkv [B, 1, (H + 2G) Dh], got ", qkv.sizes());
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "attend_one: both norms or neither");
  const at::Tensor heads = qkv.view({B, 1, H + 2 * G, Dh});
  at::Tensor q = heads.narrow(2, 0, H), k = heads.narrow(2, H, G);
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps, false);
    k = rms_norm(k, *k_norm, eps, false);
  }
  const at::Tensor turned =
      moe_cpu::rotary_into_cache(q, k, heads.narrow(2, H + G, G), cos, sin, k_cache, v_cache, start);
  const at::Tensor out = moe_cpu::decode_attention(turned, k_cache.narrow(2, 0, start + 1),
                                                   v_cache.narrow(2, 0, start + 1), mask);
  return out.view({B, 1, H * Dh});  // [B, H, 1, Dh] holds each sequence's heads in a row
}

// The T*K copies of a step's tokens grouped by expert, as a stable sort of their ids does (copies of one expert in
// token order): (rows [N, D], copies per expert [E], each row's token [N], each row's router weight [N]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_by_expert(const at::Tensor& x_in,
                                                                            const at::Tensor& weights_in,
                                                                            const at::Tensor& ids_in,
                                                                            int64_t n_experts) {
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && weights_in.scalar_type() == at::kFloat && ids_in.dim() == 2 &&
                  x_in.dim() == 2,
              "group_by_expert: x [T, D], ids [T, K] long, weights fp32");
  const at::Tensor x = x_in.contiguous(), ids = ids_in.contiguous(), weights = weights_in.contiguous();
  const int64_t T = ids.size(0), K = ids.size(1), N = T * K, D = x.size(1);
  TORCH_CHECK(x.size(0) == T && weights.numel() == N, "group_by_expert: ", T, " tokens, ", x.size(0), " rows");
  at::Tensor counts = at::zeros({n_experts}, ids.options());
  at::Tensor token = at::empty({N}, ids.options()), weight = at::empty({N}, weights.options());
  at::Tensor rows = at::empty({N, D}, x.options());
  const int64_t* idp = ids.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(idp[n] >= 0 && idp[n] < n_experts, "group_by_expert: expert id ", idp[n], " of ", n_experts);
    ++cp[idp[n]];
  }
  std::vector<int64_t> next(n_experts, 0);
  for (int64_t e = 1; e < n_experts; ++e) next[e] = next[e - 1] + cp[e - 1];
  const float* wp = weights.data_ptr<float>();
  int64_t* tp = token.data_ptr<int64_t>();
  float* gp = weight.data_ptr<float>();
  const size_t row_bytes = D * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* rp = static_cast<char*>(rows.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t at = next[idp[n]]++;
    tp[at] = n / K;
    gp[at] = wp[n];
    std::memcpy(rp + at * row_bytes, xp + (n / K) * row_bytes, row_bytes);
  }
  return {rows, counts, token, weight};
}

// out[token[n]] += round(y[n] * weight[n]) for n in order, summed in fp32 and rounded once to y's dtype: what
// `(y * w[:, None]).to(y.dtype)` and torch's CPU index_add_ (which sums reduced precision in fp32) compute.
at::Tensor combine(const at::Tensor& y_in, const at::Tensor& weight_in, const at::Tensor& token_in, int64_t T) {
  const at::Tensor y = y_in.contiguous(), token = token_in.contiguous(), weight = weight_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kFloat && token.scalar_type() == at::kLong, "combine: weight, token dtypes");
  const int64_t N = token.numel(), D = y.size(1);
  TORCH_CHECK(y.size(0) >= N && weight.numel() == N, "combine: ", y.size(0), " rows for ", N, " copies");
  const int64_t* tp = token.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(tp[n] >= 0 && tp[n] < T, "combine: token ", tp[n], " of ", T);
  at::Tensor out = at::empty({T, D}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "combine", [&] {
    const scalar_t* yp = y.data_ptr<scalar_t>();
    const float* wp = weight.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // columns split between threads: each output value still takes its copies in order
    at::parallel_for(0, D, N * D > (1 << 16) ? 64 : D, [&](int64_t begin, int64_t end) {
      std::vector<float> sums(T * (end - begin), 0.f);
      const int64_t width = end - begin;
      for (int64_t n = 0; n < N; ++n) {
        float* s = sums.data() + tp[n] * width;
        const scalar_t* row = yp + n * D + begin;
        for (int64_t d = 0; d < width; ++d) s[d] += static_cast<float>(scalar_t(static_cast<float>(row[d]) * wp[n]));
      }
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < width; ++d) op[t * D + begin + d] = scalar_t(sums[t * width + d]);
      }
    });
  });
  return out;
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float rounded(float v, float) { return v; }
inline float rounded(float v, c10::BFloat16) { return static_cast<float>(c10::BFloat16(v)); }

#ifdef MOE_MATVEC_AVX2
// silu of 8 values in fp32 as torch's vectorized silu takes it: x / (1 + exp(-x)), exp SLEEF's (1 ulp)
inline __m256 silu8(__m256 x) {
  const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

inline __m256 rounded8(__m256 v, float) { return v; }
inline __m256 rounded8(__m256 v, c10::BFloat16) {  // to the nearest bf16, ties to even, as c10::BFloat16(float)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

inline void store_rounded8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store_rounded8(c10::BFloat16* p, __m256 v) {  // v holds bf16 values: their upper halves
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

template <typename T>
void silu_mul_rows(const T* hp, T* op, int64_t N, int64_t F, int64_t vectored) {
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = hp + r * 2 * F, *up = gate + F;
      T* o = op + r * F;
      int64_t i = 0;
#ifdef MOE_MATVEC_AVX2
      for (; i < vectored; i += 8) {
        const __m256 s = rounded8(silu8(moe_cpu::load_floats(gate + i)), T());
        store_rounded8(o + i, rounded8(_mm256_mul_ps(s, moe_cpu::load_floats(up + i)), T()));
      }
#endif
      for (; i < F; ++i) o[i] = T(rounded(silu(static_cast<float>(gate[i])), T()) * static_cast<float>(up[i]));
    }
  });
}

// h [N, 2F] (fp32 or bf16), gate columns first: silu(gate) rounded to h's dtype, times up, rounded
// (`F.silu(gate).mul_(up)`). torch takes the first F - F % `width` values of a row in vectors (exp: SLEEF's), the
// rest one by one (std::exp); so here.
at::Tensor silu_mul(const at::Tensor& h_in, int64_t width) {
  const at::Tensor h = h_in.contiguous();
  const int64_t N = h.size(0), F = h.size(1) / 2;
#ifdef MOE_MATVEC_AVX2
  const int64_t vectored = F - F % std::max<int64_t>(width, 8);  // a multiple of 8
#else
  const int64_t vectored = 0;  // std::exp throughout: bits that differ from torch's (a build the models never run)
#endif
  at::Tensor out = at::empty({N, F}, h.options());
  if (h.scalar_type() == at::kBFloat16) {
    silu_mul_rows(h.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, F, vectored);
  } else {
    TORCH_CHECK(h.scalar_type() == at::kFloat, "silu_mul: fp32 or bf16 rows");
    silu_mul_rows(h.data_ptr<float>(), out.data_ptr<float>(), N, F, vectored);
  }
  return out;
}

// table[row, id] += 1 for each id: the expert-load counter of a step's copies.
void count_ids(at::Tensor table, int64_t row, const at::Tensor& ids_in) {
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == at::kLong && table.dim() == 2, "count_ids: table");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong, "count_ids: ids are long");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t E = table.size(1), N = ids.numel();
  int64_t* tp = table.data_ptr<int64_t>() + row * E;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(ip[n] >= 0 && ip[n] < E, "count_ids: expert id ", ip[n], " of ", E);
    ++tp[ip[n]];
  }
}

}  // namespace moe_cpu

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool weight_in_fp32) -> Tensor");
  m.def("rotary_into_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int start) -> Tensor");
  m.def("group_by_expert(Tensor x, Tensor weights, Tensor ids, int n_experts) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("combine(Tensor y, Tensor weight, Tensor token, int n_tokens) -> Tensor");
  m.def("count_ids(Tensor(a!) table, int row, Tensor ids) -> ()");
  m.def("silu_mul(Tensor h, int width) -> Tensor");
  m.def("attend_one(Tensor qkv, int H, int G, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int start, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) {
  m.impl("rms_norm", moe_cpu::rms_norm);
  m.impl("rotary_into_cache", moe_cpu::rotary_into_cache);
  m.impl("group_by_expert", moe_cpu::group_by_expert);
  m.impl("combine", moe_cpu::combine);
  m.impl("count_ids", moe_cpu::count_ids);
  m.impl("silu_mul", moe_cpu::silu_mul);
  m.impl("attend_one", moe_cpu::attend_one);
}
