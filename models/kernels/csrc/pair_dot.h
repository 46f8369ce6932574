// The order every product of bf16 weights sums in, decode (models/kernels/csrc/matvec.cpp) and prompt
// (models/kernels/csrc/prompt_gemm.cpp) kernels alike: the order of the CPU's bf16 dot-product instruction
// (AVX-512 BF16's vdpbf16ps), so that a CPU with it runs a decode step's bf16 products in it and every other build
// gives the same bits with fp32 multiply-adds.
//
// The pair order: 16 chains, chain c summing the column pairs p = c, c + 16, c + 32, ... (columns 2p and 2p + 1)
// below the last multiple of 32 columns, in order, each pair as two multiply-adds, column 2p + 1 first (as the
// instruction adds them); then the chains added (c_i + c_{i+8}), then (i, i + 4), (i, i + 2), (0, 1); then the
// columns past that, in order, one multiply-add each. The whole product runs with denormals flushed to zero, inputs
// and results (`FlushDenormals`), as the instruction computes. A bf16 weight times a bf16 activation is exact in
// fp32, so one rounding per add is what both the instruction and a fused multiply-add give.
//
// Why: the instruction takes 32 bf16 pairs where the widened fp32 loop (row_dot.h, the order before) took 8 columns
// per multiply-add and two more instructions to widen them. Measured on a 2-core AMD EPYC Zen 4 (2 threads, medians
// of 5 runs, the same hour): Qwen3-MoE-shaped expert products (8 of 64 experts, 384 x 512) in cache 39 us against
// 56; 4 rows per expert from memory 115-121 us against 179; one row from memory the same, bound by memory. A
// compiled batch-8 decode step of `scripts/bench.py --size qwen3-moe` 10.0-10.7 ms against 11.5-11.8; batch 1 in
// turns with llama.cpp unchanged (0.87-0.93x either way, read bandwidth 31-34 GB/s). The AVX2 build's loop in
// this order (two bit operations widen a pair) was as fast as the one before or faster: 4 rows per expert in
// cache 120 us against 138-148.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "row_dot.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace moe_cpu {

constexpr int64_t kPairChains = 16;

// The columns the chains take: whole blocks of 32.
inline int64_t pair_body(int64_t in) { return in & ~int64_t{31}; }

// Denormal inputs read as zero and denormal results written as zero while it lives (x86's MXCSR DAZ and FTZ, this
// thread only), as the bf16 dot-product instruction computes; restored after. Elsewhere nothing changes (no build
// off x86 is a measured flavour: models/kernels/choice.py).
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

struct KeepDenormals {};
// What a product holds while it computes: `FlushDenormals` for bf16 weights (`flush`), else nothing.
template <bool flush>
using DenormalMode = std::conditional_t<flush, FlushDenormals, KeepDenormals>;

// The 16 chains of an output added in the pair order: c_i + c_{i+8}, then (i, i + 4), (i, i + 2), (0, 1).
inline float pair_chains_added(const float c[16]) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = c[i] + c[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#ifdef MOE_MATVEC_AVX2
inline __m256 pair_chains_added(const __m256 c[16]) {  // 8 outputs at once, lane by lane
  __m256 s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = _mm256_add_ps(c[i], c[i + 8]);
  for (int i = 0; i < 4; ++i) s4[i] = _mm256_add_ps(s8[i], s8[i + 4]);
  return _mm256_add_ps(_mm256_add_ps(s4[0], s4[2]), _mm256_add_ps(s4[1], s4[3]));
}
#endif

// An fp32 activation row as `dot_pairs`' multiply-adds read it (`split_pairs`): in each block of 32 columns, the
// odd columns of pairs 0-7, their even columns, then pairs 8-15 likewise (one vector each); columns past the blocks
// where they are. Pair p's odd column sits at `odd_slot(p)` of its block, its even column 8 further on.
inline int64_t odd_slot(int64_t p) { return (p & 8) * 2 + (p & 7); }

// One fp32 row in that layout, into `out` (in values).
inline void split_pairs(const float* x, int64_t in, float* out) {
  const int64_t body = pair_body(in);
  for (int64_t b = 0; b < body; b += 32) {
    for (int64_t p = 0; p < 16; ++p) {
      out[b + odd_slot(p)] = x[b + 2 * p + 1];
      out[b + odd_slot(p) + 8] = x[b + 2 * p];
    }
  }
  std::memcpy(out + body, x + body, (in - body) * sizeof(float));
}

// Where column d of a row sits in the prompt kernel's layout for bf16 weights (gemm_layout.h): below `chained` (a
// multiple of 32), chain by chain, each chain's columns side by side in the order it takes them (2c + 1, 2c,
// 2c + 33, 2c + 32, ...); from `chained` on where they are.
inline int64_t pair_major(int64_t d, int64_t chained) {
  if (d >= chained) return d;
  return ((d & 31) >> 1) * (chained / kPairChains) + (d >> 5) * 2 + (1 - (d & 1));
}

// R bf16 weight rows against one activation row in the pair order (the caller holds a `FlushDenormals`). `xb`: the
// row as bf16 where it is bf16 and the build has the instruction (its operand), else null; `xs` (read only where
// `xb` is null): the row in `split_pairs`' layout.
// With `ahead` > 0 each row also asks for the line `ahead` bytes further on every 32 weights (row_dot.h: `dot_rows`
// says why).
template <int R>
__attribute__((always_inline)) inline void dot_pairs(const c10::BFloat16* const w[R], const float* xs,
                                                     const c10::BFloat16* xb, int64_t in, float* s, int ahead) {
  const int64_t body = pair_body(in);
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (xb != nullptr) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (; i < body; i += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i);
      for (int r = 0; r < R; ++r) {
        if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i) + ahead, _MM_HINT_T0);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w[r] + i), xv);
      }
    }
    for (int r = 0; r < R; ++r) {  // lanes 0-7 are chains 0-7, lanes 8-15 chains 8-15
      s[r] = hsum(_mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1))));
    }
  }
#endif
#ifdef MOE_MATVEC_AVX2
  if (i == 0 && body > 0) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m256 lo[R], hi[R];  // chains 0-7 and 8-15
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (; i < body; i += 32) {
      const __m256 odd0 = _mm256_loadu_ps(xs + i), even0 = _mm256_loadu_ps(xs + i + 8);
      const __m256 odd1 = _mm256_loadu_ps(xs + i + 16), even1 = _mm256_loadu_ps(xs + i + 24);
      for (int r = 0; r < R; ++r) {
        if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i) + ahead, _MM_HINT_T0);
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + i + 16));
        lo[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)), odd0, lo[r]);
        lo[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), even0, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(b, high)), odd1, hi[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), even1, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) s[r] = hsum(_mm256_add_ps(lo[r], hi[r]));
  }
#endif
  if (i < body) {  // no vector build: the same multiply-adds, one at a time
    for (int r = 0; r < R; ++r) {
      float c[16] = {};
      for (int64_t b = 0; b < body; b += 32) {
        for (int64_t p = 0; p < 16; ++p) {
          c[p] = madd(widen(w[r][b + 2 * p + 1]), xs[b + odd_slot(p)], c[p]);
          c[p] = madd(widen(w[r][b + 2 * p]), xs[b + odd_slot(p) + 8], c[p]);
        }
      }
      s[r] = pair_chains_added(c);
    }
  } else if (body == 0) {
    for (int r = 0; r < R; ++r) s[r] = 0.f;
  }
  for (int64_t k = body; k < in; ++k) {
    const float x = xb != nullptr ? widen(xb[k]) : xs[k];
    for (int r = 0; r < R; ++r) s[r] = madd(widen(w[r][k]), x, s[r]);
  }
}

}  // namespace moe_cpu
