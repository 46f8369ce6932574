// Activation rows rounded to 16-bit integers for the int8 kernels (models/matvec.cpp for decode steps,
// models/prompt_gemm.cpp for prompts): both round a row the same way, so a row's result is the same bits whichever
// kernel computes it.
//
// x ~ scale * q with scale = max|x| / 32767 and q = round-half-even(x / scale): an absolute error of at most
// max|x| / 65534 per element, finer than bf16's rounding for every element within 1/128 of the row's largest.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_MATVEC_AVX2 1
#endif

namespace moe_cpu {

// Rounds x[0:in] into q[0:in]; false (q unusable) if the row holds a NaN or an infinity.
inline bool quantize_row(const float* x, int64_t in, int16_t* q, float* scale) {
  int64_t i = 0;
  float top = 0.f;
  bool nan = false;
#ifdef MOE_MATVEC_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top8 = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (; i + 8 <= in; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  for (float lane : lanes) top = std::max(top, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (int64_t k = i; k < in; ++k) {
    nan = nan || std::isnan(x[k]);
    top = std::max(top, std::abs(x[k]));
  }
  if (nan || !std::isfinite(top)) return false;
  *scale = top / 32767.f;
  const float inv = top > 0.f ? 32767.f / top : 0.f;
  i = 0;
#ifdef MOE_MATVEC_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv), hi = _mm256_set1_ps(32767.f), lo = _mm256_set1_ps(-32767.f);
  for (; i + 16 <= in; i += 16) {  // nearest, ties to even, as std::nearbyint in the default rounding mode
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 a = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv8), mode);
    __m256 b = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv8), mode);
    a = _mm256_max_ps(lo, _mm256_min_ps(hi, a));
    b = _mm256_max_ps(lo, _mm256_min_ps(hi, b));
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
#endif
  for (; i < in; ++i) {
    q[i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(x[i] * inv))));
  }
  return true;
}

// A row's exact integer dot product, scaled back by the row's scale: in double (exact for any sum of int8 x
// int16 terms below 2^53), rounded once to fp32. Both kernels finish every int8 product here, then multiply by the
// weight row's scale in fp32: that is what makes their results the same bits.
inline float scaled_sum(int64_t sum, float x_scale) {
  return static_cast<float>(static_cast<double>(sum) * x_scale);
}

}  // namespace moe_cpu
