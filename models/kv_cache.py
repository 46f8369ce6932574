"""The KV cache of one attention block: keys and values preallocated for a batch and a length, written a call's
positions at a time (`update`, `turn_into`) or at a slot given as a tensor (`write_at`, a static-shape step)."""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.kernels import native


class KVCache:
    """Preallocated keys and values [B, G, L, Dh] of one attention block (latent attention: its latents and rotary
    keys, `models.latent`, of widths Dh and `v_dim`). Not a module: a compiled step takes them as inputs, never as
    the model's state (a frozen step would bake a request's cache into its graph)."""

    def __init__(self, batch: int, n_kv_heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, v_dim: int | None = None) -> None:
        self.k = torch.zeros((batch, n_kv_heads, length, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((batch, n_kv_heads, length, v_dim or head_dim), dtype=dtype, device=device)

    @classmethod
    def of(cls, cfg: ModelConfig, batch: int, length: int, dtype: torch.dtype, device: torch.device | str,
           kv_heads: int | None = None) -> KVCache:
        """A block's cache under this config: `kv_heads` (default all) of keys and values, or, with latent attention,
        one latent and one rotary key per token whatever the heads."""
        if cfg.latent:
            return cls(batch, 1, length, cfg.kv_lora_rank, dtype, device, cfg.head_dim)
        return cls(batch, kv_heads or cfg.n_kv_heads, length, cfg.head_dim, dtype, device)

    @classmethod
    def holding(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over tensors that exist already (a view of a larger store, a compiled step's inputs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        return cache

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, element: int, kv_heads: int | None = None) -> int:
        """What one token adds to one block's cache."""
        if cfg.latent:
            return (cfg.kv_lora_rank + cfg.head_dim) * element
        return 2 * (kv_heads or cfg.n_kv_heads) * cfg.head_dim * element

    def check_room(self, end: int) -> None:
        """Positions up to `end` fit."""
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, asked to write up to {end}")

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        self.check_room(end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def turn_into(self, start: int, q_BSHD: torch.Tensor, k_BSGD: torch.Tensor, v_BSGD: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`update` with q and k turned by RoPE on the way, in one native op: (q [B, H, S, Dh], k, v)."""
        end = start + k_BSGD.shape[1]
        self.check_room(end)
        q = native.rotary_into_cache(q_BSHD, k_BSGD, v_BSGD, cos, sin, self.k, self.v, start)
        return q, self.k[:, :, :end], self.v[:, :, :end]

    def write_at(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position at `slot` ([1] long tensor): every shape static; the whole cache is returned."""
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        return self.k, self.v
