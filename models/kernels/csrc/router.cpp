// The router's choice from its gate logits in one op, where eager torch takes 3 ("mixtral": a cast, topk, softmax
// of the k) to 7 ("softmax": a cast, softmax, topk, a sum, a division, a round trip through the activations' dtype),
// mostly dispatch: from Python, a decode row of `small` (8 experts, top-2) took 5.0 us as the chain, 3.0 us here;
// of `qwen3-moe` (64, top-8) 12.6 us and 3.3 us (2-core AMD EPYC Zen 4). The same bits as that chain, as torch's CPU
// kernels compute it: the softmax through ATen's own vector functions (max, exp, sum, reciprocal, product), a few
// values summed in order, and topk's selection and sort of (value, index) pairs with its comparator, so that ties go
// to the same expert.

#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "block_glue.h"

namespace {

using Vec = at::vec::Vectorized<float>;
// torch sums 1-4 and 8 values in order (measured with its AVX2 and AVX-512 kernels), other counts in lanes: these
// counts of top-k weights are renormalised here (native.py: ROUTE_RENORMALISES).
bool renormalises(int64_t k) { return k <= 4 || k == 8; }

// out = softmax(x) over n values, as torch's CPU softmax over a contiguous last dimension computes it.
void softmax(const float* x, float* out, int64_t n) {
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
  at::vec::map([top](Vec v) { return (v - Vec(top)).exp(); }, out, x, n);
  float total = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, out, n);
  total = 1 / total;
  at::vec::map([total](Vec v) { return v * Vec(total); }, out, out, n);
}

// The k largest of n values, largest first, as torch.topk(sorted=True) picks them on CPU (NaN counts as largest).
void largest(const float* x, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& queue, float* values,
           int64_t* ids) {
  queue.resize(n);
  for (int64_t i = 0; i < n; ++i) queue[i] = {x[i], i};
  const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) {
    values[j] = queue[j].first;
    ids[j] = queue[j].second;
  }
}

}  // namespace

// Each token's (weights [T, K] fp32, expert ids [T, K]) from its gate logits [T, E]. `kind` 0: the softmax of the
// top-k logits (Mixtral); 1: the top-k of every expert's probability, divided by their sum where `renormalise`,
// rounded to bf16 and back where `round_bf16` (the activations' precision, as transformers keeps them).
std::tuple<at::Tensor, at::Tensor> moe_cpu::route(const at::Tensor& logits_in, int64_t top_k, int64_t kind,
                                                  bool renormalise, bool round_bf16) {
  TORCH_CHECK(logits_in.dim() == 2 && top_k >= 1 && top_k <= logits_in.size(1) && (kind == 0 || kind == 1),
              "route: logits [T, E], 1 <= top_k <= E, kind 0 or 1, got ", logits_in.sizes(), ", ", top_k, ", ", kind);
  TORCH_CHECK(!(kind == 1 && renormalise) || renormalises(top_k), "route: renormalises 1-4 or 8 weights, not ",
              top_k);
  const at::Tensor logits = logits_in.contiguous();
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "route: fp32 or bf16 logits");
  const int64_t T = logits.size(0), E = logits.size(1), K = top_k;
  at::Tensor weights = at::empty({T, K}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({T, K}, logits.options().dtype(at::kLong));
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* lp = logits.data_ptr();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    thread_local std::vector<std::pair<float, int64_t>> queue;
    thread_local std::vector<float> row, probs, top;
    row.resize(E);
    probs.resize(E);
    top.resize(K);
    for (int64_t t = begin; t < end; ++t) {
      const float* x = static_cast<const float*>(lp) + t * E;
      if (bf16) {  // widened exactly, as the chain's cast
        const c10::BFloat16* xb = static_cast<const c10::BFloat16*>(lp) + t * E;
        for (int64_t e = 0; e < E; ++e) row[e] = static_cast<float>(xb[e]);
        x = row.data();
      }
      float* w = wp + t * K;
      if (kind == 0) {
        largest(x, E, K, queue, top.data(), ip + t * K);
        softmax(top.data(), w, K);
        continue;
      }
      softmax(x, probs.data(), E);
      largest(probs.data(), E, K, queue, w, ip + t * K);
      if (renormalise) {
        float total = w[0];  // in order, as torch sums these counts
        for (int64_t j = 1; j < K; ++j) total += w[j];
        for (int64_t j = 0; j < K; ++j) w[j] = w[j] / total;
      }
      if (round_bf16) {
        for (int64_t j = 0; j < K; ++j) w[j] = static_cast<float>(c10::BFloat16(w[j]));
      }
    }
  });
  return {weights, ids};
}

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("route(Tensor logits, int top_k, int kind, bool renormalise, bool round_bf16) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("route", moe_cpu::route); }
