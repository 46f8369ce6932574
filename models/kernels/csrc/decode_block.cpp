// A decode step's block in two ops, each calling in C++ the ops that eager Python calls one by one through modules,
// in the same order on the same tensors: the same bits. `add_attention`: the residual plus the attention of the
// normalised hidden states (the norm, the q/k/v product, `attend_one`, the output product, the add).
// `routed_experts`: the gate's product, the router's choice, the expert-load count, the grouping of copies by
// expert, the experts' two products with the SwiGLU between them and the weighted sum back per token; with the
// norm before it and the add after it, `add_routed_experts`. The ops between a block's products cost more in
// dispatch from Python than in work: a batch-1 step of `qwen3-moe` (bf16, 2-core AMD EPYC Zen 4) took 3.89 ms as
// 151 ops, 3.35 ms with the routed experts in one op (a step is 31 ops with both halves).

#include <ATen/Functions.h>
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

// h [..., D] + routed_experts(rms_norm(h)): a block's feed-forward half with its norm and residual.
at::Tensor add_routed_experts(const at::Tensor& h, const at::Tensor& norm, double eps, bool weight_in_fp32,
                              const at::Tensor& gate, const at::Tensor& w13, const std::optional<at::Tensor>& s13,
                              const at::Tensor& w2, const std::optional<at::Tensor>& s2, int64_t top_k, int64_t kind,
                              bool renormalise, bool round_bf16, std::optional<at::Tensor> load, int64_t row,
                              int64_t width) {
  const at::Tensor x = moe_cpu::rms_norm(h, norm, eps, weight_in_fp32).reshape({-1, h.size(-1)});
  const at::Tensor y = routed_experts(x, gate, w13, s13, w2, s2, top_k, kind, renormalise, round_bf16, load, row,
                                      width);
  return at::add(h, y.view(h.sizes()));
}

// h [B, 1, D] + the attention of rms_norm(h) at slot `start` (`attend_one`'s arguments, and the q/k/v and output
// weights with their int8 scales): a block's attention half with its norm and residual.
at::Tensor add_attention(const at::Tensor& h, const at::Tensor& norm, double eps, bool weight_in_fp32,
                         const at::Tensor& wqkv, const std::optional<at::Tensor>& sqkv, const at::Tensor& wo,
                         const std::optional<at::Tensor>& so, int64_t H, int64_t G,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                         double qk_eps, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, int64_t start, const std::optional<at::Tensor>& mask) {
  const at::Tensor qkv = moe_cpu::grouped_matvec(moe_cpu::rms_norm(h, norm, eps, weight_in_fp32), wqkv,
                                                 std::nullopt, sqkv);
  const at::Tensor out = moe_cpu::attend_one(qkv, H, G, q_norm, k_norm, qk_eps, cos, sin, k_cache, v_cache, start,
                                             mask);
  return at::add(h, moe_cpu::grouped_matvec(out, wo, std::nullopt, so));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_cpu, m) {
  m.def("routed_experts(Tensor x, Tensor gate, Tensor w13, Tensor? s13, Tensor w2, Tensor? s2, int top_k, int kind, "
        "bool renormalise, bool round_bf16, Tensor(a!)? load, int row, int width) -> Tensor");
  m.def("add_routed_experts(Tensor h, Tensor norm, float eps, bool weight_in_fp32, Tensor gate, Tensor w13, "
        "Tensor? s13, Tensor w2, Tensor? s2, int top_k, int kind, bool renormalise, bool round_bf16, "
        "Tensor(a!)? load, int row, int width) -> Tensor");
  m.def("add_attention(Tensor h, Tensor norm, float eps, bool weight_in_fp32, Tensor wqkv, Tensor? sqkv, Tensor wo, "
        "Tensor? so, int H, int G, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int start, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) {
  m.impl("routed_experts", routed_experts);
  m.impl("add_routed_experts", add_routed_experts);
  m.impl("add_attention", add_attention);
}
