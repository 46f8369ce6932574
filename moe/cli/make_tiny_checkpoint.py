"""Write a small random-weight Mixtral checkpoint (HF layout) with a SentencePiece tokenizer trained on a text.

Used for the shipped `weights/` example and by tests that need a checkpoint with a real tokenizer.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from models.config import ModelConfig
from models.transformer import Transformer
from moe.checkpoint.writer import save_checkpoint
from moe.tokenizer import train_tokenizer


def random_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02 if "tok_embeddings" not in name else 1.0)
    return model.state_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--text", type=Path, required=True, help="plain-text file to train the tokenizer on")
    ap.add_argument("--out", type=Path, required=True, help="output checkpoint directory (must not exist)")
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, head_dim=args.dim // 4,
                      hidden_dim=args.dim * 2, vocab_size=args.vocab_size, n_experts=args.experts,
                      top_k=args.top_k, max_seq_len=2048, rope_theta=10000.0)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer.model"
        train_tokenizer(args.text, args.vocab_size, tok)
        save_checkpoint(random_state(cfg, args.seed), cfg, args.out, beside=[tok])
    print(f"wrote {args.out}")


def run() -> int:
    main()
    return 0
