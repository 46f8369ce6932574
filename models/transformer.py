"""The Mixtral decoder on one device: embedding, blocks of (attention, MoE feed-forward), norm, head.

Blocks live in a `ModuleDict` keyed by their global index, so parameter names (`layers.17.*`) stay the
same whatever subset a rank holds. This file knows nothing of ranks; `moe.parallel.sharding` prunes and rewires it.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention import Attention, AttentionContext, Padding
from models.basic import Embedding, Linear
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.latent import LatentAttention
from models.mixture import MoEFeedForward
from models.norms import make_norm
from models.rope import RotaryTable


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.dim)
        self.attention = LatentAttention(cfg) if cfg.latent else Attention(cfg, index)
        self.ffn_norm = make_norm(cfg, cfg.dim)
        self.feed_forward = MoEFeedForward(cfg, dense=index in cfg.dense_layers)
        self.residual = cfg.residual_multiplier  # GraniteMoE scales each branch before adding it

    def attend(self, h_BSD: torch.Tensor, ctx: AttentionContext, cache: KVCache | None) -> torch.Tensor:
        if self.residual == 1.0 and isinstance(self.attention, Attention):  # a decode step's: the block in two ops
            out = self.attention.add_to(h_BSD, self.attention_norm, ctx, cache)
            if out is not None:
                return out
        out = self.attention(self.attention_norm(h_BSD), ctx, cache)
        return h_BSD + (out * self.residual if self.residual != 1.0 else out)

    def feed(self, h_BSD: torch.Tensor, decoding: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
        def ffn(x: torch.Tensor) -> torch.Tensor:
            out = self.feed_forward(x, decoding=decoding)
            return out * self.residual if self.residual != 1.0 else out

        if rows is None and self.residual == 1.0:
            out = self.feed_forward.add_to(h_BSD, self.ffn_norm, decoding)
            if out is not None:
                return out
        return add_feed_forward(h_BSD, self.ffn_norm(h_BSD), rows, ffn)

    def forward(self, h_BSD: torch.Tensor, ctx: AttentionContext, cache: KVCache | None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.feed(self.attend(h_BSD, ctx, cache), ctx.decoding, rows)


def add_feed_forward(h_BSD: torch.Tensor, x_BSD: torch.Tensor, rows: torch.Tensor | None, ffn) -> torch.Tensor:
    """h + ffn(x) over the real tokens only: `rows` indexes the non-padding tokens of the flattened batch."""
    B, S, D = h_BSD.shape
    x_TD = x_BSD.reshape(B * S, D)
    if rows is None:
        return h_BSD + ffn(x_TD).view(B, S, D)
    out_TD = torch.zeros_like(x_TD)
    out_TD[rows] = ffn(x_TD[rows])
    return h_BSD + out_TD.view(B, S, D)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg, cfg.dim)
        self.output = Linear(cfg.dim, cfg.vocab_size, cfg.head_bias)
        self.rotary = RotaryTable(cfg)

    def embed(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (GraniteMoE scales them by `embedding_multiplier`)."""
        h = self.tok_embeddings(tokens_BS)
        return h * self.cfg.embedding_multiplier if self.cfg.embedding_multiplier != 1.0 else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the last hidden states (GraniteMoE divides them by `logits_scaling`)."""
        logits = self.output(self.norm(h))
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits

    @property
    def held_blocks(self) -> list[str]:
        """The blocks whose attention this model holds: every block, or a pipeline rank's range of them."""
        return [name for name, block in self.layers.items() if block.attention is not None]

    @property
    def device(self) -> torch.device:
        """Where this model's weights are: its first held block's norm's (a pipeline rank may hold neither the
        embedding nor the head)."""
        return self.layers[self.held_blocks[0]].attention_norm.weight.device

    def make_caches(self, batch: int, length: int) -> dict[str, KVCache]:
        """A cache for each held block."""
        held = self.held_blocks
        p = self.layers[held[0]].attention_norm.weight if self.tok_embeddings is None else self.tok_embeddings.weight
        return {name: KVCache.of(self.cfg, batch, length, p.dtype, p.device) for name in held}

    def forward(self, tokens_BS: torch.Tensor, start: int = 0, caches: dict[str, KVCache] | None = None,
                padding: Padding | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits [B, S, V] for tokens at cache slots start..start+S; `padding`: each row's left padding.

        `last_only` projects only the last position ([B, 1, V]): generation needs nothing else from a prefill.
        """
        h = self.hidden_states(tokens_BS, start, caches, padding)
        if last_only:
            h = h[:, -1:]
        return self.head(h)

    def hidden_states(self, tokens_BS: torch.Tensor, start: int = 0, caches: dict[str, KVCache] | None = None,
                      padding: Padding | None = None) -> torch.Tensor:
        """The last block's output [B, S, D]: `forward` without the head (a rank that runs the blocks for their
        exchanges and needs no logits)."""
        B, S = tokens_BS.shape
        h = self.embed(tokens_BS)
        ctx = AttentionContext.build(self.cfg, self.rotary, B, S, start, padding, h.device, h.dtype)
        rows = real_token_rows(padding, S, start, h.device)
        for name, block in self.layers.items():
            h = block(h, ctx, caches[name] if caches is not None else None, rows)
        return h

    def decode_step(self, tokens_B1: torch.Tensor, slot: torch.Tensor, caches: dict[str, KVCache],
                    pad_B: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, V] of one new token per sequence at cache slot `slot` ([1] long, on the device), with every
        shape the same at every step (`AttentionContext.at_slot`): what `torch.compile` and CUDA graphs take.
        `pad_B`: each sequence's left padding on the device, or None."""
        return self.head(self.decode_hidden(tokens_B1, slot, caches, pad_B))[:, -1]

    def decode_hidden(self, tokens_B1: torch.Tensor, slot: torch.Tensor, caches: dict[str, KVCache],
                      pad_B: torch.Tensor | None) -> torch.Tensor:
        """`decode_step` without the head: the output [B, 1, D] of the blocks that have a cache in `caches`, in
        order (every block, or a pipeline rank's range of them). A model without the embedding (a later pipeline
        rank) takes the previous range's output [B, 1, D] instead of token ids."""
        h = self.embed(tokens_B1) if self.tok_embeddings is not None else tokens_B1
        length = next(iter(caches.values())).k.shape[2]
        ctx = AttentionContext.at_slot(self.cfg, self.rotary, tokens_B1.shape[0], slot, length, pad_B, h.dtype)
        for name, cache in caches.items():
            h = self.layers[name](h, ctx, cache)
        return h


def real_token_rows(padding: Padding | None, seq: int, start: int, device: torch.device) -> torch.Tensor | None:
    """Flat indices (on `device`) of non-padding tokens, or None when every token is real (every decode step
    once the prompts are in). Computed from the host copy of the padding: no device read."""
    if padding is None or start >= padding.longest:
        return None
    slots = torch.arange(start, start + seq)
    return (slots[None, :] >= padding.host_B[:, None]).reshape(-1).nonzero().squeeze(1).to(device)
