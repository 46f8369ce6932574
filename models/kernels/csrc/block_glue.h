// A block's ops that other ops chain in one call (`attend_one`; decode_block.cpp): block_glue.cpp, matvec.cpp,
// router.cpp, decode_attention.cpp.

#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace moe_cpu {

at::Tensor grouped_matvec(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& counts,
                          const std::optional<at::Tensor>& scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_fp32);
at::Tensor rotary_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask);
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k, int64_t kind, bool renormalise,
                                         bool round_bf16);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_by_expert(const at::Tensor& x,
                                                                            const at::Tensor& weights,
                                                                            const at::Tensor& ids, int64_t n_experts);
at::Tensor combine(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& token, int64_t T);
at::Tensor silu_mul(const at::Tensor& h, int64_t width);
void count_ids(at::Tensor table, int64_t row, const at::Tensor& ids);
at::Tensor attend_one(const at::Tensor& qkv, int64_t H, int64_t G, const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                      const std::optional<at::Tensor>& mask);

}  // namespace moe_cpu
