// Grouped int8 products for prompts: the same contract and the same bits as grouped_matvec's int8 path
// (models/matvec.cpp), at a matrix product's arithmetic rate.
//
// y[n] = scale[e] * (w[e] @ x[n]) for the rows n of group e (counts[e] of them, in order; rows past the last group
// are zeros). Each activation row is rounded to int16 (models/int8_rows.h) and every dot product is summed exactly
// in integers, so a row's result is the one the decode kernel gives it, whatever the batch or blocking: a prompt
// and the decode steps after it compute with the same numbers. A call whose rows hold a NaN or an infinity
// computes in fp32 instead, so they propagate.
//
// Layout: rows are taken 16 at a time, as pairs of int16 interleaved so that one 32-bit lane holds a row's two
// values of a pair of columns; weight rows are widened to int16, 48 at a time, and a 16 x 6 block of outputs is
// 12 vectors of int32 (vpmaddwd: 16 products per instruction, twice fp32 FMA's). Lanes hold at most 256
// pair-sums of at most 2 * 127 * 32767 each (< 2^31), then are added into int64 totals; those 256 pairs of 16
// rows (16 KB) stay in L1 while the 48 weight rows pass. 2 threads on the AVX2 EPYC: 200-230 GFLOP/s for 64-512
// rows against in = 512 .. 14336, where oneDNN on the weights widened to fp32 gives 95-141.
//
// Built with models/matvec.cpp into one extension (models/matvec.py).

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "int8_rows.h"

namespace {

constexpr int64_t ROWS = 16;   // activation rows per block: two vectors of 8 lanes
constexpr int64_t COLS = 6;    // weight rows per microkernel call: 12 accumulators
constexpr int64_t PANEL = 48;  // weight rows widened to int16 at a time
constexpr int64_t PAIRS = 256;  // pairs of columns summed in int32 lanes before widening to int64

// tot[c * 16 + r] += sum over pairs j in [j0, j1) of A[j][r] . B[c][2j, 2j+1], for c < COLS, r < ROWS.
// A: one block of rows, [pairs][16] int32 (two int16 each); B: COLS widened weight rows of `stride` int16.
void micro(const int32_t* A, const int16_t* B, int64_t stride, int64_t j0, int64_t j1, int64_t* tot) {
#ifdef MOE_MATVEC_AVX2
  // Twelve named accumulators: with an array GCC kept them in memory, at a third of the speed.
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
  alignas(32) int32_t lanes[8];
  for (int64_t v = 0; v < 2 * COLS; ++v) {  // vector v: weight row v / 2, activation rows 8 (v % 2) .. + 7
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[v]);
    for (int64_t r = 0; r < 8; ++r) tot[v * 8 + r] += lanes[r];
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

struct Group {
  int64_t expert, first_row, n_rows, first_block;  // first_block: the group's first block of 16 rows in A
};

// x's rows, rounded to int16 and laid out in blocks of 16 per group (zeros past a group's last row); false if a
// row is not finite.
bool pack_rows(const float* x, int64_t in, const std::vector<Group>& groups, int64_t blocks, int64_t pairs,
               std::vector<int32_t>& A, std::vector<float>& x_scale) {
  A.assign(blocks * pairs * ROWS, 0);
  x_scale.assign(groups.empty() ? 0 : groups.back().first_row + groups.back().n_rows, 0.f);
  std::vector<char> finite(blocks, 1);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int16_t> row(2 * pairs, 0);
    for (int64_t b = b0; b < b1; ++b) {
      const Group* g = &groups[0];
      while (b >= g->first_block + (g->n_rows + ROWS - 1) / ROWS) ++g;
      for (int64_t r = 0; r < ROWS; ++r) {
        const int64_t m = g->first_row + (b - g->first_block) * ROWS + r;
        if (m >= g->first_row + g->n_rows) break;
        if (!moe_cpu::quantize_row(x + m * in, in, row.data(), &x_scale[m])) finite[b] = 0;
        const int32_t* pair = reinterpret_cast<const int32_t*>(row.data());
        for (int64_t j = 0; j < pairs; ++j) A[(b * pairs + j) * ROWS + r] = pair[j];
      }
    }
  });
  return std::find(finite.begin(), finite.end(), 0) == finite.end();
}
}  // namespace

namespace {

struct Item {
  int64_t group, col0, block;  // 16 rows of `group` from block `block` against weight rows col0 .. col0 + 47
};

// The exact integer products, in items of equal cost (a panel of weight rows against a block of rows; a thread
// widens a panel once for its consecutive items on it).
template <typename Out>
void run(const std::vector<int32_t>& A, const std::vector<float>& x_scale, const int8_t* w, const float* scale,
         const std::vector<Group>& groups, int64_t out, int64_t in, int64_t pairs, Out* y) {
  std::vector<Item> items;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g) {
    for (int64_t c = 0; c < out; c += PANEL) {
      for (int64_t b = 0; b < (groups[g].n_rows + ROWS - 1) / ROWS; ++b) items.push_back({g, c, b});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<int16_t> panel(PANEL * 2 * pairs, 0);  // rows past the weight's last are zeros
    std::vector<int64_t> tot(PANEL * ROWS);
    int64_t widened_group = -1, widened_col = -1;
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const Group& g = groups[it.group];
      const int64_t cols = std::min(PANEL, out - it.col0);
      if (it.group != widened_group || it.col0 != widened_col) {
        for (int64_t c = 0; c < cols; ++c) {  // rows past `cols` keep an earlier panel's: their sums are not stored
          int16_t* dst = panel.data() + c * 2 * pairs;
          const int8_t* src = w + (g.expert * out + it.col0 + c) * in;
          for (int64_t k = 0; k < in; ++k) dst[k] = src[k];  // vectorized by the compiler
        }
        widened_group = it.group, widened_col = it.col0;
      }
      const int32_t* block = A.data() + (g.first_block + it.block) * pairs * ROWS;
      const int64_t rows = std::min(ROWS, g.n_rows - it.block * ROWS);
      std::fill(tot.begin(), tot.end(), 0);
      for (int64_t j = 0; j < pairs; j += PAIRS) {  // a chunk of the rows' pairs (16 KB) stays in L1 for the panel
        for (int64_t c0 = 0; c0 < cols; c0 += COLS) {
          micro(block, panel.data() + c0 * 2 * pairs, 2 * pairs, j, std::min(pairs, j + PAIRS),
                tot.data() + c0 * ROWS);
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t col = it.col0 + c;
        for (int64_t r = 0; r < rows; ++r) {  // as the decode kernel: (sum * x scale) in double, then w scale
          const int64_t m = g.first_row + it.block * ROWS + r;
          const float v = static_cast<float>(static_cast<double>(tot[c * ROWS + r]) * x_scale[m]);
          y[m * out + col] = static_cast<Out>(v * scale[g.expert * out + col]);
        }
      }
    }
  });
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& counts,
                     const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2) && w.scalar_type() == at::kChar,
              "int8_gemm: x [N, in] and int8 w [E, out, in], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8_gemm: x fp32 or bf16");
  TORCH_CHECK(w.is_contiguous() && scale.numel() == w.size(0) * w.size(1), "int8_gemm: contiguous w, scale [E, out]");
  const int64_t n = x.size(0), experts = w.size(0), out = w.size(1), in = w.size(2), pairs = (in + 1) / 2;
  std::vector<Group> groups;
  int64_t first = 0, blocks = 0;
  const at::Tensor c = counts.has_value() ? counts->contiguous() : at::full({1}, n, at::kLong);
  TORCH_CHECK(c.dim() == 1 && c.size(0) == experts && c.scalar_type() == at::kLong, "int8_gemm: counts [E] int64");
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = c.data_ptr<int64_t>()[e];
    TORCH_CHECK(rows >= 0 && first + rows <= n, "int8_gemm: counts exceed the rows of x");
    if (rows > 0) groups.push_back({e, first, rows, blocks});
    first += rows, blocks += (rows + ROWS - 1) / ROWS;
  }
  at::Tensor y = at::zeros({n, out}, x.options());
  if (groups.empty()) return y;
  const at::Tensor xf = x.to(at::kFloat).contiguous(), sf = scale.to(at::kFloat).contiguous();
  std::vector<int32_t> A;
  std::vector<float> x_scale;
  if (!pack_rows(xf.data_ptr<float>(), in, groups, blocks, pairs, A, x_scale)) {  // NaN or inf: fp32 products
    for (const Group& g : groups) {
      const at::Tensor part = at::matmul(xf.narrow(0, g.first_row, g.n_rows), w[g.expert].to(at::kFloat).t());
      y.narrow(0, g.first_row, g.n_rows).copy_(part.mul(sf.view({experts, out})[g.expert]));
    }
    return y;
  }
  if (x.scalar_type() == at::kFloat) {
    run(A, x_scale, w.data_ptr<int8_t>(), sf.data_ptr<float>(), groups, out, in, pairs, y.data_ptr<float>());
  } else {
    run(A, x_scale, w.data_ptr<int8_t>(), sf.data_ptr<float>(), groups, out, in, pairs,
        y.data_ptr<c10::BFloat16>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("int8_gemm(Tensor x, Tensor w, Tensor? counts, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("int8_gemm", int8_gemm); }
