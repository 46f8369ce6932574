// Grouped matrix-vector products that stream their weights: the CPU kernel of a decode step.
//
// y[n] = scale[e] * (w[e] @ x[n]) for the rows n of group e, where x's rows come grouped: counts[0] rows for
// w[0], then counts[1] for w[1], ... Rows past the last group come out as zeros; a group with no rows reads
// nothing. A decode step has a few rows per weight, so the product is bound by reading the weight: each thread
// streams a contiguous range of weight rows once, as 4 runs read side by side, against every activation row of the
// group (they stay in L1); int8 and bf16 weights are also asked for 1 KiB ahead of the reads. Each output is
// summed in the same order whatever the number of rows or threads, and in the prompt kernel's order
// (models/kernels/csrc/prompt_gemm.cpp), so a row's result depends neither on its batch nor on which kernel computes it.
//
// fp32 weights: one 8-lane fp32 accumulator per weight row, 4 rows at a time (row_dot.h: `dot_rows`, which states
// the order). Measured against one row at a time with 4 accumulators (a sum in another order), on the `small`
// model's decode shapes with weights from memory: 10-30% faster, since 4 chains of multiply-adds hide their latency
// as well and the prefetcher follows 4 streams. bf16 weights: 4 rows at a time likewise, in the order of the CPU's
// bf16 dot-product instruction, which runs them where the activations are bf16 and the CPU has it (pair_dot.h:
// `dot_pairs`; elsewhere fp32 multiply-adds in that order, the same bits). int8 weights: each activation
// row is first rounded to 16-bit integers against its largest magnitude (models/kernels/csrc/int8_rows.h), and the dot product
// is summed exactly in integers (int16 x int8 pairs, int32 lanes widened to int64 every 4096 elements, so no sum
// can overflow): 2.5x fewer instructions per weight than widening each int8 to fp32, and an exact sum whose order
// cannot matter (the 4 runs read side by side: 5-10% faster than one row at a time). A call whose rows hold a NaN
// or an infinity takes the fp32 path instead, so they propagate as they would in fp32.
//
// Built on first use by models/kernels/native.py (torch.utils.cpp_extension, with -fopenmp so that at::parallel_for
// runs on torch's own OpenMP threads). Weights: fp32, bf16 or int8 (with per-row fp32 scales); activations
// fp32 or bf16, accumulated in fp32 (int8: in integers); the output has the activations' dtype.

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "block_glue.h"
#include "int8_rows.h"
#include "pair_dot.h"
#include "row_dot.h"

namespace {

// How far ahead of its reads a thread asks for its bf16 and int8 weights, in bytes (0: no requests): the fastest
// of a few distances on the machine at hand, measured once and cached (models/kernels/tuning.py), since the best
// one differs between CPUs: 4096 on a Zen 5 EPYC (1.3x faster than 1024 in bf16), none on a Zen 4 one (10-18%
// faster than 4096), 1024 on a Zen 3 (docs/benchmarks.md). fp32 weights get no requests: their loop does little per
// byte, and on every CPU measured requests only slowed it. Set before a model's first step; read once per call.
std::atomic<int> g_ahead_bf16{0}, g_ahead_int8{0};

void set_prefetch(int64_t bf16_bytes, int64_t int8_bytes) {
  TORCH_CHECK(bf16_bytes >= 0 && bf16_bytes <= 65536 && int8_bytes >= 0 && int8_bytes <= 65536,
              "set_prefetch: distances of 0 to 65536 bytes");
  g_ahead_bf16 = static_cast<int>(bf16_bytes);
  g_ahead_int8 = static_cast<int>(int8_bytes);
}

#ifdef MOE_MATVEC_AVX2
inline __m256i madd16(const int8_t* w, const int16_t* q) {  // 8 lanes of w[2j] q[2j] + w[2j+1] q[2j+1]
  __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_madd_epi16(wide, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}
inline int64_t hsum64(__m256i v) {  // the 8 int32 lanes, summed in int64
  __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v));
  __m256i s = _mm256_add_epi64(lo, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}
#endif
#ifdef __AVX512VNNI__
inline __m512i widened16(const int8_t* w) {  // 32 int8 weights as 32 int16 lanes
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
#endif

// sum_i w[i] * q[i] in integers, exactly: one int8 weight row against one int16 activation row, in int32 lanes
// that each add one pair-sum of at most 2 * 127 * 32767 per 64 elements (4 x 8 lanes with AVX2; 2 x 16 with
// AVX-512 VNNI, whose multiply-add-accumulate takes the widened int8 pairs at once, 1.2x the AVX2 loop's rate on the
// Zen 5 EPYC). The accumulators are added and widened into int64 every 64 of them (4096 elements), so no sum can
// overflow; an exact sum, so either loop gives the same bits. With `ahead` > 0 each 64 weights also ask for the
// line `ahead` bytes further on (row_dot.h: `dot_rows` says why).
inline int64_t dot_int(const int8_t* w, const int16_t* q, int64_t in, int ahead) {
  int64_t i = 0, s = 0;
#ifdef MOE_MATVEC_AVX2
  const int64_t body = in & ~int64_t{63};
#ifdef __AVX512VNNI__
  while (i < body) {
    const int64_t end = std::min(body, i + 64 * 64);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    for (; i < end; i += 64) {
      if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w + i) + ahead, _MM_HINT_T0);
      a0 = _mm512_dpwssd_epi32(a0, widened16(w + i), _mm512_loadu_si512(q + i));
      a1 = _mm512_dpwssd_epi32(a1, widened16(w + i + 32), _mm512_loadu_si512(q + i + 32));
    }
    const __m512i a = _mm512_add_epi32(a0, a1);
    s += hsum64(_mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)));
  }
#else
  while (i < body) {
    const int64_t end = std::min(body, i + 64 * 64);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i < end; i += 64) {
      if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w + i) + ahead, _MM_HINT_T0);
      a0 = _mm256_add_epi32(a0, madd16(w + i, q + i));
      a1 = _mm256_add_epi32(a1, madd16(w + i + 16, q + i + 16));
      a2 = _mm256_add_epi32(a2, madd16(w + i + 32, q + i + 32));
      a3 = _mm256_add_epi32(a3, madd16(w + i + 48, q + i + 48));
    }
    s += hsum64(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
  }
#endif  // __AVX512VNNI__
#endif  // MOE_MATVEC_AVX2
  for (; i < in; ++i) s += static_cast<int64_t>(w[i]) * q[i];  // the tail (or everything, without AVX2)
  return s;
}

// R rows' `dot_int` in one pass (the same exact sums): the R rows' loads side by side, as `dot_pairs` reads bf16
// rows. Measured against `dot_int` row after row on a [104000, 512] int8 weight (2 threads, a 2-core AMD EPYC Zen 5,
// the two alternated call by call, medians): 55-60 GB/s against 47-50; rows of 1024, 46-49 against 42-45. Without
// AVX-512 VNNI, and for a single row (its own loop keeps two accumulators), it is `dot_int` row after row. A row's
// one accumulator here takes both halves of each 64 elements: at most 128 pair-sums of 2 * 128 * 32768 a lane before
// it is widened (1.07e9, within int32).
template <int R>
inline void dot_int_rows(const int8_t* const w[R], const int16_t* q, int64_t in, int ahead, int64_t s[R]) {
#ifdef __AVX512VNNI__
  if constexpr (R > 1) {
    const int64_t body = in & ~int64_t{63};
    int64_t i = 0;
    for (int r = 0; r < R; ++r) s[r] = 0;
    while (i < body) {
      const int64_t end = std::min(body, i + 64 * 64);
      __m512i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
      for (; i < end; i += 64) {
        const __m512i q0 = _mm512_loadu_si512(q + i), q1 = _mm512_loadu_si512(q + i + 32);
        for (int r = 0; r < R; ++r) {
          if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(w[r] + i) + ahead, _MM_HINT_T0);
          a[r] = _mm512_dpwssd_epi32(a[r], widened16(w[r] + i), q0);
          a[r] = _mm512_dpwssd_epi32(a[r], widened16(w[r] + i + 32), q1);
        }
      }
      for (int r = 0; r < R; ++r) {
        s[r] += hsum64(_mm256_add_epi32(_mm512_castsi512_si256(a[r]), _mm512_extracti64x4_epi64(a[r], 1)));
      }
    }
    for (; i < in; ++i) {
      for (int r = 0; r < R; ++r) s[r] += static_cast<int64_t>(w[r][i]) * q[i];
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r) s[r] = dot_int(w[r], q, in, ahead);
}

// Activation rows as the kernel reads them: `dot(w, m)` is weight row w against activation row m, unscaled by w's
// scale. fp32 (bf16 activations widened once per call), or, for int8 weights, rounded to int16 (`to_int16`) and
// summed exactly (`dot_int`).
struct FloatRows {
  const float* x;
  int64_t in;
  int ahead;  // int8 weights' distance (their rows where an activation row is not finite); fp32 weights: 0
  template <typename W, int R>
  void dot(const W* const w[R], int64_t m, float* s) const {
    moe_cpu::dot_rows<W, R>(w, x + m * in, in, s, ahead);
  }
};

// bf16 weights: the pair order (pair_dot.h), through the CPU's bf16 dot-product instruction where the rows are bf16
// and the build has it (`xb`), else fp32 multiply-adds on the rows in `split_pairs`' layout (`xs`).
struct PairRows {
  const float* xs;
  const c10::BFloat16* xb;
  int64_t in;
  int ahead;
  template <typename W, int R>
  __attribute__((always_inline)) void dot(const c10::BFloat16* const w[R], int64_t m, float* s) const {
    moe_cpu::dot_pairs<R>(w, xs + m * in, xb != nullptr ? xb + m * in : nullptr, in, s, ahead);
  }
};

struct IntRows {
  const int16_t* q;
  const float* scale;  // of each activation row
  int64_t in;
  int ahead;
  template <typename W, int R>
  void dot(const int8_t* const w[R], int64_t m, float* s) const {  // exact sums: any order
    int64_t sums[R];
    dot_int_rows<R>(w, q + m * in, in, ahead, sums);
    for (int r = 0; r < R; ++r) s[r] = moe_cpu::scaled_sum(sums[r], scale[m]);
  }
};

// Rounds each row of x to int16 (`moe_cpu::quantize_row`); false (nothing usable) if a row is not finite.
bool to_int16(const float* x, int64_t n, int64_t in, std::vector<int16_t>& q, std::vector<float>& scale) {
  q.resize(n * in);
  scale.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    if (!moe_cpu::quantize_row(x + r * in, in, q.data() + r * in, scale.data() + r)) return false;
  }
  return true;
}

struct Group {
  int64_t expert, first_row, n_rows;
};

// Work items are (group, weight row) pairs; each thread takes a contiguous range. It splits its rows of a weight
// into 4 runs of consecutive rows and takes one row of each at a time (`dot_rows`): 4 streams of weights, each read
// front to back, and every activation row of the group meets the 4 rows while they are in cache. The 4 streams'
// pointers move on by a row each step: forming them again from row indices every step (an array of indices, then
// a vector multiply of them) read the same bf16 weights at 0.83-0.92x this speed (a [104000, 512] weight, 2 threads
// of a 2-core AMD EPYC Zen 5, the two alternated in one process); the loop between two groups of 4 rows is short.
template <typename W, typename Rows, typename Out>
void products(const Rows& x, const W* w, const float* scale, const std::vector<Group>& groups, int64_t out_features,
              int64_t in_features, Out* y) {
  const int64_t work = out_features * static_cast<int64_t>(groups.size());
  at::parallel_for(0, work, 64, [&](int64_t begin, int64_t end) {
    moe_cpu::DenormalMode<std::is_same_v<W, c10::BFloat16>> mode;  // bf16 weights: as the bf16 instruction computes
    for (int64_t item = begin; item < end;) {
      const Group& g = groups[item / out_features];
      const int64_t first = item % out_features, n = std::min(end - item, out_features - first);
      const int64_t run_rows = (n + 3) / 4;  // runs of this many rows, the last ones shorter
      const int64_t whole = std::max<int64_t>(0, n - 3 * run_rows);  // the steps that find a row in every run
      const int64_t at = g.expert * out_features + first;  // the range's first row among all experts' rows
      const float* row_scale = scale != nullptr ? scale + at : nullptr;
      const W* wr[4];
      for (int r = 0; r < 4; ++r) wr[r] = w + (at + r * run_rows) * in_features;
      for (int64_t step = 0; step < whole; ++step) {
        for (int64_t m = g.first_row; m < g.first_row + g.n_rows; ++m) {
          float v[4];
          x.template dot<W, 4>(wr, m, v);
          Out* out = y + m * out_features + first + step;
          for (int r = 0; r < 4; ++r) {
            out[r * run_rows] = static_cast<Out>(row_scale != nullptr ? v[r] * row_scale[step + r * run_rows] : v[r]);
          }
        }
        for (int r = 0; r < 4; ++r) wr[r] += in_features;
      }
      for (int64_t step = whole; step < run_rows; ++step) {  // fewer than 4 runs still have a row: one at a time
        for (int64_t r = step; r < n; r += run_rows) {
          const W* one[1] = {w + (at + r) * in_features};
          for (int64_t m = g.first_row; m < g.first_row + g.n_rows; ++m) {
            float v;
            x.template dot<W, 1>(one, m, &v);
            y[m * out_features + first + r] = static_cast<Out>(row_scale != nullptr ? v * row_scale[r] : v);
          }
        }
      }
      item += n;
    }
  });
}

// The rows for bf16 weights: as they are, where they are bf16 and the build has the bf16 instruction, else their fp32
// values (`fp32_rows()`, widened only here) split into `split_pairs`' layout.
template <typename Widen>
PairRows pair_rows(const at::Tensor& x, const Widen& fp32_rows, int64_t n, int64_t in) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (x.scalar_type() == at::kBFloat16) return {nullptr, x.data_ptr<c10::BFloat16>(), in, g_ahead_bf16};
#endif
  const float* xf = fp32_rows();
  thread_local std::vector<float> split;
  split.resize(n * in);
  for (int64_t m = 0; m < n; ++m) moe_cpu::split_pairs(xf + m * in, in, split.data() + m * in);
  return {split.data(), nullptr, in, g_ahead_bf16};
}

}  // namespace

at::Tensor moe_cpu::grouped_matvec(const at::Tensor& x_in, const at::Tensor& w,
                                   const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& scale) {
  // One weight [out, in] takes rows [..., in] as they come (a decode step's [B, 1, D]): no reshape and view around
  // the call, each an op through the dispatcher.
  const bool one = w.dim() == 2 && !counts.has_value();
  TORCH_CHECK(((x_in.dim() == 2 && w.dim() == 3) || (one && x_in.dim() >= 2)) && x_in.size(-1) == w.size(-1),
              "grouped_matvec: x [N, in] and w [E, out, in] (or x [..., in] and w [out, in]), got ", x_in.sizes(),
              " and ", w.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "grouped_matvec: x fp32 or bf16");
  TORCH_CHECK(w.is_contiguous(), "grouped_matvec: w must be contiguous");
  const at::Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({-1, x_in.size(-1)});
  const int64_t n = x.size(0), experts = one ? 1 : w.size(0), out_features = w.size(-2), in_features = w.size(-1);
  std::vector<Group> groups;
  if (counts.has_value()) {
    TORCH_CHECK(counts->dim() == 1 && counts->size(0) == experts && counts->scalar_type() == at::kLong,
                "grouped_matvec: counts [E] int64");
    const at::Tensor c = counts->contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    int64_t first = 0;
    for (int64_t e = 0; e < experts; ++e) {
      TORCH_CHECK(cp[e] >= 0 && first + cp[e] <= n, "grouped_matvec: counts exceed the rows of x");
      if (cp[e] > 0) groups.push_back({e, first, cp[e]});
      first += cp[e];
    }
  } else {
    TORCH_CHECK(experts == 1, "grouped_matvec: counts are needed for more than one weight");
    if (n > 0) groups.push_back({0, 0, n});
  }
  const float* sp = nullptr;
  at::Tensor s;
  if (scale.has_value()) {
    s = (scale->scalar_type() == at::kFloat ? *scale : scale->to(at::kFloat)).contiguous();
    TORCH_CHECK(s.numel() == experts * out_features, "grouped_matvec: scale [E, out]");
    sp = s.data_ptr<float>();
  }
  // Per call, only what the products need: fp32 rows read in place, bf16 rows widened into this thread's buffer
  // where a product reads fp32 values (an aten conversion and a zeroed output cost 60-120 us a decode step of 33
  // calls), and zeros written only past the last group.
  const at::Tensor xc = x.contiguous();
  thread_local std::vector<float> widened;
  const auto fp32_rows = [&] { return moe_cpu::fp32_values(xc, widened); };
  const int64_t covered = groups.empty() ? 0 : groups.back().first_row + groups.back().n_rows;
  at::Tensor y = at::empty({n, out_features}, x.options());
  if (covered < n) y.narrow(0, covered, n - covered).zero_();
  auto dispatch_out = [&](auto* wp, const auto& rows) {
    if (x.scalar_type() == at::kFloat) {
      products(rows, wp, sp, groups, out_features, in_features, y.data_ptr<float>());
    } else {
      products(rows, wp, sp, groups, out_features, in_features, y.data_ptr<c10::BFloat16>());
    }
  };
  std::vector<int16_t> q;
  std::vector<float> q_scale;
  switch (w.scalar_type()) {
    case at::kFloat: dispatch_out(w.data_ptr<float>(), FloatRows{fp32_rows(), in_features, 0}); break;
    case at::kBFloat16: dispatch_out(w.data_ptr<c10::BFloat16>(), pair_rows(xc, fp32_rows, n, in_features)); break;
    case at::kChar: {
      const FloatRows rows{fp32_rows(), in_features, g_ahead_int8};
      if (to_int16(rows.x, n, in_features, q, q_scale)) {
        dispatch_out(w.data_ptr<int8_t>(), IntRows{q.data(), q_scale.data(), in_features, g_ahead_int8});
      } else {
        dispatch_out(w.data_ptr<int8_t>(), rows);
      }
      break;
    }
    default: TORCH_CHECK(false, "grouped_matvec: weights fp32, bf16 or int8, got ", w.scalar_type());
  }
  if (x_in.dim() == 2) return y;
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = out_features;
  return y.view(shape);
}

TORCH_LIBRARY(moe_cpu, m) {
  m.def("grouped_matvec(Tensor x, Tensor w, Tensor? counts, Tensor? scale) -> Tensor");
  m.def("set_prefetch(int bf16_bytes, int int8_bytes) -> ()", set_prefetch);  // no tensors: one kernel for all
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("grouped_matvec", moe_cpu::grouped_matvec); }
