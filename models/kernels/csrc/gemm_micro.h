// The inner loops of the prompt products (models/kernels/csrc/prompt_gemm.cpp): a block of 16 activation rows against COLS
// widened weight rows, over a range of the depth, into 16 x COLS totals (fp32: one of their 8 chains). One block
// row per vector lane, a weight value broadcast to all lanes, every accumulator in a register of its own (named:
// with an array GCC kept them in memory, at a third of the speed), the weight rows' values interleaved, so that a
// step's broadcasts read one stream (read from COLS rows a multiple of 2 KB apart, the products ran 20-30% slower on
// an Intel Xeon with AVX-512, whose L1 holds 12 lines of a set: the rows and the block's lines fought for it).
// AVX2: 6 weight rows, 12 accumulators of 8 lanes. AVX-512: 12 weight rows, 12 accumulators of 16 lanes, twice the
// products per instruction; each lane takes the same multiply-adds in the same order, so both builds give the same
// bits.

#pragma once

#include <cstdint>

#include "row_dot.h"

#if defined(MOE_MATVEC_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define MOE_GEMM_AVX512 1
#endif

namespace moe_cpu {

constexpr int64_t ROWS = 16;  // activation rows per block: two vectors of 8 lanes, or one of 16
#ifdef MOE_GEMM_AVX512
constexpr int64_t COLS = 12;  // weight rows per call: 12 accumulators of 16 lanes
#else
constexpr int64_t COLS = 6;  // weight rows per call: 12 accumulators of 8 lanes
#endif

#ifdef MOE_GEMM_AVX512
// The 12 accumulators of a 512-bit call: X(i) for each weight row i.
#define MOE_EACH_COL(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// 16 lanes of pair-sums (int32) added into their int64 totals.
inline void add_to_totals(__m512i acc, int64_t* t) {
  __m512i* v = reinterpret_cast<__m512i*>(t);
  _mm512_storeu_si512(v, _mm512_add_epi64(_mm512_loadu_si512(v), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc))));
  _mm512_storeu_si512(v + 1, _mm512_add_epi64(_mm512_loadu_si512(v + 1),
                                              _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1))));
}

// One pair of int16 products added into a lane: VNNI's fused instruction where the CPU has it (the same integers:
// both wrap modulo 2^32, and the lanes never reach it, prompt_gemm.cpp says why).
inline __m512i pair_add(__m512i acc, __m512i a, __m512i w) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, w));
#endif
}
#endif

// tot[c * 16 + r] += sum over pairs j in [j0, j1) of A[j][r] . B[j][c], for c < COLS, r < ROWS.
// A: one block of rows, [pairs][16] int32 (two int16 each); B: COLS widened weight rows interleaved, [pairs][COLS]
// int32 (two int16 each; gemm_layout.h: `widen_pairs_interleaved`).
inline void micro_int8(const int32_t* A, const int32_t* B, int64_t j0, int64_t j1, int64_t* tot) {
#if defined(MOE_GEMM_AVX512)
#define MOE_START(i) __m512i c##i = _mm512_setzero_si512();
  MOE_EACH_COL(MOE_START)
#undef MOE_START
  const int32_t* b = B + j0 * COLS;
  for (int64_t j = j0; j < j1; ++j, b += COLS) {
    const __m512i a = _mm512_loadu_si512(A + j * ROWS);
#define MOE_PAIR(i) c##i = pair_add(c##i, a, _mm512_set1_epi32(b[i]));
    MOE_EACH_COL(MOE_PAIR)
#undef MOE_PAIR
  }
#define MOE_ADD(i) add_to_totals(c##i, tot + (i) * ROWS);
  MOE_EACH_COL(MOE_ADD)
#undef MOE_ADD
#elif defined(MOE_MATVEC_AVX2)
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
          c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const int32_t* b = B + j0 * COLS;
  for (int64_t j = j0; j < j1; ++j, b += COLS) {
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * ROWS));
    const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + j * ROWS + 8));
#define MOE_PAIR(c0, c1, i)                                   \
  {                                                           \
    const __m256i w = _mm256_set1_epi32(b[i]);                \
    c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(a0, w));      \
    c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(a1, w));      \
  }
    MOE_PAIR(c00, c01, 0) MOE_PAIR(c10, c11, 1) MOE_PAIR(c20, c21, 2)
    MOE_PAIR(c30, c31, 3) MOE_PAIR(c40, c41, 4) MOE_PAIR(c50, c51, 5)
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
        const int16_t* w = reinterpret_cast<const int16_t*>(B + j * COLS + c);
        s += int64_t{a[(j * ROWS + r) * 2]} * w[0] + int64_t{a[(j * ROWS + r) * 2 + 1]} * w[1];
      }
      tot[c * ROWS + r] += s;
    }
  }
#endif
}

// Chain j of `dot_rows` (models/kernels/csrc/row_dot.h; with kChains = 16, of bf16 weights' pair order,
// pair_dot.h) for a 16 x COLS block of outputs, continued over columns [k0, k1) (multiples of 8, or 32, below
// `chained`): tot[c * 16 + r] for output (c, r), started from 0 when k0 is 0, takes A[k][r] * B[c][k] for the
// chain's columns in that range, in its order, by one multiply-add each. A and B hold these columns chain by chain
// (gemm_layout.h: `chain_major`), so the chain's are read contiguously, B's COLS rows interleaved (a step's COLS
// values side by side: gemm_layout.h, `widen_interleaved`), with the 12 accumulators in registers.
// A: one block of rows, [in][16] fp32; B: [in][COLS] fp32.
template <int kChains = 8>
inline void micro_float(const float* A, const float* B, int64_t k0, int64_t k1, int64_t chained, int64_t j, float* t) {
  const int64_t p0 = j * (chained / kChains) + k0 / kChains, p1 = p0 + (k1 - k0) / kChains;  // as stored
#if defined(MOE_GEMM_AVX512)
#define MOE_START(i) __m512 c##i = k0 > 0 ? _mm512_loadu_ps(t + (i) * ROWS) : _mm512_setzero_ps();
  MOE_EACH_COL(MOE_START)
#undef MOE_START
  const float* b = B + p0 * COLS;
  for (int64_t k = p0; k < p1; ++k, b += COLS) {
    const __m512 a = _mm512_loadu_ps(A + k * ROWS);
#define MOE_COL(i) c##i = _mm512_fmadd_ps(a, _mm512_set1_ps(b[i]), c##i);
    MOE_EACH_COL(MOE_COL)
#undef MOE_COL
  }
#define MOE_STORE(i) _mm512_storeu_ps(t + (i) * ROWS, c##i);
  MOE_EACH_COL(MOE_STORE)
#undef MOE_STORE
#elif defined(MOE_MATVEC_AVX2)
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (k0 > 0) {
    c00 = _mm256_loadu_ps(t), c01 = _mm256_loadu_ps(t + 8), c10 = _mm256_loadu_ps(t + 16);
    c11 = _mm256_loadu_ps(t + 24), c20 = _mm256_loadu_ps(t + 32), c21 = _mm256_loadu_ps(t + 40);
    c30 = _mm256_loadu_ps(t + 48), c31 = _mm256_loadu_ps(t + 56), c40 = _mm256_loadu_ps(t + 64);
    c41 = _mm256_loadu_ps(t + 72), c50 = _mm256_loadu_ps(t + 80), c51 = _mm256_loadu_ps(t + 88);
  }
  const float* b = B + p0 * COLS;
  for (int64_t k = p0; k < p1; ++k, b += COLS) {
    const __m256 a0 = _mm256_loadu_ps(A + k * ROWS), a1 = _mm256_loadu_ps(A + k * ROWS + 8);
#define MOE_COL(c0, c1, i)                            \
  {                                                   \
    const __m256 w = _mm256_broadcast_ss(b + (i));    \
    c0 = _mm256_fmadd_ps(a0, w, c0);                  \
    c1 = _mm256_fmadd_ps(a1, w, c1);                  \
  }
    MOE_COL(c00, c01, 0) MOE_COL(c10, c11, 1) MOE_COL(c20, c21, 2)
    MOE_COL(c30, c31, 3) MOE_COL(c40, c41, 4) MOE_COL(c50, c51, 5)
#undef MOE_COL
  }
  const __m256 acc[2 * COLS] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int64_t v = 0; v < 2 * COLS; ++v) _mm256_storeu_ps(t + v * 8, acc[v]);
#else
  for (int64_t c = 0; c < COLS; ++c) {
    for (int64_t r = 0; r < ROWS; ++r) {
      float s = k0 > 0 ? t[c * ROWS + r] : 0.f;
      for (int64_t k = p0; k < p1; ++k) s = madd(A[k * ROWS + r], B[k * COLS + c], s);
      t[c * ROWS + r] = s;
    }
  }
#endif
}

}  // namespace moe_cpu
