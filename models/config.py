"""Model configuration: one small dataclass, read from Hugging Face `config.json` or Mistral `params.json`.

Holds architecture only; where the parts run (ranks, placement) lives in `moe.parallel.placement`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from models import families
from models.rope import RopeError, RopeScaling, context_length, parse_rope


class ConfigError(ValueError):
    """A configuration field is missing or inconsistent; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # expert (SwiGLU) inner size
    vocab_size: int
    n_experts: int = 1
    top_k: int = 1
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = None
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    bos_id: int | None = 1
    eos_id: int | None = 2
    eos_ids: tuple[int, ...] = ()  # every end-of-sequence id config.json lists (eos_id is the first)
    rope_scaling: RopeScaling = RopeScaling()  # models.rope: how positions become angles past the default
    max_position_embeddings: int | None = None  # the config's own figure where it differs from max_seq_len (dynamic)
    # What a family changes against Mixtral (models.families reads them from its config.json)
    family: str = "mixtral"
    router: str = "mixtral"  # "mixtral": softmax of the top-k logits; "softmax": top-k of every expert's probability
    # (renormalised if norm_topk_prob); "sparsemixer": PhiMoE's top-2; "deepseek_v2", "deepseek_v2_grouped",
    # "deepseek_v3": `models.router`
    norm_topk_prob: bool = True
    router_jitter: float = 0.0  # sparsemixer's threshold
    qk_norm: str = ""  # "head": RMSNorm over each head of q and k; "projection": over the whole q and k projections
    qkv_bias: bool = False
    o_bias: bool = False
    head_bias: bool = False
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv after their projection (and norm)
    norm: str = "rms"  # "rms"; "rms_fp32", the weight applied before the cast back (gpt-oss); "layer" (with a bias)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # each branch's output, before it is added to the residual stream
    attention_scale: float | None = None  # the softmax's scale (None: 1/sqrt(head_dim))
    logits_scaling: float = 1.0  # logits divided by it
    shared_hidden_dim: int | None = None  # a shared expert of this width beside the routed ones (Qwen2-MoE)
    shared_gate: bool = False  # its output scaled by sigmoid(shared_expert_gate(x))
    dense_layers: tuple[int, ...] = ()  # blocks whose feed-forward is one dense MLP, no experts (Qwen2/3-MoE)
    dense_hidden_dim: int | None = None  # its width (`intermediate_size`)
    full_layers: tuple[int, ...] = ()  # blocks that attend to every position though `sliding_window` is set (gpt-oss)
    sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    router_bias: bool = False  # the router's gate has a bias (gpt-oss)
    expert_bias: bool = False  # every expert's products have biases (gpt-oss)
    glu: str = "silu"  # the experts' gated unit: "silu", silu(gate) * up; "clamped", gpt-oss's (`models.experts.Glu`)
    glu_alpha: float = 1.702  # "clamped": gate * sigmoid(alpha * gate)
    glu_limit: float = 7.0  # "clamped": gate clamped above, up on both sides
    # Multi-head latent attention (DeepSeek-V2/V3), on where kv_lora_rank is set (`models.latent`): keys and values
    # from a latent of kv_lora_rank values and one rotary key of head_dim values shared by every head
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # q through a bottleneck of this rank (and its norm), else directly
    qk_nope_dim: int = 0  # each head's key and query dims without rotary, beside head_dim rotary ones
    v_head_dim: int = 0  # each head's value dims
    rope_interleave: bool = False  # the checkpoint's rotary pairs are interleaved (made half-split at load)
    n_group: int = 1  # DeepSeek routers: experts in groups, the best topk_group groups chosen first
    topk_group: int = 1
    routed_scaling: float = 1.0  # the routed experts' weights times this
    score_bias: bool = False  # DeepSeek-V3: a per-expert bias added to the scores to choose, not to weigh
    mtp_layers: int = 0  # multi-token-prediction blocks the checkpoint holds past the last one (skipped)

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size",
                     "n_experts", "top_k", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"config field {name} must be a positive number, got {value!r}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"top_k={self.top_k} is larger than n_experts={self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or null, got {self.sliding_window}")
        grouped = self.router in ("deepseek_v2_grouped", "deepseek_v3")  # V2's greedy routing ignores the groups
        if grouped and (self.n_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise ConfigError(f"n_group={self.n_group} must divide the {self.n_experts} experts and topk_group="
                              f"{self.topk_group} lie in 1..n_group")
        if self.router == "deepseek_v3" and self.n_experts // self.n_group < 2:
            raise ConfigError(f"each of the n_group={self.n_group} groups needs 2 experts or more (its score is the "
                              "sum of its best two)")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (DeepSeek): the cache holds a latent and a rotary key per token."""
        return self.kv_lora_rank is not None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ---------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Mixtral (`num_local_experts`) or dense Mistral/Llama-style config (E=1, k=1)."""
        def need(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"config.json has no field {key!r}")
            return cfg[key]

        dim, n_heads = need("hidden_size"), need("num_attention_heads")
        try:
            theta, scaling = parse_rope(cfg)
            family = families.knobs(cfg)
        except (RopeError, families.FamilyError) as e:
            raise ConfigError(str(e)) from None
        n_experts, top_k = families.experts_of(cfg)
        max_position = cfg.get("max_position_embeddings", 32768)
        return cls(
            dim=dim,
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=family.pop("n_kv_heads", None) or cfg.get("num_key_value_heads") or n_heads,
            head_dim=family.pop("head_dim", None) or cfg.get("head_dim") or dim // n_heads,
            hidden_dim=family.pop("hidden_dim", None) or need("intermediate_size"),
            vocab_size=need("vocab_size"),
            n_experts=n_experts,
            top_k=top_k,
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=families.sliding_window(cfg),
            max_seq_len=context_length(max_position, scaling),
            max_position_embeddings=max_position if scaling.kind == "dynamic" else None,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_id=_first(cfg.get("bos_token_id", 1)),
            eos_id=_first(cfg.get("eos_token_id", 2)),
            eos_ids=tuple(cfg["eos_token_id"]) if isinstance(cfg.get("eos_token_id"), list) else (),
            **family,
        )

    def to_hf(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_scaling.to_hf(self.rope_theta),
            "sliding_window": self.sliding_window,
            "max_position_embeddings": self.max_position_embeddings or self.max_seq_len,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
        }
        return cfg | families.hf_fields(self)

    # ---- Mistral params.json ----------------------------------------------------------------------

    @classmethod
    def from_mistral(cls, params: dict[str, Any]) -> ModelConfig:
        def need(key: str) -> Any:
            if key not in params:
                raise ConfigError(f"params.json has no field {key!r}")
            return params[key]

        dim, n_heads = need("dim"), need("n_heads")
        moe = params.get("moe") or {}
        return cls(
            dim=dim,
            n_layers=need("n_layers"),
            n_heads=n_heads,
            n_kv_heads=params.get("n_kv_heads") or n_heads,
            head_dim=params.get("head_dim") or dim // n_heads,
            hidden_dim=need("hidden_dim"),
            vocab_size=need("vocab_size"),
            n_experts=moe.get("num_experts", 1),
            top_k=moe.get("num_experts_per_tok", 1),
            norm_eps=params.get("norm_eps", 1e-5),
            rope_theta=params.get("rope_theta", 1e4),
            sliding_window=params.get("sliding_window"),
            max_seq_len=params.get("max_seq_len", params.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(params.get("tied_embeddings", False)),
        )

    def to_mistral(self) -> dict[str, Any]:
        if self.family not in ("mixtral", "mistral", "llama"):
            raise ConfigError(f"{self.family} has no Mistral consolidated layout (params.json holds Mixtral, Mistral "
                              "and Llama models): save it as a Hugging Face checkpoint")
        if self.rope_scaling.kind != "default":
            raise ConfigError(f"rope scaling {self.rope_scaling.kind!r} has no params.json field: save it as a "
                              "Hugging Face checkpoint")
        params: dict[str, Any] = {
            "dim": self.dim,
            "n_layers": self.n_layers,
            "head_dim": self.head_dim,
            "hidden_dim": self.hidden_dim,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "norm_eps": self.norm_eps,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "max_seq_len": self.max_seq_len,
        }
        if self.sliding_window is not None:
            params["sliding_window"] = self.sliding_window
        if self.tie_embeddings:
            params["tied_embeddings"] = True
        if self.is_moe:
            params["moe"] = {"num_experts": self.n_experts, "num_experts_per_tok": self.top_k}
        return params


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value
