"""Families as data: what each model family changes against Mixtral, read from its own `config.json`.

`model_type` (else `architectures`) picks the family; each family turns its config's fields into the knobs of
`ModelConfig` (router kind, renormalisation, QK-norm kind, biases, norm kind, scalar multipliers, expert width).
A family, a `hidden_act` or a field that changes the math but that no knob covers yet is refused in one line,
never ignored. The references are transformers' modeling files of each family (`tests/test_families.py`).
"""

from __future__ import annotations

from typing import Any

from models.rope import parse_rope, yarn_mscale

# model_type -> the architectures names that say it, for configs without a model_type
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "granitemoe": "GraniteMoeForCausalLM", "phimoe": "PhimoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
LAYER_TYPES = ("sliding_attention", "full_attention")


class FamilyError(ValueError):
    """The config names a family, an activation or a field the project does not run; the message says which."""


def family_of(cfg: dict[str, Any]) -> str:
    """`model_type`, else (no model_type, or one of another name for a known architecture, as Kimi-K2's `kimi_k2` is
    DeepSeek-V3's) the first known name in `architectures`, else Mixtral."""
    kind = cfg.get("model_type")
    names = {v: k for k, v in ARCHITECTURES.items()}
    known = next((names[a] for a in cfg.get("architectures") or [] if a in names), None)
    if kind is None or (kind not in ARCHITECTURES and known is not None):
        kind = known or "mixtral"
    if kind not in ARCHITECTURES:
        raise FamilyError(f"config.json's model_type {kind!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return kind


def knobs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The family's `ModelConfig` fields beyond the Mixtral ones every family shares."""
    family = family_of(cfg)
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise FamilyError(f"config.json's hidden_act {act!r} is not supported (the experts run SwiGLU: silu)")
    if cfg.get("mlp_bias"):
        raise FamilyError("config.json's mlp_bias is not supported (the experts and MLPs have no biases here)")
    out: dict[str, Any] = {"family": family}
    if cfg.get("attention_bias"):
        out |= {"qkv_bias": True, "o_bias": True}
    if family in ("qwen3_moe", "olmoe", "qwen2_moe"):
        out |= _qwen_like(cfg, family)
    elif family == "granitemoe":
        out |= {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
                "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
                "logits_scaling": float(cfg.get("logits_scaling", 1.0))}
    elif family == "gpt_oss":
        out |= _gpt_oss(cfg)
    elif family in ("deepseek_v2", "deepseek_v3"):
        out |= _deepseek(cfg, family)
    elif family == "phimoe":
        out |= {"router": "sparsemixer", "router_jitter": float(cfg.get("router_jitter_noise", 0.01)),
                "norm": "layer", "head_bias": bool(cfg.get("lm_head_bias", False))}
        if cfg.get("num_experts_per_tok", 2) != 2:
            raise FamilyError("config.json's num_experts_per_tok must be 2 for PhiMoE's sparsemixer router")
    return out


def _qwen_like(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen3-MoE and OLMoE: softmax over every expert, top-k of the probabilities, renormalised if asked."""
    dense = tuple(i for i in range(cfg.get("num_hidden_layers", 0)) if _is_dense(cfg, i))
    out = {"router": "softmax", "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
           "qk_norm": "head" if family == "qwen3_moe" else "projection"}
    if dense and family != "olmoe":  # mlp_only_layers / decoder_sparse_step: dense MLPs of intermediate_size
        out |= {"dense_layers": dense, "dense_hidden_dim": cfg["intermediate_size"]}
    if family == "qwen2_moe":  # a shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate(x))
        out |= {"qk_norm": "", "qkv_bias": bool(cfg.get("qkv_bias", True)),
                "shared_hidden_dim": cfg.get("shared_expert_intermediate_size", 0) or None, "shared_gate": True}
    if family in ("qwen3_moe", "qwen2_moe"):
        out["hidden_dim"] = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
        if cfg.get("use_sliding_window") and cfg.get("max_window_layers", 0) < cfg.get("num_hidden_layers", 0):
            raise FamilyError("config.json slides the window over only some layers (max_window_layers), which this "
                              "version does not run")
    if cfg.get("clip_qkv") is not None:
        out["clip_qkv"] = float(cfg["clip_qkv"])
    return out


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: a biased router (softmax of the top-k logits), biased experts with the clamped gated unit, attention
    sinks, and blocks alternating a sliding window with full attention (`layer_types`)."""
    n = cfg.get("num_hidden_layers", 0)
    types = cfg.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n)]  # transformers' default
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise FamilyError(f"config.json's layer_types must list {n} of {', '.join(LAYER_TYPES)}, got {types!r}")
    return {"router_bias": True, "expert_bias": True, "sinks": True, "glu": "clamped", "norm": "rms_fp32",
            "glu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "glu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "qkv_bias": bool(cfg.get("attention_bias", True)), "o_bias": bool(cfg.get("attention_bias", True)),
            "full_layers": tuple(i for i, t in enumerate(types) if t == "full_attention")}


def _deepseek(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-head latent attention, grouped routing (V2 softmax, V3 sigmoid with a choosing bias)
    scaled by routed_scaling_factor, shared experts, dense first blocks, and multi-token-prediction blocks past the
    last one (skipped)."""
    if cfg.get("attention_bias"):
        raise FamilyError("config.json's attention_bias is not supported for multi-head latent attention")
    nope, rope = cfg.get("qk_nope_head_dim", 128), cfg.get("qk_rope_head_dim", 64)
    scaling = parse_rope(cfg)[1]  # yarn's mscale_all_dim enters the softmax scale, squared, as the reference has it
    scale = (nope + rope) ** -0.5 * (yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
                                     if scaling.kind != "default" and scaling.mscale_all_dim else 1.0)
    if family == "deepseek_v3":
        router = {"router": "deepseek_v3", "score_bias": True, "norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}
    elif (cfg.get("topk_method") or "greedy") == "greedy":
        router = {"router": "deepseek_v2"}
    elif cfg["topk_method"] == "group_limited_greedy":
        router = {"router": "deepseek_v2_grouped"}
    else:
        raise FamilyError(f"config.json's topk_method {cfg['topk_method']!r} is not supported; supported: greedy, "
                          "group_limited_greedy")
    first = cfg.get("first_k_dense_replace", 3 if family == "deepseek_v3" else 0) or 0
    shared = cfg.get("n_shared_experts") or 0
    moe_width = cfg.get("moe_intermediate_size", 1407)
    return router | {
        "kv_lora_rank": cfg.get("kv_lora_rank", 512), "q_lora_rank": cfg.get("q_lora_rank"), "qk_nope_dim": nope,
        "v_head_dim": cfg.get("v_head_dim", 128), "head_dim": rope, "n_kv_heads": cfg["num_attention_heads"],
        "rope_interleave": family == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
        "attention_scale": scale, "hidden_dim": moe_width, "shared_hidden_dim": moe_width * shared or None,
        "dense_layers": tuple(range(min(first, cfg.get("num_hidden_layers", 0)))),
        "dense_hidden_dim": cfg.get("intermediate_size"), "n_group": cfg.get("n_group") or 1,
        "topk_group": cfg.get("topk_group") or 1, "routed_scaling": float(cfg.get("routed_scaling_factor") or 1.0),
        "mtp_layers": cfg.get("num_nextn_predict_layers") or 0}


def _is_dense(cfg: dict[str, Any], layer: int) -> bool:
    step = cfg.get("decoder_sparse_step", 1) or 1
    return layer in (cfg.get("mlp_only_layers") or []) or (layer + 1) % step != 0


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window every layer slides (Qwen's configs carry one that applies only with `use_sliding_window`)."""
    if family_of(cfg) in ("qwen3_moe", "qwen2_moe") and not cfg.get("use_sliding_window", False):
        return None
    return cfg.get("sliding_window")


def experts_of(cfg: dict[str, Any]) -> tuple[int, int]:
    """(experts, experts per token), whatever the family calls them."""
    n = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 1
    return n, cfg.get("num_experts_per_tok", 1)


def hf_fields(cfg) -> dict[str, Any]:
    """What `ModelConfig.to_hf` writes beyond Mixtral's fields, so that a save loads in transformers as its family."""
    family = cfg.family
    if family == "mixtral":
        return {}
    out: dict[str, Any] = {"model_type": family, "architectures": [ARCHITECTURES[family]],
                           "attention_bias": cfg.qkv_bias}
    if family in ("qwen3_moe", "olmoe", "qwen2_moe"):
        out |= {"num_experts": cfg.n_experts, "norm_topk_prob": cfg.norm_topk_prob, "clip_qkv": cfg.clip_qkv,
                "use_sliding_window": cfg.sliding_window is not None, "decoder_sparse_step": 1, "mlp_only_layers": []}
        if family in ("qwen3_moe", "qwen2_moe"):
            out["moe_intermediate_size"] = cfg.hidden_dim
        if family == "qwen2_moe":
            out |= {"qkv_bias": cfg.qkv_bias, "shared_expert_intermediate_size": cfg.shared_hidden_dim or 0}
        if cfg.dense_layers:
            out |= {"mlp_only_layers": list(cfg.dense_layers), "intermediate_size": cfg.dense_hidden_dim}
    elif family == "granitemoe":
        out |= {"embedding_multiplier": cfg.embedding_multiplier, "residual_multiplier": cfg.residual_multiplier,
                "attention_multiplier": cfg.attention_scale, "logits_scaling": cfg.logits_scaling}
    elif family == "gpt_oss":
        out |= {"num_local_experts": cfg.n_experts, "swiglu_alpha": cfg.glu_alpha, "swiglu_limit": cfg.glu_limit,
                "layer_types": [LAYER_TYPES[i in cfg.full_layers] for i in range(cfg.n_layers)]}
    elif family in ("deepseek_v2", "deepseek_v3"):
        out |= _deepseek_fields(cfg)
    elif family == "phimoe":
        out |= {"router_jitter_noise": cfg.router_jitter, "lm_head_bias": cfg.head_bias}
    return out


def _deepseek_fields(cfg) -> dict[str, Any]:
    out = {"n_routed_experts": cfg.n_experts, "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
           "qk_nope_head_dim": cfg.qk_nope_dim, "qk_rope_head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim,
           "moe_intermediate_size": cfg.hidden_dim, "n_shared_experts": (cfg.shared_hidden_dim or 0) // cfg.hidden_dim,
           "first_k_dense_replace": len(cfg.dense_layers), "intermediate_size": cfg.dense_hidden_dim or cfg.hidden_dim,
           "n_group": cfg.n_group, "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling,
           "norm_topk_prob": cfg.norm_topk_prob, "num_nextn_predict_layers": cfg.mtp_layers, "attention_bias": False}
    if cfg.family == "deepseek_v2":
        return out | {"topk_method": "group_limited_greedy" if cfg.router == "deepseek_v2_grouped" else "greedy"}
    return out | {"rope_interleave": cfg.rope_interleave}
