"""Named model sizes for benchmarks, and random checkpoints of those sizes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from models.config import ModelConfig
from models.transformer import Transformer
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
}


def write_sized_checkpoint(path: Path, size: str, seed: int = 0, max_shard_bytes: int | None = None,
                           vocab_size: int | None = None) -> Path:
    """`vocab_size`: the embedding's rows instead of the size's (a server bench matches its tokenizer's, so that
    every token it streams has text)."""
    cfg = SIZES[size] if vocab_size is None else dataclasses.replace(SIZES[size], vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    return save_checkpoint(model.state_dict(), cfg, path, max_shard_bytes=max_shard_bytes)
