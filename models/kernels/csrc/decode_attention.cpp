// Attention of one new token per sequence (a decode step) over its KV cache, in fp32, on CPU.
//
// out[b, h] = sum_j p_j v[b, g, j] with p = softmax(scale * q[b, h] . k[b, g, j]) over the keys j that mask[b, j]
// allows (every key without a mask), g = h / (H / G). What torch's SDPA computes for one query, without what it
// costs there: per head a matrix product call (an sgemv) for the scores and one for the values, and a fp32 copy
// of a bf16 cache. Keys the mask hides are never read, so a step costs what the filled part of the cache costs,
// not the cache's length. The query heads of a key head share each read of its keys and values. Scores and sums
// are fp32; exp is SLEEF's (torch's own vector exp); a row with no visible key gives NaN, as SDPA does.

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "block_glue.h"
#include "row_dot.h"

#ifdef MOE_MATVEC_AVX2
#include <sleef.h>
#endif

namespace {

void exp_inplace(float* x, int64_t n) {  // x = exp(x)
  int64_t i = 0;
#ifdef MOE_MATVEC_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Scores of the visible keys for query heads h0..h0+R-1 (R <= 2): each key row read once for the R heads, each
// head's sum in `dot_float`'s order (the same bits as one head at a time).
template <typename T, int R>
void scores(const float* q, const T* k, int64_t key_stride, const std::vector<int64_t>& keys, int64_t d, float scale,
            float* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = k + keys[i] * key_stride;
#ifdef MOE_MATVEC_AVX2
    if (d % 32 == 0) {
      __m256 a[R][4];
      for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 32) {
        __m256 kv[4];
        for (int u = 0; u < 4; ++u) kv[u] = moe_cpu::load_floats(row + c + 8 * u);
        for (int r = 0; r < R; ++r) {
          const float* qr = q + r * d + c;
          for (int u = 0; u < 4; ++u) a[r][u] = _mm256_fmadd_ps(kv[u], _mm256_loadu_ps(qr + 8 * u), a[r][u]);
        }
      }
      for (int r = 0; r < R; ++r) {
        p[r * n + i] = scale * moe_cpu::hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]),
                                                           _mm256_add_ps(a[r][2], a[r][3])));
      }
      continue;
    }
#endif
    for (int r = 0; r < R; ++r) p[r * n + i] = scale * moe_cpu::dot_float(row, q + r * d, d);
  }
}

// out[h] = sum_i p[h, i] v[keys[i]] for R <= 4 heads, 16 columns at a time held in registers over all the keys:
// each value row read once for the R heads, each sum in key order from zero, one multiply-add a key (the bits of
// adding each key's weighted row in turn).
template <typename T, int R>
void values(const float* p, int64_t n, const T* v, int64_t key_stride, const std::vector<int64_t>& keys, int64_t d,
            float* out) {
  int64_t c = 0;
#ifdef MOE_MATVEC_AVX2
  for (; c + 16 <= d; c += 16) {
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = v + keys[i] * key_stride + c;
      const __m256 v0 = moe_cpu::load_floats(row), v1 = moe_cpu::load_floats(row + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r * n + i]);
        lo[r] = _mm256_fmadd_ps(pr, v0, lo[r]);
        hi[r] = _mm256_fmadd_ps(pr, v1, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * d + c, lo[r]);
      _mm256_storeu_ps(out + r * d + c + 8, hi[r]);
    }
  }
#endif
  for (int r = 0; r < R; ++r) {  // the columns left (all of them without AVX2), a key at a time
    float* o = out + r * d;
    std::fill(o + c, o + d, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const T* row = v + keys[i] * key_stride;
      for (int64_t j = c; j < d; ++j) o[j] = moe_cpu::madd(p[r * n + i], moe_cpu::widen(row[j]), o[j]);
    }
  }
}

float sum(const float* x, int64_t n) {  // 8 lanes, then the lanes and the tail
  int64_t i = 0;
  float s = 0.f;
#ifdef MOE_MATVEC_AVX2
  __m256 a = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + i));
  s = moe_cpu::hsum(a);
#endif
  for (; i < n; ++i) s += x[i];
  return s;
}

// One key head and its query heads: scores of the visible keys, softmax, the weighted sum of their values. The
// heads go through the keys in pairs and the values in fours, so each key and value row is read once per pair or
// four, and a four's sums stay in registers over all the keys: `small`'s shape (8 heads on 2 key heads of 64, bf16
// cache, 2 threads, AMD EPYC Zen 4) took 70-84 us a call at 2048 keys, 103-111 us one head at a time.
template <typename T>
void attend_group(const float* q, int64_t heads, const T* k, const T* v, int64_t key_stride, const bool* mask,
                  int64_t length, int64_t d, float scale, float* out, std::vector<int64_t>& keys,
                  std::vector<float>& p) {
  keys.resize(length);
  int64_t n = 0;
  for (int64_t j = 0; j < length; ++j) {
    keys[n] = j;
    n += mask == nullptr || mask[j];
  }
  keys.resize(n);
  p.resize(heads * n);
  int64_t h = 0;
  for (; h + 2 <= heads; h += 2) scores<T, 2>(q + h * d, k, key_stride, keys, d, scale, p.data() + h * n, n);
  if (h < heads) scores<T, 1>(q + h * d, k, key_stride, keys, d, scale, p.data() + h * n, n);
  for (h = 0; h < heads; ++h) {
    float* ph = p.data() + h * n;
    const float top = n > 0 ? *std::max_element(ph, ph + n) : 0.f;
    for (int64_t i = 0; i < n; ++i) ph[i] -= top;
  }
  exp_inplace(p.data(), heads * n);
  for (h = 0; h + 4 <= heads; h += 4) values<T, 4>(p.data() + h * n, n, v, key_stride, keys, d, out + h * d);
  for (; h < heads; ++h) values<T, 1>(p.data() + h * n, n, v, key_stride, keys, d, out + h * d);
  for (h = 0; h < heads; ++h) {
    float* o = out + h * d;
    const float total = sum(p.data() + h * n, n);
    const float inv = 1.f / total;
    for (int64_t i = 0; i < d; ++i) o[i] = n > 0 ? o[i] * inv : std::numeric_limits<float>::quiet_NaN();  // SDPA's
  }
}

template <typename T>
void attend_batch(const float* qp, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                  int64_t mask_batch_stride, float scale, float* op, int64_t B, int64_t H, int64_t d) {
  const int64_t G = k.size(1), L = k.size(2), per = H / G;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> p;
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / G, g = bg % G;
      attend_group(qp + (b * H + g * per) * d, per, kp + b * k.stride(0) + g * k.stride(1),
                   vp + b * v.stride(0) + g * v.stride(1), k.stride(2),
                   mask == nullptr ? nullptr : mask + b * mask_batch_stride, L, d, scale,
                   op + (b * H + g * per) * d, keys, p);
    }
  });
}

}  // namespace

at::Tensor moe_cpu::decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: q [B, H, 1, D] and k, v [B, G, L, D] with G dividing H, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "decode_attention: k and v both fp32 or both bf16");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "decode_attention: q fp32 or bf16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "decode_attention: k and v with the same strides, rows contiguous");
  const int64_t B = q.size(0), L = k.size(2);
  const bool* mp = nullptr;
  int64_t mask_batch_stride = 0;
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == 1 &&
                    mask->size(3) == L && (mask->size(0) == B || mask->size(0) == 1),
                "decode_attention: mask [B or 1, 1, 1, L] bool, got ", mask->sizes());
    m = mask->stride(3) == 1 ? *mask : mask->contiguous();
    mp = m.data_ptr<bool>();
    mask_batch_stride = m.size(0) == 1 ? 0 : m.stride(0);
  }
  // q and the output in fp32: read and written in place when fp32, else through this thread's buffers (no aten
  // conversion per call), rounded to bf16 once at the end as `Tensor.to` rounds.
  const int64_t H = q.size(1), d = q.size(3), n = q.numel();
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  thread_local std::vector<float> q_buffer, out_buffer;
  const bool fp32 = q.scalar_type() == at::kFloat;
  const float* qp = moe_cpu::fp32_values(qc, q_buffer);
  if (!fp32) out_buffer.resize(n);
  float* op = fp32 ? out.data_ptr<float>() : out_buffer.data();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  if (k.scalar_type() == at::kFloat) {
    attend_batch<float>(qp, k, v, mp, mask_batch_stride, scale, op, B, H, d);
  } else {
    attend_batch<c10::BFloat16>(qp, k, v, mp, mask_batch_stride, scale, op, B, H, d);
  }
  if (!fp32) {
    c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) ob[i] = static_cast<c10::BFloat16>(out_buffer[i]);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("decode_attention", moe_cpu::decode_attention); }
