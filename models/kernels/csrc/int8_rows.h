// Activation rows rounded to 16-bit integers for the int8 kernels (models/kernels/csrc/matvec.cpp for decode steps,
// models/kernels/csrc/prompt_gemm.cpp for prompts): both round a row the same way, so a row's result is the same bits whichever
// kernel computes it.
//
// x ~ scale * q with scale = max|x| / 32767 and q = round-half-even(x / scale): an absolute error of at most
// max|x| / 65534 per element, finer than bf16's rounding for every element within 1/128 of the row's largest.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_MATVEC_AVX2 1
#endif

namespace moe_cpu {

#ifdef MOE_MATVEC_AVX2
inline __m256 load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_floats(const c10::BFloat16* p) {  // bf16 is the top half of an fp32: widened exactly
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
#endif

// Rounds x[0:in] (fp32 or bf16, the same bits either way) into q[0:in]; false (q unusable) if the row holds a NaN
// or an infinity.
template <typename X>
inline bool quantize_row(const X* x, int64_t in, int16_t* q, float* scale) {
  int64_t i = 0;
  float top = 0.f;
  bool nan = false;
#ifdef MOE_MATVEC_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top8 = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (; i + 8 <= in; i += 8) {
    const __m256 v = load_floats(x + i);
    top8 = _mm256_max_ps(top8, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  for (float lane : lanes) top = std::max(top, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (int64_t k = i; k < in; ++k) {
    const float v = static_cast<float>(x[k]);
    nan = nan || std::isnan(v);
    top = std::max(top, std::abs(v));
  }
  if (nan || !std::isfinite(top)) return false;
  *scale = top / 32767.f;
  const float inv = top > 0.f ? 32767.f / top : 0.f;
  i = 0;
#ifdef MOE_MATVEC_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv), hi = _mm256_set1_ps(32767.f), lo = _mm256_set1_ps(-32767.f);
  for (; i + 16 <= in; i += 16) {  // nearest, ties to even, as std::nearbyint in the default rounding mode
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m256 a = _mm256_round_ps(_mm256_mul_ps(load_floats(x + i), inv8), mode);
    __m256 b = _mm256_round_ps(_mm256_mul_ps(load_floats(x + i + 8), inv8), mode);
    a = _mm256_max_ps(lo, _mm256_min_ps(hi, a));
    b = _mm256_max_ps(lo, _mm256_min_ps(hi, b));
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
#endif
  for (; i < in; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) * inv);
    q[i] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, v)));
  }
  return true;
}

// A row's exact integer dot product, scaled back by the row's scale: in double (exact for any sum of int8 x
// int16 terms below 2^53), rounded once to fp32. Both kernels finish every int8 product here, then multiply by the
// weight row's scale in fp32: that is what makes their results the same bits.
inline float scaled_sum(int64_t sum, float x_scale) {
  return static_cast<float>(static_cast<double>(sum) * x_scale);
}

#ifdef MOE_MATVEC_AVX2
// scaled_sum of 4 sums at once, the same bits: each sum becomes a double exactly (by the 1.5 * 2^52 trick, exact
// for |sum| < 2^51: the prompt kernel takes rows of at most 2^28 values, whose sums stay below 127 * 32767 * 2^28),
// then the same double product, rounded once to fp32.
inline __m128 scaled_sum4(__m256i sums, __m128 x_scales) {
  const __m256i magic = _mm256_set1_epi64x(0x4338000000000000);
  const __m256d exact = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(sums, magic)), _mm256_castsi256_pd(magic));
  return _mm256_cvtpd_ps(_mm256_mul_pd(exact, _mm256_cvtps_pd(x_scales)));
}
#endif

}  // namespace moe_cpu
