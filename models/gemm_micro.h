// The inner loops of the prompt products (models/prompt_gemm.cpp): a block of 16 activation rows against 6
// widened weight rows, over a range of the depth, into 16 x 6 totals (fp32: one of their 8 chains). One block row
// per vector lane, a weight value broadcast to all lanes: 12 accumulators in registers (named: with an array GCC
// kept them in memory, at a third of the speed).

#pragma once

#include <cstdint>

#include "row_dot.h"

namespace moe_cpu {

constexpr int64_t ROWS = 16;  // activation rows per block: two vectors of 8 lanes
constexpr int64_t COLS = 6;   // weight rows per call: 12 accumulators

// tot[c * 16 + r] += sum over pairs j in [j0, j1) of A[j][r] . B[c][2j, 2j+1], for c < COLS, r < ROWS.
// A: one block of rows, [pairs][16] int32 (two int16 each); B: COLS widened weight rows of `stride` int16.
inline void micro_int8(const int32_t* A, const int16_t* B, int64_t stride, int64_t j0, int64_t j1, int64_t* tot) {
#ifdef MOE_MATVEC_AVX2
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
          c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const int32_t* b0 = reinterpret_cast<const int32_t*>(B);
  const int32_t *b1 = b0 + stride / 2, *b2 = b1 + stride / 2, *b3 = b2 + stride / 2, *b4 = b3 + stride / 2,
                *b5 = b4 + stride / 2;
  for (int64_t j = j0; j < j1; ++j) {
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * ROWS));
    const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * ROWS + 8));
#define MOE_PAIR(c0, c1, bc)                                  \
  {                                                           \
    const __m256i w = _mm256_set1_epi32(bc[j]);               \
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(a0, w));      \
    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(a1, w));      \
  }
    MOE_PAIR(c00, c01, b0) MOE_PAIR(c10, c11, b1) MOE_PAIR(c20, c21, b2)
    MOE_PAIR(c30, c31, b3) MOE_PAIR(c40, c41, b4) MOE_PAIR(c50, c51, b5)
#undef MOE_PAIR
  }
  const __m256i acc[2 * COLS] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int64_t v = 0; v < 2 * COLS; ++v) {  // vector v: weight row v / 2, activation rows 8 (v % 2) .. + 7
    __m256i* t = reinterpret_cast<__m256i*>(tot + v * 8);
    const __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc[v]));
    const __m256i hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc[v], 1));
    _mm256_storeu_si256(t, _mm256_add_epi64(_mm256_loadu_si256(t), lo));
    _mm256_storeu_si256(t + 1, _mm256_add_epi64(_mm256_loadu_si256(t + 1), hi));
  }
#else
  const int16_t* a = reinterpret_cast<const int16_t*>(A);
  for (int64_t c = 0; c < COLS; ++c) {
    for (int64_t r = 0; r < ROWS; ++r) {
      int64_t s = 0;
      for (int64_t j = j0; j < j1; ++j) {
        const int16_t* w = B + c * stride + 2 * j;
        s += int64_t{a[(j * ROWS + r) * 2]} * w[0] + int64_t{a[(j * ROWS + r) * 2 + 1]} * w[1];
      }
      tot[c * ROWS + r] += s;
    }
  }
#endif
}

// Chain j of `dot_rows` (models/row_dot.h) for a 16 x 6 block of outputs, continued over columns [k0, k1)
// (multiples of 8, below `chained`): tot[c * 16 + r] for output (c, r), started from 0 when k0 is 0, takes
// A[k][r] * B[c][k] for k = k0 + j, k0 + j + 8, ... by one multiply-add each. A and B hold these columns chain by
// chain (gemm_layout.h: `chain_major`), so the chain's are read contiguously, with the 12 accumulators in
// registers.
// A: one block of rows, [in][16] fp32; B: COLS weight rows of `stride` fp32.
inline void micro_float(const float* A, const float* B, int64_t stride, int64_t k0, int64_t k1, int64_t chained,
                        int64_t j, float* t) {
  const int64_t p0 = j * (chained / 8) + k0 / 8, p1 = p0 + (k1 - k0) / 8;  // the chain's columns, as stored
#ifdef MOE_MATVEC_AVX2
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (k0 > 0) {
    c00 = _mm256_loadu_ps(t), c01 = _mm256_loadu_ps(t + 8), c10 = _mm256_loadu_ps(t + 16);
    c11 = _mm256_loadu_ps(t + 24), c20 = _mm256_loadu_ps(t + 32), c21 = _mm256_loadu_ps(t + 40);
    c30 = _mm256_loadu_ps(t + 48), c31 = _mm256_loadu_ps(t + 56), c40 = _mm256_loadu_ps(t + 64);
    c41 = _mm256_loadu_ps(t + 72), c50 = _mm256_loadu_ps(t + 80), c51 = _mm256_loadu_ps(t + 88);
  }
  const float *b0 = B, *b1 = b0 + stride, *b2 = b1 + stride, *b3 = b2 + stride, *b4 = b3 + stride,
              *b5 = b4 + stride;
  for (int64_t k = p0; k < p1; ++k) {
    const __m256 a0 = _mm256_loadu_ps(A + k * ROWS), a1 = _mm256_loadu_ps(A + k * ROWS + 8);
#define MOE_COL(c0, c1, bc)                           \
  {                                                   \
    const __m256 w = _mm256_broadcast_ss(bc + k);     \
    c0 = _mm256_fmadd_ps(a0, w, c0);                  \
    c1 = _mm256_fmadd_ps(a1, w, c1);                  \
  }
    MOE_COL(c00, c01, b0) MOE_COL(c10, c11, b1) MOE_COL(c20, c21, b2)
    MOE_COL(c30, c31, b3) MOE_COL(c40, c41, b4) MOE_COL(c50, c51, b5)
#undef MOE_COL
  }
  const __m256 acc[2 * COLS] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int64_t v = 0; v < 2 * COLS; ++v) _mm256_storeu_ps(t + v * 8, acc[v]);
#else
  for (int64_t c = 0; c < COLS; ++c) {
    for (int64_t r = 0; r < ROWS; ++r) {
      float s = k0 > 0 ? t[c * ROWS + r] : 0.f;
      for (int64_t k = p0; k < p1; ++k) s = madd(A[k * ROWS + r], B[c * stride + k], s);
      t[c * ROWS + r] = s;
    }
  }
#endif
}

}  // namespace moe_cpu
