"""Small random checkpoints for tests, written by our own writer or by Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.transformer import Transformer
from moe.checkpoint.formats import HF
from moe.checkpoint.writer import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "weights" / "tiny-random-mixtral"  # random weights: fast, for mechanics
TRAINED = ROOT / "weights" / "tiny-moe-austen-bbe"  # trained by scripts/train.py: the README's model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=128,
                n_experts=4, top_k=2, rope_theta=10000.0, max_seq_len=256)
    return ModelConfig(**(base | overrides))


def random_state(cfg: ModelConfig, seed: int = 0, std: float = 0.15) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, std)
    return model.state_dict()


def write_checkpoint(path: Path, cfg: ModelConfig, fmt: str = HF, seed: int = 0,
                     max_shard_bytes: int | None = None) -> Path:
    return save_checkpoint(random_state(cfg, seed), cfg, path, fmt=fmt, max_shard_bytes=max_shard_bytes)


def hf_model(kind: str = "mixtral", seed: int = 0, **kwargs):
    """A random transformers model (weights with std 0.15 so routing and argmax are decisive)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, rope_theta=10000.0,
                  bos_token_id=1, eos_token_id=2)
    if kind == "mistral":
        cfg = transformers.MistralConfig(**(common | kwargs))
        model = transformers.MistralForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**(common | dict(num_local_experts=4, num_experts_per_tok=2) | kwargs))
        model = transformers.MixtralForCausalLM(cfg)
    return model.eval()
