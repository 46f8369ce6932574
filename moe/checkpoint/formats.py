"""Checkpoint layouts: one declarative map from our parameter names to each format's tensor names.

Ours are Mistral's names with experts stacked (`layers.{i}.feed_forward.experts.w1` is `[E, F, D]`).
Loader, saver and converter all go through `external_name`, so a name is spelled in one place only.
Mistral's consolidated q/k rows use the interleaved RoPE layout; ours (and Hugging Face's) the
half-split one: `to_half_split` / `to_interleaved` convert at the boundary.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config import ConfigError, ModelConfig
from moe.checkpoint.files import CheckpointError, read_header, refuse_pickles

HF, MISTRAL = "hf", "mistral"
HF_FUSED = "hf-fused"  # a Hugging Face directory whose experts are transformers 5's fused 3-D tensors
HF_MXFP4 = "hf-mxfp4"  # a Hugging Face directory whose experts are MXFP4 blocks and scales (gpt-oss as shipped)

_COMMON_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
}
_COMMON_MISTRAL = {k: k for k in _COMMON_HF}

NAME_MAPS: dict[tuple[str, bool], dict[str, str]] = {
    (HF, True): _COMMON_HF | {
        "layers.{i}.feed_forward.gate.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
        "layers.{i}.feed_forward.experts.w1": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        "layers.{i}.feed_forward.experts.w2": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
        "layers.{i}.feed_forward.experts.w3": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    },
    (HF, False): _COMMON_HF | {
        "layers.{i}.feed_forward.experts.w1": "model.layers.{i}.mlp.gate_proj.weight",
        "layers.{i}.feed_forward.experts.w2": "model.layers.{i}.mlp.down_proj.weight",
        "layers.{i}.feed_forward.experts.w3": "model.layers.{i}.mlp.up_proj.weight",
    },
    (MISTRAL, True): _COMMON_MISTRAL | {
        "layers.{i}.feed_forward.gate.weight": "layers.{i}.feed_forward.gate.weight",
        "layers.{i}.feed_forward.experts.w1": "layers.{i}.feed_forward.experts.{e}.w1.weight",
        "layers.{i}.feed_forward.experts.w2": "layers.{i}.feed_forward.experts.{e}.w2.weight",
        "layers.{i}.feed_forward.experts.w3": "layers.{i}.feed_forward.experts.{e}.w3.weight",
    },
    (MISTRAL, False): _COMMON_MISTRAL | {
        "layers.{i}.feed_forward.experts.w1": "layers.{i}.feed_forward.w1.weight",
        "layers.{i}.feed_forward.experts.w2": "layers.{i}.feed_forward.w2.weight",
        "layers.{i}.feed_forward.experts.w3": "layers.{i}.feed_forward.w3.weight",
    },
}
# What families add or rename against the maps above (their Hub names, as transformers' conversion_mapping.py
# lists them): Qwen3-MoE and OLMoE name their router and experts as Qwen2-MoE does; biases and norms per knob.
_QWEN_FFN = {
    "layers.{i}.feed_forward.gate.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.feed_forward.experts.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "layers.{i}.feed_forward.experts.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "layers.{i}.feed_forward.experts.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
}
_QK_NORMS = {"layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
             "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
_QKV_BIAS = {f"layers.{{i}}.attention.w{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"}
_O_BIAS = {"layers.{i}.attention.wo.bias": "model.layers.{i}.self_attn.o_proj.bias"}
_NORM_BIAS = {"layers.{i}.attention_norm.bias": "model.layers.{i}.input_layernorm.bias",
              "layers.{i}.ffn_norm.bias": "model.layers.{i}.post_attention_layernorm.bias",
              "norm.bias": "model.norm.bias"}


# Experts stored as one 3-D tensor per block: GraniteMoE's Hub names, and transformers 5's fused layout
# (`experts.gate_up_proj` [E, 2F, D] with gate rows first, `experts.down_proj` [E, D, F]). `#e` names row e of such
# a tensor, `#e:k/n` its k-th of n equal parts (`encodings.catalog` makes them readable like per-expert tensors).
_GRANITE_FFN = {
    "layers.{i}.feed_forward.gate.weight": "model.layers.{i}.block_sparse_moe.router.layer.weight",
    "layers.{i}.feed_forward.experts.w1": "model.layers.{i}.block_sparse_moe.input_linear.weight#{e}:0/2",
    "layers.{i}.feed_forward.experts.w3": "model.layers.{i}.block_sparse_moe.input_linear.weight#{e}:1/2",
    "layers.{i}.feed_forward.experts.w2": "model.layers.{i}.block_sparse_moe.output_linear.weight#{e}",
}


def _fused_ffn(family: str) -> dict[str, str]:
    """transformers 5's fused expert tensors, as it names them in memory for each family."""
    granite = family == "granitemoe"
    at = f"model.layers.{{i}}.{'block_sparse_moe' if granite else 'mlp'}"
    return {"layers.{i}.feed_forward.gate.weight": f"{at}.{'router' if granite else 'gate'}.weight",
            "layers.{i}.feed_forward.experts.w1": f"{at}.experts.gate_up_proj#{{e}}:0/2",
            "layers.{i}.feed_forward.experts.w3": f"{at}.experts.gate_up_proj#{{e}}:1/2",
            "layers.{i}.feed_forward.experts.w2": f"{at}.experts.down_proj#{{e}}"}


def _gpt_oss(fmt: str) -> dict[str, str]:
    """gpt-oss: its router, biased experts with gate and up rows interleaved, and attention sinks. transformers keeps
    the experts as [E, in, out] (read transposed); shipped MXFP4 blocks decode to [E, out, in] (`encodings`)."""
    at = "model.layers.{i}.mlp"
    t = "" if fmt == HF_MXFP4 else ":T"
    return {"layers.{i}.feed_forward.gate.weight": f"{at}.router.weight",
            "layers.{i}.feed_forward.gate.bias": f"{at}.router.bias",
            "layers.{i}.feed_forward.experts.w1": f"{at}.experts.gate_up_proj#{{e}}:0%2{t}",
            "layers.{i}.feed_forward.experts.w3": f"{at}.experts.gate_up_proj#{{e}}:1%2{t}",
            "layers.{i}.feed_forward.experts.w2": f"{at}.experts.down_proj#{{e}}{t}",
            "layers.{i}.feed_forward.experts.b1": f"{at}.experts.gate_up_proj_bias#{{e}}:0%2",
            "layers.{i}.feed_forward.experts.b3": f"{at}.experts.gate_up_proj_bias#{{e}}:1%2",
            "layers.{i}.feed_forward.experts.b2": f"{at}.experts.down_proj_bias#{{e}}",
            "layers.{i}.attention.sinks": "model.layers.{i}.self_attn.sinks"}


_LATENT = {f"layers.{{i}}.attention.{ours}.weight": f"model.layers.{{i}}.self_attn.{hf}.weight"
           for ours, hf in (("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"),
                            ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"))}
_DEEPSEEK_FFN = _QWEN_FFN | {
    "layers.{i}.feed_forward.gate.score_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias"}


_DENSE_MLP = {f"layers.{{i}}.feed_forward.shared.{ours}.weight": f"model.layers.{{i}}.mlp.{hf}.weight"
              for ours, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}


def dense_layer(cfg: ModelConfig, name: str) -> bool:
    """`name` is a parameter of a dense layer among MoE ones."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) in cfg.dense_layers


@functools.lru_cache(maxsize=16)
def name_map(fmt: str, cfg: ModelConfig) -> dict[str, str]:
    """Our parameter names (templates) -> the format's tensor names, for this config's family and knobs. Made once
    per config (loading asks it for every tensor of every expert); callers read it, never change it."""
    names = dict(NAME_MAPS[(HF if fmt in (HF_FUSED, HF_MXFP4) else fmt, cfg.is_moe)])
    if fmt == MISTRAL:
        return names
    if cfg.family in ("qwen3_moe", "olmoe", "qwen2_moe"):
        names |= _QWEN_FFN
    if cfg.family in ("deepseek_v2", "deepseek_v3"):
        names |= _DEEPSEEK_FFN
    if cfg.latent:
        names |= _LATENT
    if cfg.shared_hidden_dim:
        shared = "shared_experts" if cfg.family.startswith("deepseek") else "shared_expert"
        names |= {f"layers.{{i}}.feed_forward.shared.{ours}.weight": f"model.layers.{{i}}.mlp.{shared}.{hf}.weight"
                  for ours, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}
        if cfg.shared_gate:
            names["layers.{i}.feed_forward.shared_gate.weight"] = "model.layers.{i}.mlp.shared_expert_gate.weight"
    if cfg.family == "granitemoe" and cfg.is_moe:
        names |= _GRANITE_FFN
    if fmt == HF_FUSED and cfg.is_moe and cfg.family != "gpt_oss":
        names |= _fused_ffn(cfg.family)
    if cfg.family == "gpt_oss":
        names |= _gpt_oss(fmt)
    if cfg.qk_norm:
        names |= _QK_NORMS
    if cfg.qkv_bias:
        names |= _QKV_BIAS
    if cfg.o_bias:
        names |= _O_BIAS
    if cfg.norm == "layer":
        names |= _NORM_BIAS
    if cfg.head_bias:
        names["output.bias"] = "lm_head.bias"
    return names


EXPERT_PARAMS = ("w1", "w2", "w3", "b1", "b2", "b3")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def is_stacked_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS and ".experts." in name


def external_name(fmt: str, cfg: ModelConfig, name: str, expert: int | None = None) -> str:
    """The format's tensor name for our parameter `name` (and expert index, for stacked expert weights)."""
    m = _LAYER.match(name)
    template = _LAYER.sub("layers.{i}.", name) if m else name
    if cfg.tie_embeddings and template == "output.weight":
        template = "tok_embeddings.weight"
    names = name_map(fmt, cfg)
    if m and int(m.group(1)) in cfg.dense_layers:  # a dense layer's MLP, under the Hub's dense names
        names = names | _DENSE_MLP
    out = names[template]
    return out.format(i=m.group(1) if m else "", e=expert)


def all_external_names(fmt: str, cfg: ModelConfig, names: list[str]) -> set[str]:
    out = set()
    for name in names:
        if is_stacked_expert(name) and dense_layer(cfg, name):
            continue  # a dense layer holds no routed experts
        experts = range(cfg.n_experts) if is_stacked_expert(name) else [None]
        out.update(external_name(fmt, cfg, name, e) for e in experts)
    return out


def needs_rope_permute(fmt: str, name: str) -> str | None:
    """'wq' or 'wk' when the format stores this weight in the interleaved RoPE layout."""
    if fmt == MISTRAL and name.endswith(("attention.wq.weight", "attention.wk.weight")):
        return name.split(".")[-2]
    return None


def latent_rope_rows(fmt: str, cfg: ModelConfig, name: str) -> tuple[int, int] | None:
    """(rows of a head, rotary rows ending each) of a latent-attention weight whose rotary rows the checkpoint keeps
    in interleaved pairs (DeepSeek): made half-split at load (`rope_rows`), interleaved again at save."""
    if not (cfg.latent and cfg.rope_interleave) or fmt == MISTRAL:
        return None
    if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        return cfg.qk_nope_dim + cfg.head_dim, cfg.head_dim
    if name.endswith("attention.wkv_a.weight"):
        return cfg.kv_lora_rank + cfg.head_dim, cfg.head_dim
    return None


def rope_rows(w: torch.Tensor, rows: tuple[int, int], half_split: bool = True) -> torch.Tensor:
    """The last `rotary` rows of each head of `w` ([heads * width, in]) made half-split (or interleaved again)."""
    width, rotary = rows
    heads = w.reshape(w.shape[0] // width, width, -1)
    tail = heads[:, width - rotary:]
    convert = to_half_split if half_split else to_interleaved
    tail = convert(tail.reshape(-1, heads.shape[2]), heads.shape[0]).view_as(tail)
    return torch.cat([heads[:, :width - rotary], tail], dim=1).view_as(w)


def to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved rotary pairs (0,1),(2,3).. -> halves (0..Dh/2-1 | Dh/2..), per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True)
class CheckpointFormat:
    fmt: str
    config: ModelConfig
    weight_files: list[str]  # candidate weight files when there is no index
    torch_dtype: str | None
    fp8_block: int = 128  # FP8 weights: the side of the square blocks their scales cover


def detect(directory: str | Path) -> CheckpointFormat:
    """Read the config of a HF (`config.json`) or Mistral consolidated (`params.json`) directory."""
    d = Path(directory)
    if d.is_file():
        what = "a GGUF file (llama.cpp's)" if d.suffix == ".gguf" else "a file"
        raise CheckpointError(f"{d}: {what}, not a checkpoint directory; give the directory that holds config.json "
                              "(Hugging Face) or params.json (Mistral) and the safetensors files")
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory does not exist")
    if (d / "config.json").exists():
        raw = _read_json(d / "config.json")
        files = sorted(p.name for p in d.glob("*.safetensors"))
        fmt, cfg = _hf_layout(d, files), _config(ModelConfig.from_hf, raw, d / "config.json")
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        block = _quantization(raw.get("quantization_config") or {}, d / "config.json")
    elif (d / "params.json").exists():
        raw = _read_json(d / "params.json")
        files = sorted(p.name for p in d.glob("consolidated*.safetensors"))
        fmt, cfg, dtype, block = MISTRAL, _config(ModelConfig.from_mistral, raw, d / "params.json"), None, 128
    else:
        if any(p.suffix in (".bin", ".pt", ".pth") for p in d.iterdir()):
            refuse_pickles(d)
        raise CheckpointError(f"{d}: neither config.json (Hugging Face) nor params.json (Mistral) found")
    check_size(d, cfg, "params.json" if fmt == MISTRAL else "config.json", 17 / 32 if fmt == HF_MXFP4 else 1)
    return CheckpointFormat(fmt, cfg, files, dtype, block)


def _quantization(quant: dict, path: Path) -> int:
    """The FP8 block side of a config's quantization_config (128 where it has none); refuses what is not read."""
    method = quant.get("quant_method")
    if method not in (None, "mxfp4", "fp8"):
        raise CheckpointError(f"{path}: quantization_config's quant_method {method!r} is not supported; supported: "
                              "mxfp4 (gpt-oss's experts as shipped), fp8 with block scales (DeepSeek-V3's)")
    if method != "fp8":
        return 128
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
        raise CheckpointError(f"{path}: quantization_config's fp8 weight_block_size must be two equal sides, got "
                              f"{block!r} (per-tensor FP8 scales are not supported)")
    return int(block[0])


def _hf_layout(d: Path, files: list[str]) -> str:
    """HF_FUSED where the experts are transformers 5's fused tensors (`experts.gate_up_proj`), else HF: the names
    of the index, or of the first file's header (a few KiB)."""
    index = d / "model.safetensors.index.json"
    try:
        names = list(json.loads(index.read_text()).get("weight_map", {})) if index.exists() else \
            list(read_header(d / files[0])) if files else []
    except (OSError, json.JSONDecodeError, AttributeError, CheckpointError):
        return HF  # the loader names what is wrong with the files
    if any(n.endswith("_blocks") and ".experts." in n for n in names):
        return HF_MXFP4
    return HF_FUSED if any(".experts.gate_up_proj" in n for n in names) else HF


def parameter_count(cfg: ModelConfig, expert_bytes: float = 1.0) -> int:
    """Weights the config implies (embedding, head unless tied, every block's attention, norms, router, experts),
    the experts' counted at `expert_bytes` each (an MXFP4 weight takes 17/32 of a byte)."""
    attention = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    experts = int(cfg.n_experts * 3 * cfg.dim * cfg.hidden_dim * expert_bytes)
    router = cfg.n_experts * cfg.dim if cfg.n_experts > 1 else 0
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return embeddings + cfg.n_layers * (attention + experts + router + 2 * cfg.dim) + cfg.dim


def check_size(directory: Path, cfg: ModelConfig, config_name: str, expert_bytes: float = 1.0) -> None:
    """Before any model is built or memory taken: the config must describe weights that fit in the files
    (at one byte per weight at least, `expert_bytes` per expert weight), so a wrong `num_hidden_layers` or
    `vocab_size` is one line, not a machine that runs out of memory."""
    weights = [p for p in directory.glob("*.safetensors")]
    on_disk = sum(p.stat().st_size for p in weights if p.exists())
    implied = parameter_count(cfg, expert_bytes)
    if weights and implied > on_disk:
        raise CheckpointError(f"{directory / config_name}: describes {implied:,} weights (num_hidden_layers="
                              f"{cfg.n_layers}, vocab_size={cfg.vocab_size}, hidden_size={cfg.dim}), more than the "
                              f"{on_disk:,} bytes of its safetensors files hold; the config does not match the weights")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from None


def _config(parse, raw: dict, path: Path) -> ModelConfig:
    try:
        return parse(raw)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
