"""Multi-head latent attention (DeepSeek-V2/V3): every head's keys and values come from one latent per token.

A token's latent c (kv_lora_rank values, normalised) and one rotary key r (head_dim values, shared by all heads) are
what the cache holds: `KVCache` with k = c [B, 1, L, C] and v = r [B, 1, L, R]. Head h's key is [W_UK[h] c, r] and
its value W_UV[h] c, with W_UK, W_UV the rows of `wkv_b`. Two forms give the same attention:

- expanded (prompts from slot 0): keys and values made per head, then the library attention;
- absorbed (every step with earlier tokens cached): W_UK folded into the query (q_nope W_UK[h], against c directly)
  and W_UV applied after the weighted sum of latents, so no per-head key or value of the cached tokens is ever made.

Shapes: B batch, S new tokens, L cache length, H heads, N nope dims, R rotary dims (`head_dim`), V value dims,
C latent dims, Q q bottleneck dims, D model dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionContext
from models.basic import Linear
from models.config import ModelConfig
from models.kernels.choice import KernelChoice
from models.kv_cache import KVCache
from models.norms import RMSNorm
from models.rope import apply_rotary


class LatentAttention(nn.Module):
    n_kv_heads = 1  # one latent and rotary key per token, whatever the heads (`KVCache.of`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v_dim = cfg.n_heads, cfg.qk_nope_dim, cfg.head_dim, cfg.v_head_dim
        self.latent_dim, self.scale = cfg.kv_lora_rank, cfg.attention_scale
        width = cfg.n_heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.wq_a, self.q_norm = Linear(cfg.dim, cfg.q_lora_rank), RMSNorm(cfg.q_lora_rank, 1e-6)
            self.wq_b = Linear(cfg.q_lora_rank, width)
        else:
            self.wq = Linear(cfg.dim, width)
        self.wkv_a = Linear(cfg.dim, self.latent_dim + self.rope)
        self.kv_norm = RMSNorm(self.latent_dim, 1e-6)
        self.wkv_b = Linear(self.latent_dim, cfg.n_heads * (self.nope + self.v_dim))
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.dim)
        self.form = "auto"  # "expanded" or "absorbed" for every call (tests); "auto": as the module docstring says

    def prepare_weights(self, choice: KernelChoice) -> None:
        """Keep W_UK and W_UV as plain per-head tensors too (made once: small beside the model), for the absorbed
        form's two per-head products."""
        self.wkv_b.prepare_weights(choice)
        self.w_uk, self.w_uv = (w.contiguous() for w in self.absorbed_weights())

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, C], W_UV [H, V, C]) from wkv_b's rows."""
        if getattr(self, "w_uk", None) is not None:
            return self.w_uk, self.w_uv
        w = self.wkv_b.dense("weight").view(self.n_heads, self.nope + self.v_dim, self.latent_dim)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x_BSD: torch.Tensor, ctx: AttentionContext, cache: KVCache | None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if hasattr(self, "wq_b") else self.wq(x_BSD)
        q = q.view(B, S, self.n_heads, self.nope + self.rope).transpose(1, 2)  # [B, H, S, N+R]
        latent, k_rope = self.wkv_a(x_BSD).split((self.latent_dim, self.rope), dim=-1)
        latent = self.kv_norm(latent)[:, None]  # [B, 1, S, C]
        rotated = apply_rotary(torch.cat((q[..., self.nope:], k_rope[:, None]), dim=1), ctx.cos, ctx.sin)
        q_rope, k_rope = rotated.split((self.n_heads, 1), dim=1)  # [B, H, S, R], [B, 1, S, R]
        q_nope = q[..., :self.nope]
        if cache is not None and ctx.slot is not None:
            latent, k_rope = cache.write_at(ctx.slot, latent, k_rope)  # [B, 1, L, C], [B, 1, L, R]
        elif cache is not None:
            latent, k_rope = cache.update(ctx.start, latent, k_rope)
        absorbed = self.form == "absorbed" or (self.form == "auto" and ctx.decoding)
        out = (self.absorbed(q_nope, q_rope, latent, k_rope, ctx) if absorbed
               else self.expanded(q_nope, q_rope, latent, k_rope, ctx))
        return self.wo(out.to(x_BSD.dtype).transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim))

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor:
        """Per-head keys and values of every cached token, then the library attention: [B, H, S, V]."""
        B, _, L, _ = latent.shape
        kv = self.wkv_b(latent[:, 0]).view(B, L, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k = torch.cat((kv[..., :self.nope], k_rope.expand(B, self.n_heads, L, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, kv[..., self.nope:], attn_mask=ctx.mask, is_causal=ctx.is_causal,
                                              scale=self.scale)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 ctx: AttentionContext) -> torch.Tensor:
        """Attention over the latents themselves, W_UK in the query and W_UV after the sum: [B, H, S, V]. Products
        in the cache's dtype (every head against the one latent per token: a single product per sequence, the
        cache never copied per head), the softmax in fp32."""
        w_uk, w_uv = self.absorbed_weights()
        B, H, S, N = q_nope.shape
        L, dtype = latent.shape[2], latent.dtype
        per_head = q_nope.permute(1, 0, 2, 3).reshape(H, B * S, N)  # one product per head: [H, B*S, N] x [H, N, C]
        q_latent = (per_head @ w_uk.to(dtype)).view(H, B, S, -1).permute(1, 0, 2, 3).reshape(B, 1, H * S, -1)
        scores = q_latent @ latent.transpose(2, 3) + q_rope.reshape(B, 1, H * S, -1) @ k_rope.transpose(2, 3)
        scores = scores.float().view(B, H, S, L) * self.scale
        mask = ctx.explicit_mask(S, L, scores.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(dtype).view(B, 1, H * S, L)
        summed = (probs @ latent).view(B, H, S, -1).permute(1, 0, 2, 3).reshape(H, B * S, -1)  # [H, B*S, C]
        return (summed @ w_uv.to(dtype).transpose(1, 2)).view(H, B, S, -1).permute(1, 0, 2, 3)
