// Weight rows against an fp32 row, summed in fp32: the decode kernel's fp32 products (`dot_rows`, in the order the
// prompt kernel sums in too; bf16 weights sum in their own order, pair_dot.h), and the scores and values of a decode
// step's attention (`dot_float`).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "int8_rows.h"

namespace moe_cpu {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

#ifdef MOE_MATVEC_AVX2
inline __m256 load8(const float* p) { return load_floats(p); }
inline __m256 load8(const c10::BFloat16* p) { return load_floats(p); }
inline __m256 load8(const int8_t* p) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// sum_i w[i] * x[i]: one weight row read front to back (a single stream the prefetcher follows), 4 x 8 lanes.
template <typename W>
inline float dot_float(const W* w, const float* x, int64_t in) {
  int64_t i = 0;
  float s = 0.f;
#ifdef MOE_MATVEC_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= in; i += 32) {
    a0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; i < in; ++i) s += widen(w[i]) * x[i];  // the tail (or everything, without AVX2)
  return s;
}

// One multiply-add rounded as the vector kernels round theirs: fused with AVX2 and FMA, else two roundings (the
// kernels are built with -ffp-contract=off, so the compiler never fuses one on its own: every kernel computes an
// fp32 product in exactly the operations written).
inline float madd(float a, float b, float c) {
#ifdef MOE_MATVEC_AVX2
  return std::fma(a, b, c);
#else
  return c + a * b;
#endif
}

// The 8 chains of an output added in `dot_rows`' order (below): `hsum` adds the lanes of one vector so; these add
// 8 separate values, or 8 vectors lane by lane (the prompt kernel's chains of 8 outputs at once).
inline float chains_added(const float c[8]) {
  return ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
}
#ifdef MOE_MATVEC_AVX2
inline __m256 chains_added(const __m256 c[8]) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c[0], c[4]), _mm256_add_ps(c[2], c[6])),
                       _mm256_add_ps(_mm256_add_ps(c[1], c[5]), _mm256_add_ps(c[3], c[7])));
}
#endif

// The order of every fp32 weight product, decode (models/kernels/csrc/matvec.cpp) and prompt (models/kernels/csrc/prompt_gemm.cpp)
// kernels alike, so a row's result is the same bits whichever computes it, whatever its batch:
// 8 chains, chain j summing the columns k = j, j + 8, j + 16, ... below the last multiple of 8, in order, one
// multiply-add each from 0; then ((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7)); then the columns past that,
// in order, one multiply-add each. Here the chains are the lanes of one vector per weight row; R weight rows at a
// time against one activation row x give R independent chains of multiply-adds, enough to hide their latency.
// With `ahead` > 0 each row also asks for the line `ahead` bytes further on every 32 weights, a request that cannot
// fault (past the row's end included): on some CPUs weights widened on load leave the hardware prefetcher behind.
// The caller's rows are each the head of a stream of consecutive rows, so that line is the stream's next. The
// distance is measured on the machine (models/kernels/tuning.py); a request never changes a bit.
template <typename W, int R>
inline void dot_rows(const W* const w[R], const float* x, int64_t in, float* s, int ahead) {
  const int64_t body = in & ~int64_t{7};
#ifdef MOE_MATVEC_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= body; i += 32) {
    for (int r = 0; r < R; ++r) {
      if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i) + ahead, _MM_HINT_T0);
    }
    for (int64_t h = i; h < i + 32; h += 8) {
      const __m256 xv = _mm256_loadu_ps(x + h);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(load8(w[r] + h), xv, acc[r]);
    }
  }
  for (; i < body; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(load8(w[r] + i), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) s[r] = hsum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float c[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < body; ++i) c[i & 7] = madd(widen(w[r][i]), x[i], c[i & 7]);
    s[r] = chains_added(c);
  }
#endif
  for (int64_t i = body; i < in; ++i) {
    for (int r = 0; r < R; ++r) s[r] = madd(widen(w[r][i]), x[i], s[r]);
  }
}

// A contiguous fp32 or bf16 tensor's values as fp32: fp32 read in place, bf16 widened into `buffer` (no aten
// conversion, 2-3 us a call on a decode step's few rows).
inline const float* fp32_values(const at::Tensor& t, std::vector<float>& buffer) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  const int64_t n = t.numel();
  buffer.resize(n);
  const c10::BFloat16* p = t.data_ptr<c10::BFloat16>();
  float* out = buffer.data();
  for (int64_t i = 0; i < n; ++i) out[i] = widen(p[i]);
  return out;
}

}  // namespace moe_cpu
