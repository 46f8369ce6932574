// Moving values between row-major tensors and the prompt kernel's blocks (models/kernels/csrc/prompt_gemm.cpp): a block of 16
// rows is stored depth-major ([depth][16], one row per vector lane), a group of COLS weight rows interleaved
// ([depth][COLS]), and a block's outputs come out column-major ([cols][16]). Each move is 8 x 8 transposes in
// registers, so rows are read and written 8 values at a time: done one value at a time, the finish took 15% of a
// prompt product at depth 512, the packing 15% at depth 1792.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#include "gemm_micro.h"
#include "pair_dot.h"

namespace moe_cpu {

#ifdef MOE_MATVEC_AVX2
// t[j][i] = v[i][j] for an 8 x 8 block of 32-bit values (floats, or integers moved as floats).
inline void transpose8(const __m256 v[8], __m256 t[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  t[0] = _mm256_permute2f128_ps(s0, s4, 0x20), t[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  t[2] = _mm256_permute2f128_ps(s2, s6, 0x20), t[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  t[4] = _mm256_permute2f128_ps(s0, s4, 0x31), t[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  t[6] = _mm256_permute2f128_ps(s2, s6, 0x31), t[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }

// 8 floats rounded to bf16 as c10::BFloat16 rounds one: to nearest, ties to even, a NaN to 0x7FC0.
inline void store8(c10::BFloat16* y, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i b = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(packed));
}
#endif

// Where column d of a row sits in the prompt kernel's fp32 layout: the columns below `chained` (a multiple of 8:
// those `dot_rows` sums in 8 chains) chain by chain, chain j's columns j, j + 8, ... side by side, so that the
// micro kernel reads each chain's columns contiguously; the columns from `chained` on where they are. chained = 0:
// every column where it is (int8 pairs). With 16 chains, bf16 weights' pair order (pair_dot.h: `pair_major`).
template <int kChains = 8>
inline int64_t chain_major(int64_t d, int64_t chained) {
  if constexpr (kChains == kPairChains) return pair_major(d, chained);
  return d < chained ? (d & 7) * (chained / 8) + d / 8 : d;
}

// dst[chain_major(d, chained) * 16 + r] = rows[r][d] for d < depth, r < 16 (Lane: a 32-bit type).
template <int kChains, typename Lane>
void transpose_rows(const Lane* const rows[ROWS], int64_t depth, int64_t chained, Lane* dst) {
  static_assert(sizeof(Lane) == 4, "lanes are 32-bit");
  int64_t d0 = 0;
#ifdef MOE_MATVEC_AVX2
  for (; d0 + 8 <= depth; d0 += 8) {  // 8 columns: chained, or all past `chained` (both multiples of 8)
    for (int64_t h = 0; h < ROWS; h += 8) {
      __m256 v[8], t[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[h + i] + d0));
      transpose8(v, t);
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + chain_major<kChains>(d0 + j, chained) * ROWS + h), t[j]);
      }
    }
  }
#endif
  for (; d0 < depth; ++d0) {
    for (int64_t r = 0; r < ROWS; ++r) dst[chain_major<kChains>(d0, chained) * ROWS + r] = rows[r][d0];
  }
}

#ifdef MOE_MATVEC_AVX2
// dst[at(k0 + j) * COLS + h + i] = v[i][j] for i < min(8, COLS - h), j < 8, where v[i] = `load(h + i, k0)`: the 8
// values k0 .. k0 + 7 of row h + i (zeros past the group's rows) moved to their places by 8 x 8 transposes.
template <typename Load, typename At>
inline void interleave8(Load load, At at, int64_t k0, float* dst) {
  for (int64_t h = 0; h < COLS; h += 8) {
    const int64_t width = std::min<int64_t>(8, COLS - h);
    if (width == 4) {  // the last 4 of 12 rows (AVX-512): a 4 x 8 transpose, a third of an 8 x 8's shuffles
      const __m256 v0 = load(h, k0), v1 = load(h + 1, k0), v2 = load(h + 2, k0), v3 = load(h + 3, k0);
      const __m256 a = _mm256_unpacklo_ps(v0, v1), b = _mm256_unpackhi_ps(v0, v1);
      const __m256 c = _mm256_unpacklo_ps(v2, v3), d = _mm256_unpackhi_ps(v2, v3);
      const __m256 s[4] = {_mm256_shuffle_ps(a, c, 0x44), _mm256_shuffle_ps(a, c, 0xEE),
                           _mm256_shuffle_ps(b, d, 0x44), _mm256_shuffle_ps(b, d, 0xEE)};  // columns j | j + 4
      for (int64_t j = 0; j < 4; ++j) {
        _mm_storeu_ps(dst + at(k0 + j) * COLS + h, _mm256_castps256_ps128(s[j]));
        _mm_storeu_ps(dst + at(k0 + j + 4) * COLS + h, _mm256_extractf128_ps(s[j], 1));
      }
      continue;
    }
    __m256 v[8], t[8];
    for (int64_t i = 0; i < 8; ++i) v[i] = i < width ? load(h + i, k0) : _mm256_setzero_ps();
    transpose8(v, t);
    if (width == 8) {
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(dst + at(k0 + j) * COLS + h, t[j]);
    } else {
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int64_t j = 0; j < 8; ++j) _mm256_maskstore_ps(dst + at(k0 + j) * COLS + h, keep, t[j]);
    }
  }
}
#endif

// dst[chain_major(k, chained) * COLS + c] = rows[c * in + k] as fp32 for k < in, c < n (<= COLS; zeros for c >= n):
// n weight rows widened into the prompt kernel's layout, chain by chain like a block of rows, COLS rows interleaved
// (a micro kernel's step reads its COLS values side by side: gemm_micro.h), in one pass of 8 x 8 transposes.
template <int kChains, typename W>
inline void widen_interleaved(const W* rows, int64_t in, int64_t chained, int64_t n, float* dst) {
  const auto at = [chained](int64_t k) { return chain_major<kChains>(k, chained); };
  int64_t k0 = 0;
#ifdef MOE_MATVEC_AVX2
  const auto load = [&](int64_t c, int64_t k) { return c < n ? load_floats(rows + c * in + k) : _mm256_setzero_ps(); };
  for (; k0 + 8 <= in; k0 += 8) interleave8(load, at, k0, dst);  // 8 columns chained, or all past `chained`
#endif
  for (; k0 < in; ++k0) {
    for (int64_t c = 0; c < COLS; ++c) dst[at(k0) * COLS + c] = c < n ? static_cast<float>(rows[c * in + k0]) : 0.f;
  }
}

// dst[j * COLS + c] = int8 row c's pair of columns (2j, 2j + 1) as two int16 (a zero past `in`), for c < n (<= COLS;
// zeros for c >= n), j < (in + 1) / 2: the int8 kernel's widened rows, interleaved in one pass.
inline void widen_pairs_interleaved(const int8_t* rows, int64_t in, int64_t n, int32_t* dst) {
  const int64_t pairs = (in + 1) / 2;
  int64_t j0 = 0;
#ifdef MOE_MATVEC_AVX2
  const auto load = [&](int64_t c, int64_t j) {
    if (c >= n) return _mm256_setzero_ps();
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + c * in + 2 * j));
    return _mm256_castsi256_ps(_mm256_cvtepi8_epi16(bytes));
  };
  const auto at = [](int64_t j) { return j; };
  for (; 2 * (j0 + 8) <= in; j0 += 8) interleave8(load, at, j0, reinterpret_cast<float*>(dst));
#endif
  for (; j0 < pairs; ++j0) {
    for (int64_t c = 0; c < COLS; ++c) {
      int16_t* pair = reinterpret_cast<int16_t*>(dst + j0 * COLS + c);  // as the micro kernels read it
      pair[0] = c < n ? rows[c * in + 2 * j0] : 0;
      pair[1] = c < n && 2 * j0 + 1 < in ? rows[c * in + 2 * j0 + 1] : 0;
    }
  }
}

// Where weight row c's values start in a panel of interleaved groups of COLS rows of `stride` values each: value k
// at [k * COLS].
template <typename W>
inline const W* panel_column(const W* panel, int64_t c, int64_t stride) {
  return panel + (c / COLS) * COLS * stride + c % COLS;
}

// y[r * y_stride + c] = fin[c * 16 + r] for r < rows, c < cols: a block's outputs into their rows.
template <typename Out>
void store_block(const float* fin, int64_t rows, int64_t cols, int64_t y_stride, Out* y) {
  int64_t c0 = 0;
#ifdef MOE_MATVEC_AVX2
  for (; c0 + 8 <= cols; c0 += 8) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      __m256 v[8], t[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(fin + (c0 + i) * ROWS + r0);
      transpose8(v, t);
      for (int64_t j = 0; j < 8 && r0 + j < rows; ++j) store8(y + (r0 + j) * y_stride + c0, t[j]);
    }
  }
#endif
  for (; c0 < cols; ++c0) {
    for (int64_t r = 0; r < rows; ++r) y[r * y_stride + c0] = static_cast<Out>(fin[c0 * ROWS + r]);
  }
}

}  // namespace moe_cpu
