// A decode step's routed experts in one op: the gate's product, the router's choice, the expert-load count, the
// grouping of copies by expert, the experts' two products with the SwiGLU between them, and the weighted sum back
// per token; eight ops that eager Python calls one by one through modules (`MoEFeedForward.forward`), here called in
// C++ in the same order on the same tensors: the same bits.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "block_glue.h"

namespace {

// x [T, D] -> [T, D]. gate [E, D]; w13 [E, 2F, D] (gate columns first) and w2 [E, D, F], int8 with their scales
// [E, 2F] and [E, D]; `kind`, `renormalise`, `round_bf16` as `route` takes them; `load`: the block's load table,
// whose row `row` counts the chosen experts (none where it is not given); `width`: `silu_mul`'s.
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w13,
                          const std::optional<at::Tensor>& s13, const at::Tensor& w2,
                          const std::optional<at::Tensor>& s2, int64_t top_k, int64_t kind, bool renormalise,
                          bool round_bf16, std::optional<at::Tensor> load, int64_t row, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && gate.dim() == 2 && w13.dim() == 3 && x.size(1) == gate.size(1) &&
                  gate.size(0) == w13.size(0),
              "routed_experts: x [T, D], gate [E, D], w13 [E, 2F, D], got ", x.sizes(), ", ", gate.sizes(), ", ",
              w13.sizes());
  const at::Tensor logits = moe_cpu::grouped_matvec(x, gate, std::nullopt, std::nullopt);
  const auto [weights, ids] = moe_cpu::route(logits, top_k, kind, renormalise, round_bf16);
  if (load.has_value()) moe_cpu::count_ids(*load, row, ids);
  const auto [rows, counts, token, weight] = moe_cpu::group_by_expert(x, weights, ids, gate.size(0));
  const at::Tensor h = moe_cpu::grouped_matvec(rows, w13, counts, s13);
  const at::Tensor y = moe_cpu::grouped_matvec(moe_cpu::silu_mul(h, width), w2, counts, s2);
  return moe_cpu::combine(y, weight, token, x.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("routed_experts(Tensor x, Tensor gate, Tensor w13, Tensor? s13, Tensor w2, Tensor? s2, int top_k, int kind, "
        "bool renormalise, bool round_bf16, Tensor(a!)? load, int row, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) { m.impl("routed_experts", routed_experts); }
