"""An outside oracle for Mistral's consolidated layout: a full forward pass written from Mistral's reference code
(mistral-inference's `Transformer`), reading the consolidated tensors as they are stored.

Its rotary embedding is the interleaved one, computed the way the reference computes it: each head's dimensions
taken in pairs (0,1), (2,3), ... as complex numbers and multiplied by e^(i*pos*theta^(-2j/Dh)). It shares no code
with the project (no permutation, no name map, no loader), so a wrong permutation at load cannot pass against it,
whatever its inverse in our writer does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_interleaved(x_SHD: torch.Tensor, theta: float) -> torch.Tensor:
    S, _, Dh = x_SHD.shape
    freqs = 1.0 / theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)  # [Dh/2]
    angles = torch.outer(torch.arange(S, dtype=torch.float64), freqs)  # [S, Dh/2]
    cis = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [S, 1, Dh/2]
    pairs = torch.view_as_complex(x_SHD.double().reshape(S, -1, Dh // 2, 2))  # (x[2j], x[2j+1]) as one number
    return torch.view_as_real(pairs * cis).reshape(S, -1, Dh).to(x_SHD.dtype)


def forward(ckpt: Path, ids_S: list[int]) -> torch.Tensor:
    """[S, vocab] logits of one sequence, causal attention from position 0."""
    p = json.loads((ckpt / "params.json").read_text())
    w = load_file(ckpt / "consolidated.safetensors")
    H, G, Dh, eps = p["n_heads"], p["n_kv_heads"], p["head_dim"], p["norm_eps"]
    moe = p.get("moe")
    x = w["tok_embeddings.weight"][torch.tensor(ids_S)]
    S = x.shape[0]
    causal = torch.full((S, S), float("-inf")).triu(1)
    for i in range(p["n_layers"]):
        L = f"layers.{i}."
        h = rms_norm(x, w[L + "attention_norm.weight"], eps)
        q = rotate_interleaved((h @ w[L + "attention.wq.weight"].T).view(S, H, Dh), p["rope_theta"])
        k = rotate_interleaved((h @ w[L + "attention.wk.weight"].T).view(S, G, Dh), p["rope_theta"])
        v = (h @ w[L + "attention.wv.weight"].T).view(S, G, Dh)
        k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
        scores = torch.einsum("shd,thd->hst", q, k) / Dh ** 0.5 + causal
        out = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(S, H * Dh)
        x = x + out @ w[L + "attention.wo.weight"].T
        h = rms_norm(x, w[L + "ffn_norm.weight"], eps)
        x = x + (moe_ffn(w, L, h, moe) if moe else swiglu(w, L + "feed_forward.", h))
    return rms_norm(x, w["norm.weight"], eps) @ w.get("output.weight", w["tok_embeddings.weight"]).T


def swiglu(w: dict, prefix: str, h: torch.Tensor) -> torch.Tensor:
    a = torch.nn.functional.silu(h @ w[prefix + "w1.weight"].T) * (h @ w[prefix + "w3.weight"].T)
    return a @ w[prefix + "w2.weight"].T


def moe_ffn(w: dict, layer: str, h: torch.Tensor, moe: dict) -> torch.Tensor:
    """The reference's MoeLayer: top-k of the gate logits, softmax over the k, each token through its experts."""
    logits = h @ w[layer + "feed_forward.gate.weight"].T
    top, chosen = torch.topk(logits, moe["num_experts_per_tok"], dim=-1)
    weights = top.softmax(-1)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(chosen.shape[1]):
            e = chosen[t, j].item()
            out[t] += weights[t, j] * swiglu(w, f"{layer}feed_forward.experts.{e}.", h[t:t + 1])[0]
    return out
