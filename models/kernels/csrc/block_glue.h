// The ops that a decode step's attention chains in one call (block_glue.cpp: `attend_one`).

#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace moe_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_fp32);
at::Tensor rotary_into_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t start);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask);

}  // namespace moe_cpu
