"""Named model sizes for benchmarks, and random checkpoints of those sizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.transformer import Transformer
from moe.checkpoint.encodings import encode_mxfp4
from moe.checkpoint.files import HF_INDEX
from moe.checkpoint.writer import save_checkpoint

SIZES = {
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, hidden_dim=1792,
                         vocab_size=8000, n_experts=8, top_k=2, max_seq_len=4096),
    "medium": ModelConfig(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, hidden_dim=3584,
                          vocab_size=32000, n_experts=8, top_k=2, max_seq_len=4096),
    # Qwen3-30B-A3B's shape scaled to this machine: many small experts (64 of width 192, top-8; the real model has
    # 128 of 768 at dim 2048), q twice as wide as the hidden size, per-head QK norms, renormalised softmax routing.
    "qwen3-moe": ModelConfig(dim=512, n_layers=8, n_heads=16, n_kv_heads=2, head_dim=64, hidden_dim=192,
                             vocab_size=8000, n_experts=64, top_k=8, max_seq_len=4096, rope_theta=1e6,
                             family="qwen3_moe", router="softmax", norm_topk_prob=True, qk_norm="head"),
    # gpt-oss-20b's shape scaled down: 32 experts of width dim, top-4, 64-wide heads, windows of 128 on every other
    # block, sinks, biases, the clamped gated unit (the real model: dim 2880, 24 blocks, 64 heads, vocab 201k)
    "gpt-oss": ModelConfig(dim=768, n_layers=8, n_heads=12, n_kv_heads=2, head_dim=64, hidden_dim=768,
                           vocab_size=8000, n_experts=32, top_k=4, max_seq_len=4096, rope_theta=150000.0,
                           sliding_window=128, full_layers=(1, 3, 5, 7), family="gpt_oss", sinks=True,
                           router_bias=True, expert_bias=True, glu="clamped", qkv_bias=True, o_bias=True,
                           norm="rms_fp32"),
    # DeepSeek-V2-Lite's shape scaled down: latent attention (latent 128 + rotary 32 per token and block, against
    # 16 heads x (64 + 32 + 64) for per-head keys and values), 32 experts of width 256, top-4, 2 shared, a dense first
    # block (the real model: dim 2048, 27 blocks, latent 512 + 64, 64 experts of 1408, top-6)
    "deepseek": ModelConfig(dim=512, n_layers=8, n_heads=16, n_kv_heads=16, head_dim=32, hidden_dim=256,
                            vocab_size=8000, n_experts=32, top_k=4, max_seq_len=16384, rope_theta=10000.0,
                            family="deepseek_v2", router="deepseek_v2", kv_lora_rank=128, qk_nope_dim=64,
                            v_head_dim=64, rope_interleave=True, attention_scale=96 ** -0.5, shared_hidden_dim=512,
                            dense_layers=(0,), dense_hidden_dim=1408),
}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}


def pack_experts_mxfp4(directory: Path) -> Path:
    """Rewrite a gpt-oss checkpoint's experts (transformers' [E, in, out] `gate_up_proj` and `down_proj`) as gpt-oss
    ships them: `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32], with config.json's
    quantization_config saying so."""
    renamed = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            w = tensors.pop(name).transpose(1, 2)  # [E, out, in]
            blocks, scales = encode_mxfp4(w.reshape(-1, w.shape[2]))
            tensors[name + "_blocks"] = blocks.view(*w.shape[:2], -1, 16)
            tensors[name + "_scales"] = scales.view(*w.shape[:2], -1)
            renamed[name] = path.name
        save_file(tensors, path, metadata={"format": "pt"})
    index = directory / HF_INDEX
    if index.exists():
        data = json.loads(index.read_text())
        for name, file in renamed.items():
            del data["weight_map"][name]
            data["weight_map"] |= {name + "_blocks": file, name + "_scales": file}
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": MXFP4_CONFIG}, indent=2))
    return directory


FP8_SKIPPED = ("embed_tokens", "lm_head", "norm", "mlp.gate.")  # as DeepSeek-V3 ships: its linear layers only


def pack_linear_fp8(directory: Path, block: int = 128) -> Path:
    """Rewrite a checkpoint's linear weights as DeepSeek-V3 ships them: `X.weight` float8_e4m3fn with
    `X.weight_scale_inv` [ceil(out/block), ceil(in/block)] fp32 (each block's largest magnitude / 448), and
    config.json's quantization_config saying so. Embeddings, the head, norms and routers stay as they are."""
    added = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dim() == 2
                     and ".layers." in n and not any(s in n for s in FP8_SKIPPED)]:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors[name], block)
            added[name + "_scale_inv"] = path.name
        save_file(tensors, path, metadata={"format": "pt"})
    index = directory / HF_INDEX
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] |= added
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((directory / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": quant}, indent=2))
    return directory


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w / scale as float8_e4m3fn, scale [ceil(R/b), ceil(C/b)]): each block scaled by its largest magnitude / 448."""
    R, C = w.shape
    padded = torch.zeros(-(-R // block) * block, -(-C // block) * block)
    padded[:R, :C] = w.float()
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=2.0 ** -126)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:R, :C].to(torch.float8_e4m3fn)
    return q, scale


def write_sized_checkpoint(path: Path, size: str, seed: int = 0, max_shard_bytes: int | None = None,
                           vocab_size: int | None = None, max_seq_len: int | None = None) -> Path:
    """`vocab_size`: the embedding's rows instead of the size's (a server bench matches its tokenizer's, so that
    every token it streams has text); `max_seq_len`: a longer context than the size's."""
    cfg = SIZES[size] if vocab_size is None else dataclasses.replace(SIZES[size], vocab_size=vocab_size)
    cfg = cfg if max_seq_len is None else dataclasses.replace(cfg, max_seq_len=max(max_seq_len, cfg.max_seq_len))
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    return save_checkpoint(model.state_dict(), cfg, path, max_shard_bytes=max_shard_bytes)
