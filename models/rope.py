"""Rotary embeddings (half-split layout, tables grown as calls need them) and their scaling kinds, as Hugging Face
checkpoints describe them.

A config says how positions turn into angles: `rope_theta` and, for longer contexts, a scaling kind read from
either spelling real files use (`rope_parameters` as transformers 5 writes it, or `rope_theta` + `rope_scaling`
with `type` or `rope_type` as most Hub files do):

- `default`: inv_freq[j] = theta^(-2j/Dh).
- `linear`: positions divided by `factor`.
- `dynamic` (NTK): theta grows with the sequence once it passes `max_position_embeddings`: each forward call uses
  each sequence's own length (transformers takes the batch's longest; alone, the same).
- `yarn`: low frequencies interpolated, high ones kept, a linear ramp between (`beta_fast`, `beta_slow`,
  `truncate`); cos and sin scaled by `attention_factor` (from `mscale`, `mscale_all_dim`, or 0.1 ln f + 1).
- `llama3`: long wavelengths divided by `factor`, short ones kept, smoothed between.
- `longrope`: per-frequency `short_factor` or `long_factor`, the long ones once a sequence's length passes
  `original_max_position_embeddings`; cos and sin scaled by sqrt(1 + ln f / ln original).

An unknown kind, or a field a kind needs, is refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # config.py reads the scalings from here
    from models.config import ModelConfig

KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class RopeError(ValueError):
    """The config's RoPE fields are unknown or incomplete; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    original_max: int | None = None  # the pre-training context (yarn, llama3, longrope)
    attention_factor: float | None = None  # yarn, longrope: given, else derived
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def by_length(self) -> bool:
        """The angles depend on the length of each forward call (dynamic, longrope), not on positions alone."""
        return self.kind in ("dynamic", "longrope")

    def to_hf(self, theta: float) -> dict[str, Any]:
        """transformers 5's `rope_parameters`."""
        out: dict[str, Any] = {"rope_type": self.kind, "rope_theta": theta}
        if self.kind == "default":
            return out
        fields = {"linear": ("factor",), "dynamic": ("factor",),
                  "yarn": ("factor", "original_max", "attention_factor", "beta_fast", "beta_slow", "mscale",
                           "mscale_all_dim", "truncate"),
                  "llama3": ("factor", "original_max", "low_freq_factor", "high_freq_factor"),
                  "longrope": ("factor", "original_max", "attention_factor", "short_factor", "long_factor")}
        for name in fields[self.kind]:
            value = getattr(self, name)
            if value is not None:
                key = "original_max_position_embeddings" if name == "original_max" else name
                out[key] = list(value) if isinstance(value, tuple) else value
        return out


def parse_rope(cfg: dict[str, Any], default_theta: float = 1e6) -> tuple[float, RopeScaling]:
    """(theta, scaling) from a Hugging Face config dict, either spelling."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in KINDS:
        raise RopeError(f"config.json asks for rope_type={kind!r}; supported: {', '.join(KINDS)}")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise RopeError(f"config.json asks for partial_rotary_factor={partial}; only rotary over the whole head "
                        "is supported")
    if kind == "default":
        return theta, RopeScaling()

    def need(key: str) -> Any:
        if rope.get(key) is None:
            raise RopeError(f"config.json's rope_type {kind!r} needs the field {key!r}")
        return rope[key]

    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if kind in ("yarn", "llama3", "longrope") and original is None:
        original = cfg.get("max_position_embeddings")
    factor = rope.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = cfg.get("max_position_embeddings", original) / original
    common = dict(kind=kind, factor=float(factor if factor is not None else need("factor")),
                  original_max=int(original) if original is not None else None)
    if kind == "yarn":
        return theta, RopeScaling(**common, attention_factor=rope.get("attention_factor"),
                                  beta_fast=float(rope.get("beta_fast") or 32),
                                  beta_slow=float(rope.get("beta_slow") or 1),
                                  mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                                  truncate=bool(rope.get("truncate", True)))
    if kind == "llama3":
        return theta, RopeScaling(**common, low_freq_factor=float(need("low_freq_factor")),
                                  high_freq_factor=float(need("high_freq_factor")))
    if kind == "longrope":
        return theta, RopeScaling(**common, attention_factor=rope.get("attention_factor"),
                                  short_factor=tuple(map(float, need("short_factor"))),
                                  long_factor=tuple(map(float, need("long_factor"))))
    return theta, RopeScaling(**common)


def context_length(max_position_embeddings: int, scaling: RopeScaling) -> int:
    """Positions the model takes: `max_position_embeddings`, times `factor` for dynamic NTK (the config's length
    is the original there, and the scaling exists to go past it)."""
    if scaling.kind == "dynamic":
        return int(max_position_embeddings * scaling.factor)
    return max_position_embeddings


def base_frequencies(theta: float, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """theta^(-2j/Dh), in fp32, as transformers computes it."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))


def inverse_frequencies(theta: float, head_dim: int, scaling: RopeScaling, max_position: int,
                        device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [Dh/2] fp32, attention factor) of a kind whose angles depend on positions alone."""
    inv = base_frequencies(theta, head_dim, device)
    kind = scaling.kind
    if kind == "linear":
        return inv / scaling.factor, 1.0
    if kind == "yarn":
        return _yarn(theta, head_dim, scaling, device)
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "longrope":
        return _longrope(theta, head_dim, scaling.short_factor, device), _longrope_attention(scaling, max_position)
    return inv, 1.0


def _longrope(theta: float, head_dim: int, factors: tuple[float, ...], device) -> torch.Tensor:
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta ** shape)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """yarn's magnitude factor for a context `scale` times the original (DeepSeek's softmax scale takes it too)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(theta: float, head_dim: int, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    attention = s.attention_factor
    if attention is None:
        attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim) \
            if s.mscale and s.mscale_all_dim else yarn_mscale(s.factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(s.original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    powers = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return (1.0 / (s.factor * powers)) * (1 - keep) + (1.0 / powers) * keep, float(attention)


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen, high_wavelen = s.original_max / s.low_freq_factor, s.original_max / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention(s: RopeScaling, max_position: int) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    factor = s.factor if s.factor else max_position / s.original_max
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(s.original_max))


def frequencies_for_length(theta: float, head_dim: int, scaling: RopeScaling, max_position: int,
                           length: torch.Tensor | int, device: torch.device | str | None = None) -> torch.Tensor:
    """inv_freq [..., Dh/2] of sequences of `length` positions (dynamic, longrope): an int, or a tensor of lengths
    [..., 1] on the device (each sequence's own, as a compiled decode step computes them)."""
    length = torch.as_tensor(length, device=device, dtype=torch.float32)
    if scaling.kind == "dynamic":
        length = torch.clamp(length, min=float(max_position))
        base = theta * ((scaling.factor * length / max_position) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    long, short = (_longrope(theta, head_dim, f, device) for f in (scaling.long_factor, scaling.short_factor))
    return torch.where(length > scaling.original_max, long, short)


def rotary_tables(positions_BS: torch.Tensor, inv_freq: torch.Tensor, attention: float, dtype: torch.dtype):
    """cos/sin tables [B, 1, S, Dh], computed in fp32 (scaled by `attention`, yarn's and longrope's factor) and
    cast like the reference."""
    freqs = positions_BS[..., None].float() * inv_freq  # [B, S, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, Dh]
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos.to(dtype), sin.to(dtype)


TABLE_STEP = 4096  # positions the table grows by: never every position of a 1M-token context at load


class RotaryTable:
    """cos/sin of the positions the model has met, [n, Dh] each, computed by `rotary_tables` and indexed per call
    (the same bits: every element goes through the same vectorized kernels either way). A compiled decode step then
    reads two rows where it computed a power, a cosine and a sine for every element of q and k in every block (60
    us of a 2.5 ms int8 step). Built at first use on the model's device and dtype, and grown in steps of
    `TABLE_STEP` positions as calls need them. Scalings whose angles depend on a call's length (dynamic NTK,
    longrope) are computed per call instead (`frequencies_for_length`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.original = cfg.max_position_embeddings or cfg.max_seq_len
        # the length-dependent kinds' cos/sin factor (longrope's), fixed by the config: computed once, not per call
        self.length_factor = inverse_frequencies(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, cfg.max_seq_len)[1] \
            if cfg.rope_scaling.by_length else 1.0
        self.cos: torch.Tensor | None = None  # [n, Dh]
        self.sin: torch.Tensor | None = None

    def __call__(self, positions_BS: torch.Tensor, dtype: torch.dtype,
                 length: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, Dh] of these positions (each row's increasing), in a call whose longest sequence has
        `length` positions (an int, or a tensor on the device in a static-shape decode step; every position is
        below it). The length-dependent kinds take each sequence's own length, its last position + 1, so that a
        sequence's angles never depend on the others of its batch (transformers takes the batch's longest)."""
        cfg, scaling, device = self.cfg, self.cfg.rope_scaling, positions_BS.device
        if scaling.by_length:
            own = positions_BS[:, -1:] + 1  # [B, 1]
            inv = frequencies_for_length(cfg.rope_theta, cfg.head_dim, scaling, self.original, own, device)
            return rotary_tables(positions_BS, inv[:, None], self.length_factor, dtype)
        need = length if isinstance(length, int) else cfg.max_seq_len
        if self.cos is None or self.cos.device != device or self.cos.dtype != dtype or self.cos.shape[0] < need:
            n = min(cfg.max_seq_len, -(-max(need, 1) // TABLE_STEP) * TABLE_STEP)
            inv, attention = inverse_frequencies(cfg.rope_theta, cfg.head_dim, scaling, cfg.max_seq_len, device)
            cos, sin = rotary_tables(torch.arange(n, device=device)[None], inv, attention, dtype)
            self.cos, self.sin = cos[0, 0], sin[0, 0]
        return self.cos[positions_BS][:, None], self.sin[positions_BS][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
