"""Attention with sinks (gpt-oss): each head has a learned logit that joins every query's softmax denominator and
attends to nothing, so a query may give less than all of its weight to the keys. No library attention takes it,
so the softmax is written out, in fp32 (transformers' eager attention is the reference).

Shapes: B batch, H query heads, G kv heads, S queries, L keys, Dh head dim.
"""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q k^T / sqrt(Dh), sink]) without the sink's column, times v: [B, H, S, Dh] in fp32. `mask`: bool,
    True = may attend, broadcast over [B, H, S, L] (`AttentionContext.explicit_mask`); None: every key visible."""
    B, H, S, Dh = q.shape
    G, L = k.shape[1], k.shape[2]
    q, k, v = q.float(), k.float(), v.float()
    # the R = H/G query heads of a kv head side by side, so one product per kv head serves them all
    scores = (q.view(B, G, H // G * S, Dh) @ k.transpose(2, 3)).view(B, H, S, L) * Dh ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, S, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :L]
    return (probs.view(B, G, H // G * S, L) @ v).view(B, H, S, Dh)
