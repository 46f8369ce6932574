// Grouped products for prompts (many rows per weight): y[n] = scale[e] * (w[e] @ x[n]) for the rows n of group e
// (counts[e] of them, in order; rows past the last group are zeros), the contract of grouped_matvec
// (models/kernels/csrc/matvec.cpp), at a matrix product's arithmetic rate.
//
// int8 weights: each activation row is rounded to int16 (models/kernels/csrc/int8_rows.h) and every dot product is summed
// exactly in integers, so a row's result is the bits the decode kernel gives it, whatever the batch or blocking:
// a prompt and the decode steps after it compute with the same numbers. Lanes hold at most 256 pair-sums of at
// most 2 * 127 * 32767 each (< 2^31), then are added into int64 totals. A call whose rows hold a NaN or an
// infinity computes in fp32 instead, so they propagate.
// fp32 and bf16 weights: fp32 products and sums in the decode kernel's order (fp32: models/kernels/csrc/row_dot.h:
// `dot_rows`; bf16: the pair order, pair_dot.h), so here too a row's result is the decode kernel's bits, whatever the
// batch: each output's chains (fp32: 8, one per column modulo 8; bf16: 16, one per pair of columns modulo 16) are
// summed one at a time, each over its columns stored side by side in the order it takes them (gemm_layout.h:
// `chain_major`), then added in the decode kernel's order; bf16 with denormals flushed, as the decode kernel's bf16
// instruction computes. Against one chain per output (the order before), 0-10% slower.
//
// Layout: rows are taken 16 at a time (read in their own dtype, bf16 or fp32) and transposed so that one vector
// lane holds one row (int8: a 32-bit lane holds a row's two int16 values of a pair of columns), weight rows are
// widened (int16 or fp32), 48 at a time, each 6 (AVX-512: 12) interleaved into one stream, and a 16 x 6 (16 x 12)
// block of outputs is 12 vector accumulators (models/kernels/csrc/gemm_micro.h); 256 steps of the depth of 16 rows
// (int8: 16 KB) stay in L1 while the 48 weight rows pass (fp32: up to 2048 columns, 256 of each chain, at a time,
// for longer runs of the inner loop). Work items of equal cost (a panel of weight rows against a block of rows; a
// thread widens a panel once for its consecutive items on it). A finished 16 x 48 block goes to its rows through
// 8 x 8 transposes (models/kernels/csrc/gemm_layout.h): written one value at a time, the finish took a sixth of the
// time at depth 512.
//
// 2 threads on the AVX2 EPYC (3.2 GHz), 64-512 rows against in = 512 .. 14336: int8 238-263 GFLOP/s (the inner
// loop alone, in cache: 1.5 vpmaddwd a cycle, ~300), where oneDNN on the weights widened to fp32 gives 95-141;
// bf16 148-176 against oneDNN's 132-165 (the widened weights never leave the cache); fp32 145-175 against
// 142-172. Summed in the decode kernel's order (64-512 rows, in = 512 .. 14336, the same day as the order before):
// bf16 144-170 where the order before gave 157-177, fp32 121-167 where it gave 132-174.
// On an AVX-512 EPYC with VNNI (2 threads, the small model's shapes: 128-512 rows, in = 512 and 1792; oneDNN's fp32
// peak there 487 GFLOP/s): the AVX-512 inner loops give int8 595-681 GFLOP/s where AVX2's gave 373-394, fp32 and
// bf16 325-385 where they gave 203-249. On an Intel Xeon (AVX-512, 1 thread) the interleaved panel took fp32 from 84
// to 99 GFLOP/s at 512 rows, bf16 from 77 to 94 (docs/kernels.md).

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemm_layout.h"
#include "gemm_micro.h"

namespace {

using moe_cpu::COLS;
using moe_cpu::ROWS;
constexpr int64_t PANEL = 48;  // weight rows widened at a time
constexpr int64_t DEPTH = 256;  // depth steps per pass over a panel (int8: pairs, within int32's range)
constexpr int64_t FLOAT_DEPTH = 2048;  // fp32 columns per pass: 256 of each chain, 16 KB of a block's rows

struct GemmGroup {
  int64_t expert, first_row, n_rows, first_block;  // first_block: the group's first block of 16 rows
};

// int8 weights: lanes are int16 pairs, totals exact int64, finished with the row's and the weight row's scales
// as the decode kernel does (`moe_cpu::scaled_sum`, then the weight's scale in fp32).
struct Int8Kind {
  using Lane = int32_t;
  using Wide = int16_t;
  using Total = int64_t;
  static constexpr int64_t kPlanes = 1;  // one exact total per output, added into
  static constexpr bool kFlush = false;
  static constexpr int64_t kDepth = DEPTH;
  const int8_t* w;
  const float* scale;
  int64_t out, in, depth;  // depth: pairs of columns
  std::vector<float> x_scale;

  int64_t stride() const { return 2 * depth; }
  int64_t body() const { return depth; }  // depth steps the micro kernel takes: all
  int64_t chained() const { return 0; }  // pairs stay in order (gemm_layout.h: `chain_major`)
  template <typename X>
  bool row(const X* x, int64_t m, Wide* tmp, const Lane** lanes) {
    *lanes = reinterpret_cast<const Lane*>(tmp);
    return moe_cpu::quantize_row(x, in, tmp, &x_scale[m]);  // tmp's last value stays 0 when `in` is odd
  }
  const int8_t* rows(int64_t e, int64_t col) const { return w + (e * out + col) * in; }  // as stored
  int64_t row_bytes() const { return in; }
  // Weight rows col .. col + n - 1 (n <= COLS) widened into a group of the panel, interleaved (gemm_layout.h).
  void widen(Wide* dst, int64_t e, int64_t col, int64_t n) const {
    moe_cpu::widen_pairs_interleaved(rows(e, col), in, n, reinterpret_cast<int32_t*>(dst));
  }
  void micro(const Lane* A, const Wide* B, int64_t d0, int64_t d1, int64_t, Total* tot) const {
    moe_cpu::micro_int8(A, reinterpret_cast<const int32_t*>(B), d0, d1, tot);
  }
  // The finished outputs, in `fin`: fin[c * 16 + r] for row m0 + r and weight row col0 + c, c < cols, every r
  // (x_scale has 16 values past the last row): scaled_sum, then the weight row's scale in fp32, as the decode
  // kernel finishes.
  const float* finish(const Total* tot, int64_t m0, int64_t e, int64_t col0, int64_t cols, float* fin, const Lane*,
                      const Wide*) const {
    for (int64_t c = 0; c < cols; ++c) {
      const float w_scale = scale[e * out + col0 + c];
      int64_t r = 0;
#ifdef MOE_MATVEC_AVX2
      for (; r < ROWS; r += 4) {
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tot + c * ROWS + r));
        const __m128 v = moe_cpu::scaled_sum4(sums, _mm_loadu_ps(x_scale.data() + m0 + r));
        _mm_storeu_ps(fin + c * ROWS + r, _mm_mul_ps(v, _mm_set1_ps(w_scale)));
      }
#endif
      for (; r < ROWS; ++r) fin[c * ROWS + r] = moe_cpu::scaled_sum(tot[c * ROWS + r], x_scale[m0 + r]) * w_scale;
    }
    return fin;
  }
};

template <typename W>
struct FloatKind {
  using Lane = float;
  using Wide = float;
  using Total = float;
  static constexpr bool kPairs = std::is_same_v<W, c10::BFloat16>;  // bf16 weights: the pair order (pair_dot.h)
  static constexpr bool kFlush = kPairs;  // ... with denormals flushed
  static constexpr int64_t kPlanes = kPairs ? moe_cpu::kPairChains : 8;  // the chains of each output
  static constexpr int64_t kDepth = FLOAT_DEPTH;
  const W* w;
  int64_t out, in, depth;  // depth = in

  int64_t stride() const { return depth; }
  // the columns the chains take; the rest follow one by one
  int64_t body() const { return kPairs ? moe_cpu::pair_body(in) : in & ~int64_t{7}; }
  int64_t chained() const { return body(); }  // a block of rows stores them chain by chain (gemm_layout.h)
  bool row(const float* x, int64_t, Wide*, const Lane** lanes) const {
    *lanes = x;  // fp32 rows as they are
    return true;
  }
  bool row(const c10::BFloat16* x, int64_t, Wide* tmp, const Lane** lanes) const {
    for (int64_t k = 0; k < in; ++k) tmp[k] = static_cast<float>(x[k]);  // vectorized by the compiler
    *lanes = tmp;
    return true;
  }
  const W* rows(int64_t e, int64_t col) const { return w + (e * out + col) * in; }  // as stored
  int64_t row_bytes() const { return in * static_cast<int64_t>(sizeof(W)); }
  // Weight rows col .. col + n - 1 (n <= COLS) widened into a group of the panel, interleaved (gemm_layout.h).
  void widen(Wide* dst, int64_t e, int64_t col, int64_t n) const {
    moe_cpu::widen_interleaved<kPlanes>(rows(e, col), in, chained(), n, dst);
  }
  void micro(const Lane* A, const Wide* B, int64_t d0, int64_t d1, int64_t chain, Total* tot) const {
    moe_cpu::micro_float<kPlanes>(A, B, d0, d1, chained(), chain, tot);
  }
  template <typename V>
  static V added(const V* chains) {
    if constexpr (kPairs) {
      return moe_cpu::pair_chains_added(chains);
    } else {
      return moe_cpu::chains_added(chains);
    }
  }
  // Each output as the decode kernel finishes it: its chains added in their order (fp32 weights: `dot_rows`'; bf16:
  // the pair order's), then the columns past the last chained one by one multiply-add each (A: the block of rows,
  // B: the panel, interleaved).
  const float* finish(const Total* tot, int64_t, int64_t, int64_t, int64_t cols, float* fin, const Lane* A,
                      const Wide* B) const {
    const int64_t plane = PANEL * ROWS, chained = body();
    for (int64_t c = 0; c < cols; ++c) {
      const float* t = tot + c * ROWS;
      const Wide* b = moe_cpu::panel_column(B, c, stride());
      int64_t r = 0;
#ifdef MOE_MATVEC_AVX2
      for (; r < ROWS; r += 8) {
        __m256 s = _mm256_setzero_ps();
        if (chained > 0) {
          __m256 chains[kPlanes];
          for (int64_t j = 0; j < kPlanes; ++j) chains[j] = _mm256_loadu_ps(t + j * plane + r);
          s = added(chains);
        }
        for (int64_t k = chained; k < in; ++k) {
          s = _mm256_fmadd_ps(_mm256_loadu_ps(A + k * ROWS + r), _mm256_set1_ps(b[k * COLS]), s);
        }
        _mm256_storeu_ps(fin + c * ROWS + r, s);
      }
#endif
      for (; r < ROWS; ++r) {
        float chains[kPlanes];
        for (int64_t j = 0; j < kPlanes; ++j) chains[j] = t[j * plane + r];
        float s = chained > 0 ? added(chains) : 0.f;
        for (int64_t k = chained; k < in; ++k) s = moe_cpu::madd(A[k * ROWS + r], b[k * COLS], s);
        fin[c * ROWS + r] = s;
      }
    }
    return fin;
  }
};

// x's rows in blocks of 16 per group, transposed (zeros past a group's last row); false if the kind refused a row.
template <typename K, typename X>
bool pack(K& kind, const X* x, const std::vector<GemmGroup>& groups, int64_t blocks,
          std::vector<typename K::Lane>& A) {
  A.resize(blocks * kind.depth * ROWS);  // every value is written below
  std::vector<char> usable(blocks, 1);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<typename K::Wide> tmp(ROWS * kind.stride(), 0);
    const std::vector<typename K::Lane> zeros(kind.depth, 0);
    for (int64_t b = b0; b < b1; ++b) {
      const GemmGroup* g = &groups[0];
      while (b >= g->first_block + (g->n_rows + ROWS - 1) / ROWS) ++g;
      const typename K::Lane* rows[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) {
        const int64_t m = g->first_row + (b - g->first_block) * ROWS + r;
        rows[r] = zeros.data();
        if (m < g->first_row + g->n_rows && !kind.row(x + m * kind.in, m, &tmp[r * kind.stride()], &rows[r])) {
          usable[b] = 0;
        }
      }
      moe_cpu::transpose_rows<K::kPlanes>(rows, kind.depth, kind.chained(), A.data() + b * kind.depth * ROWS);
    }
  });
  return std::find(usable.begin(), usable.end(), 0) == usable.end();
}

struct GemmItem {
  int64_t group, col0, block;  // rows of `group` in its block `block` against weight rows col0 .. col0 + 47
};

// The next panel's weight rows, asked for (into L2) a few cache lines before each inner call while this panel's
// items compute: else the widening waits on memory while the multiply-add units idle (an eighth of an expert
// product at 128 rows an expert, by perf).
struct Ahead {
  const char *next = nullptr, *end = nullptr;
  int64_t lines = 0;  // per inner call
  void start(const void* rows, int64_t bytes, int64_t calls) {
    calls = std::max<int64_t>(calls, 1);  // none where the depth has no chained columns (fp32, in < 8)
    next = static_cast<const char*>(rows), end = next + bytes, lines = (bytes / 64 + calls) / calls;
  }
  void some() {
    for (int64_t l = 0; l < lines && next < end; ++l, next += 64) __builtin_prefetch(next, 0, 2);
  }
};

template <typename K, typename Out>
void gemm_items(const K& kind, const std::vector<typename K::Lane>& A, const std::vector<GemmGroup>& groups, Out* y) {
  std::vector<GemmItem> items;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    for (int64_t c = 0; c < kind.out; c += PANEL) {
      for (int64_t b = 0; b < (groups[g].n_rows + ROWS - 1) / ROWS; ++b) items.push_back({g, c, b});
    }
  }
  const int64_t stride = kind.stride();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    moe_cpu::DenormalMode<K::kFlush> mode;  // for the whole of this thread's share
    std::vector<typename K::Wide> panel(PANEL * stride, 0);  // rows past a short panel's: unused, never stored
    std::vector<typename K::Total> tot(K::kPlanes * PANEL * ROWS);
    std::vector<float> fin(PANEL * ROWS);
    int64_t widened_group = -1, widened_col = -1;
    Ahead ahead;
    for (int64_t i = i0; i < i1; ++i) {
      const GemmItem& it = items[i];
      const GemmGroup& g = groups[it.group];
      const int64_t cols = std::min(PANEL, kind.out - it.col0);
      if (it.group != widened_group || it.col0 != widened_col) {
        for (int64_t c0 = 0; c0 < cols; c0 += COLS) {
          kind.widen(panel.data() + c0 * stride, g.expert, it.col0 + c0, std::min(COLS, cols - c0));
        }
        widened_group = it.group, widened_col = it.col0;
        int64_t j = i + 1;  // this thread's next item on another panel
        while (j < i1 && items[j].group == it.group && items[j].col0 == it.col0) ++j;
        if (j < i1) {
          const GemmItem& nx = items[j];
          const int64_t calls = (j - i) * ((kind.body() + K::kDepth - 1) / K::kDepth) * K::kPlanes * (PANEL / COLS);
          const int64_t bytes = std::min(PANEL, kind.out - nx.col0) * kind.row_bytes();
          ahead.start(kind.rows(groups[nx.group].expert, nx.col0), bytes, calls);
        }
      }
      const typename K::Lane* block = A.data() + (g.first_block + it.block) * kind.depth * ROWS;
      if (K::kPlanes == 1) std::fill(tot.begin(), tot.end(), 0);  // int8 adds into its totals; fp32 chains start
      const int64_t body = kind.body();
      for (int64_t d = 0; d < body; d += K::kDepth) {
        for (int64_t j = 0; j < K::kPlanes; ++j) {  // fp32: chain by chain, each over the panel's columns
          for (int64_t c0 = 0; c0 < cols; c0 += COLS) {
            ahead.some();
            kind.micro(block, panel.data() + c0 * stride, d, std::min(body, d + K::kDepth), j,
                       tot.data() + j * PANEL * ROWS + c0 * ROWS);
          }
        }
      }
      const int64_t rows = std::min(ROWS, g.n_rows - it.block * ROWS), m0 = g.first_row + it.block * ROWS;
      const float* done = kind.finish(tot.data(), m0, g.expert, it.col0, cols, fin.data(), block, panel.data());
      moe_cpu::store_block(done, rows, cols, kind.out, y + m0 * kind.out + it.col0);
    }
  });
}

template <typename K>
bool compute(K& kind, const at::Tensor& x, const std::vector<GemmGroup>& groups, int64_t blocks, at::Tensor& y) {
  std::vector<typename K::Lane> A;
  const bool packed = x.scalar_type() == at::kFloat ? pack(kind, x.data_ptr<float>(), groups, blocks, A)
                                                    : pack(kind, x.data_ptr<c10::BFloat16>(), groups, blocks, A);
  if (!packed) return false;
  if (y.scalar_type() == at::kFloat) {
    gemm_items(kind, A, groups, y.data_ptr<float>());
  } else {
    gemm_items(kind, A, groups, y.data_ptr<c10::BFloat16>());
  }
  return true;
}

at::Tensor grouped_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& counts,
                        const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2) && w.is_contiguous(),
              "grouped_gemm: x [N, in] and contiguous w [E, out, in], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "grouped_gemm: x fp32 or bf16");
  const bool int8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (scale.has_value() && scale->numel() == w.size(0) * w.size(1)),
              "grouped_gemm: int8 weights need a scale [E, out], and only they take one");
  const int64_t n = x.size(0), experts = w.size(0), out = w.size(1), in = w.size(2);
  const at::Tensor c = counts.has_value() ? counts->contiguous() : at::full({1}, n, at::kLong);
  TORCH_CHECK(c.dim() == 1 && c.size(0) == experts && c.scalar_type() == at::kLong, "grouped_gemm: counts [E] int64");
  std::vector<GemmGroup> groups;
  int64_t first = 0, blocks = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = c.data_ptr<int64_t>()[e];
    TORCH_CHECK(rows >= 0 && first + rows <= n, "grouped_gemm: counts exceed the rows of x");
    if (rows > 0) groups.push_back({e, first, rows, blocks});
    first += rows, blocks += (rows + ROWS - 1) / ROWS;
  }
  at::Tensor y = at::empty({n, out}, x.options());
  y.narrow(0, first, n - first).zero_();  // rows past the last group; every row of a group is written below
  if (groups.empty()) return y;
  const at::Tensor xc = x.contiguous();  // rows are read in their own dtype, widened or rounded on the way in
  if (w.scalar_type() == at::kFloat) {
    FloatKind<float> kind{w.data_ptr<float>(), out, in, in};
    compute(kind, xc, groups, blocks, y);
    return y;
  }
  if (w.scalar_type() == at::kBFloat16) {
    FloatKind<c10::BFloat16> kind{w.data_ptr<c10::BFloat16>(), out, in, in};
    compute(kind, xc, groups, blocks, y);
    return y;
  }
  TORCH_CHECK(int8, "grouped_gemm: weights fp32, bf16 or int8, got ", w.scalar_type());
  TORCH_CHECK(in <= (int64_t{1} << 28), "grouped_gemm: int8 rows of at most 2^28 values, got ", in);
  const at::Tensor sf = scale->to(at::kFloat).contiguous();
  Int8Kind kind{w.data_ptr<int8_t>(), sf.data_ptr<float>(), out, in, (in + 1) / 2,
                std::vector<float>(n + ROWS, 0.f)};  // 16 past the last row: `finish` reads a whole block
  if (!compute(kind, xc, groups, blocks, y)) {  // a NaN or an infinity: fp32 products, which propagate them
    const at::Tensor xf = xc.to(at::kFloat);
    for (const GemmGroup& g : groups) {
      const at::Tensor part = at::matmul(xf.narrow(0, g.first_row, g.n_rows), w[g.expert].to(at::kFloat).t());
      y.narrow(0, g.first_row, g.n_rows).copy_(part.mul(sf.view({experts, out})[g.expert]));
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("grouped_gemm(Tensor x, Tensor w, Tensor? counts, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("grouped_gemm", grouped_gemm); }
