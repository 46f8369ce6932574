"""Grouped-query attention with a preallocated KV cache (its rotary tables: `models.rope`).

Shapes: B batch, S new positions, L cache length, H query heads, G kv heads, Dh head dim, D model dim.
The KV cache is indexed by *slot*; a sequence's rotary position is its slot minus its left padding,
so prompts of different lengths share one cache and one step counter.

A decode step has two forms: with the slot as a Python int (`AttentionContext.build`: the cache is written
and read up to the slot, shapes grow by one every step), or with the slot as a tensor on the device
(`AttentionContext.at_slot`: the cache is written at the slot and read whole under a mask, so every shape is
the same at every step, which a compiled step and a CUDA graph need).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import weights
from models.basic import Linear, hooked
from models.config import ModelConfig
from models.kernels import choice as kc
from models.kernels import decode_block, native
from models.kernels.choice import KernelChoice
from models.kv_cache import KVCache
from models.norms import RMSNorm
from models.rope import RotaryTable, apply_rotary
from models.sinks import sink_attention


@dataclass(frozen=True)
class Padding:
    """Left padding of each sequence of a request, made once per request: on the host for decisions (no
    device read), and on the model's device for masks and positions (no copy per step)."""

    longest: int  # > 0: a Padding exists only when some sequence is padded
    host_B: torch.Tensor  # [B] long, on the CPU
    device_B: torch.Tensor  # [B] long, on the model's device
    counts: tuple[int, ...]  # host_B as ints, read once

    @classmethod
    def of(cls, pad_B: torch.Tensor | None, device: torch.device | str) -> Padding | None:
        """From a [B] CPU tensor of left-padding counts (None when no sequence is padded)."""
        if pad_B is None:
            return None
        pads = pad_B.tolist()  # a CPU tensor, once per request
        if not pads or max(pads) == 0:
            return None
        return cls(max(pads), pad_B.cpu(), pad_B.to(device), tuple(pads))


def causal_mask(seq: int, length: int, device: torch.device) -> torch.Tensor:
    """[seq, length] bool, True = may attend: the last `seq` of `length` positions, each over the keys up to its own
    (the bottom-right causal mask; SDPA's `is_causal` aligns it top-left)."""
    return torch.ones(seq, length, dtype=torch.bool, device=device).tril(length - seq)


@dataclass
class AttentionContext:
    """Everything the attention of one forward call needs besides its input; built once per call."""

    start: int  # first cache slot written by this call
    cos: torch.Tensor  # [B, 1, S, Dh]
    sin: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, S, start+S] bool, True = may attend; None: see is_causal
    is_causal: bool = False  # with mask None: causal (a prompt from slot 0) or, if False, every key visible
    slot: torch.Tensor | None = None  # [1] long on the device: a one-token step of static shape (`at_slot`)
    # a call with a mask but no window cut (left-padded prompts, a prompt's later chunk): each sequence's first real
    # slot, on the host, so that each attends its own tokens as it would alone (`attend_alone`)
    pads: tuple[int, ...] | None = None

    @property
    def decoding(self) -> bool:
        return self.slot is not None or self.start > 0

    full: AttentionContext | None = None  # for blocks that attend fully in a model whose others slide a window

    def for_block(self, full: bool) -> AttentionContext:
        """The context of a block that attends fully (`full`) or slides the config's window."""
        return self.full if full and self.full is not None else self

    def explicit_mask(self, seq: int, length: int, device: torch.device) -> torch.Tensor | None:
        """The mask as a tensor, for attention written out by hand (no library kernel reads `is_causal` there): the
        context's own, the causal one of a prompt from slot 0 [S, L], or None where every key is visible."""
        if self.mask is None and self.is_causal:
            return causal_mask(seq, length, device)
        return self.mask

    def rows(self, index: slice | torch.Tensor, host: slice | torch.Tensor | None = None) -> AttentionContext:
        """The context of some sequences of the batch (a rank's rows of it): a slice, or indices on the device and
        the same on the host (`host`, for the padding each attends by without a device read)."""
        mask = self.mask[index] if self.mask is not None and self.mask.shape[0] > 1 else self.mask
        full = self.full.rows(index, host) if self.full is not None else None
        at = index if isinstance(index, slice) else host
        pads = None
        if self.pads is not None and at is not None:
            pads = self.pads[at] if isinstance(at, slice) else tuple(self.pads[i] for i in at.tolist())
        return dataclasses.replace(self, cos=self.cos[index], sin=self.sin[index], mask=mask, full=full, pads=pads)

    @classmethod
    def build(cls, cfg: ModelConfig, rotary: RotaryTable, batch: int, seq: int, start: int, padding: Padding | None,
              device: torch.device, dtype: torch.dtype) -> AttentionContext:
        q_slot = torch.arange(start, start + seq, device=device)  # [S]
        pad = padding.device_B if padding is not None else None
        positions = (q_slot[None, :] - pad[:, None]).clamp(min=0) if pad is not None else \
            q_slot[None, :].expand(batch, -1)
        cos, sin = rotary(positions, dtype, start + seq)
        pads = padding.counts if padding is not None else (0,) * batch
        ctx = cls._masked(cfg.sliding_window, start, seq, pad, cos, sin, pads)
        if cfg.full_layers and cfg.sliding_window is not None:
            ctx.full = cls._masked(None, start, seq, pad, cos, sin, pads)
        return ctx

    @classmethod
    def _masked(cls, window: int | None, start: int, seq: int, pad: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, pads: tuple[int, ...] | None = None) -> AttentionContext:
        """The context of blocks that slide `window` (None: attend to every earlier position)."""
        window_cuts = window is not None and start + seq > window
        if pad is None and not window_cuts and (start == 0 or seq == 1):
            # No explicit mask: SDPA's causal kernel skips the masked half of a prompt; one new token sees all.
            return cls(start=start, cos=cos, sin=sin, mask=None, is_causal=start == 0 and seq > 1)
        q_slot = torch.arange(start, start + seq, device=cos.device)  # [S]
        k_slot = torch.arange(start + seq, device=cos.device)  # [L]
        causal = k_slot[None, :] <= q_slot[:, None]  # [S, L]
        if window is not None:
            causal &= k_slot[None, :] > q_slot[:, None] - window
        mask = causal[None]  # [1, S, L]: the same for every sequence
        if pad is not None:
            # Padding slots are never attended to; a padding query still sees itself so no row is all -inf (NaN).
            real_key = k_slot[None, :] >= pad[:, None]  # [B, L]
            diagonal = k_slot[None, :] == q_slot[:, None]  # [S, L]
            mask = causal[None] & (real_key[:, None, :] | diagonal[None])  # [B, S, L]
        return cls(start=start, cos=cos, sin=sin, mask=mask[:, None], pads=None if window_cuts else pads)

    @classmethod
    def at_slot(cls, cfg: ModelConfig, rotary: RotaryTable, batch: int, slot: torch.Tensor, length: int,
                pad_B: torch.Tensor | None, dtype: torch.dtype) -> AttentionContext:
        """One new token per sequence at cache slot `slot` ([1] long, on the device) of a `length`-slot cache:
        the same masks and positions as `build`, over every slot of the cache, from tensors only."""
        positions = slot.expand(batch)[:, None]  # [B, 1]
        if pad_B is not None:
            positions = (positions - pad_B[:, None]).clamp(min=0)
        cos, sin = rotary(positions, dtype, length)

        def masked(window: int | None) -> AttentionContext:
            k_slot = torch.arange(length, device=slot.device)  # [L]
            visible = k_slot <= slot  # [L]: the slots written so far (later ones hold an earlier request's keys)
            if window is not None:
                visible &= k_slot > slot - window
            mask = visible.expand(batch, length)
            if pad_B is not None:
                mask = mask & (k_slot[None, :] >= pad_B[:, None])  # a decode query is never a padding slot
            return cls(start=-1, cos=cos, sin=sin, mask=mask[:, None, None, :], slot=slot)

        ctx = masked(cfg.sliding_window)
        if cfg.full_layers and cfg.sliding_window is not None:
            ctx.full = masked(None)
        return ctx


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.full = layer in cfg.full_layers  # attends to every position where other blocks slide a window
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.sinks else None  # gpt-oss: a logit per head
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, cfg.qkv_bias)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, cfg.o_bias)
        # Qwen3-MoE normalises each head of q and k, OLMoE the whole projections (before RoPE either way).
        self.qk_norm, self.clip = cfg.qk_norm, cfg.clip_qkv
        if cfg.qk_norm:
            width = cfg.head_dim if cfg.qk_norm == "head" else None
            self.q_norm = RMSNorm(width or cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(width or cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps)
        # A softmax scale other than 1/sqrt(Dh) (GraniteMoE's attention_multiplier) scales q instead, so every
        # attention path (ours and SDPA) keeps its default scale.
        self.q_scale = cfg.attention_scale * cfg.head_dim ** 0.5 if cfg.attention_scale is not None else None
        self.wqkv: weights.LinearWeight | None = None  # inference: q, k and v in one product
        self.qkv_bias: torch.Tensor | None = None  # and their biases, concatenated
        self.choice: KernelChoice | None = None  # inference: which attention runs (`KernelChoice.attention`)

    def prepare_weights(self, choice: KernelChoice) -> None:
        """Fuse q/k/v into one weight; wq/wk/wv stay as parts of it (for `state_dict`)."""
        if self.wqkv is None and not self.wq.weight.is_meta:
            self.choice = choice
            linears = (self.wq, self.wk, self.wv)
            self.wqkv, parts = weights.fused([lin.weight for lin in linears], choice)
            if self.wq.bias is not None:
                self.qkv_bias = torch.cat([lin.bias.detach() for lin in linears])
            for lin, part in zip(linears, parts, strict=True):
                lin.kernel, lin.weight = part, weights.shape_only(lin.weight)

    def glue_runs(self, cache: KVCache, q: torch.Tensor, ctx: AttentionContext) -> bool:
        """The native glue ops run this block's RoPE and cache write (`KVCache.turn_into`, `native.attend_one`)."""
        return (self.choice is not None and native.glue_runs(self.choice.native) and cache.k.is_contiguous()
                and cache.k.dtype == q.dtype == ctx.cos.dtype)

    def attends_in_one_op(self, x_BSD: torch.Tensor, ctx: AttentionContext, cache: KVCache | None) -> bool:
        """A decode step's attention runs as one native op (`native.attend_one`): one token per sequence, written
        at an int slot, in a family without clipping, a q scale, sinks or norms over whole projections, and with no
        hook on the q/k norms it stands in for (`models.basic.hooked`)."""
        return (x_BSD.shape[1] == 1 and cache is not None and ctx.slot is None and self.wqkv is not None
                and self.sinks is None and self.q_scale is None and self.clip is None and self.qk_norm != "projection"
                and self.glue_runs(cache, x_BSD, ctx)
                and (not self.qk_norm or (self.q_norm.native and self.q_norm.weight.dtype == x_BSD.dtype
                                          and not hooked(self.q_norm, self.k_norm))))

    def add_to(self, h_BSD: torch.Tensor, norm: nn.Module, ctx: AttentionContext,
               cache: KVCache | None) -> torch.Tensor | None:
        """h + this attention of norm(h) as one op (`decode_block.add_attention`) where `one_op_operands` has them;
        None elsewhere."""
        ctx = ctx.for_block(self.full)
        operands = self.one_op_operands(h_BSD, norm, ctx, cache)
        return None if operands is None else self.add_with(h_BSD, operands, ctx, cache)

    def one_op_operands(self, h_BSD: torch.Tensor, norm: nn.Module, ctx: AttentionContext,
                        cache: KVCache | None) -> tuple | None:
        """`decode_block.add_attention`'s arguments besides h, the step's position and the caches (the same at every
        step of a batch), where a decode step's attention runs as one op (`attends_in_one_op`), the norm natively,
        and both products, without biases, through the native decode kernel; None elsewhere, and where a module the op
        stands in for has a hook (`models.basic.hooked`). `ctx`: this block's (`for_block`)."""
        if hooked(self, norm, self.wo) or self.qkv_bias is not None or \
                self.wo.bias is not None or self.wo.kernel is None or not norm.runs_natively(h_BSD) or \
                not self.attends_in_one_op(h_BSD, ctx, cache):
            return None
        qkv, out = self.wqkv.native_operands(h_BSD.shape[0]), self.wo.kernel.native_operands(h_BSD.shape[0])
        if qkv is None or out is None:
            return None
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        return norm.operands, qkv, out, self.n_heads, self.n_kv_heads, *norms

    @staticmethod
    def add_with(h_B1D: torch.Tensor, operands: tuple, ctx: AttentionContext, cache: KVCache) -> torch.Tensor:
        """`add_to` with its `one_op_operands`."""
        cache.check_room(ctx.start + 1)
        return decode_block.add_attention(h_B1D, *operands, ctx.cos, ctx.sin, cache.k, cache.v, ctx.start, ctx.mask)

    def qkv(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v product [B, S, (H + 2G) Dh], with its bias (an inference model)."""
        qkv = self.wqkv(x_BSD)
        return qkv if self.qkv_bias is None else qkv + self.qkv_bias

    def project_qkv(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.wqkv is None:
            return self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.qkv(x_BSD).split((q_size, kv_size, kv_size), dim=-1)

    def forward(self, x_BSD: torch.Tensor, ctx: AttentionContext, cache: KVCache | None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        ctx = ctx.for_block(self.full)
        if self.attends_in_one_op(x_BSD, ctx, cache):  # the ops below in one call, their bits
            cache.check_room(ctx.start + 1)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            return self.wo(native.attend_one(self.qkv(x_BSD), self.n_heads, self.n_kv_heads, *norms, ctx.cos, ctx.sin,
                                             cache.k, cache.v, ctx.start, ctx.mask))
        q, k, v = self.project_qkv(x_BSD)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if cache is not None and ctx.slot is None and self.q_scale is None and self.glue_runs(cache, q, ctx):
            q, k, v = cache.turn_into(ctx.start, q, k, v, ctx.cos, ctx.sin)  # one op, apply_rotary's bits
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, Dh], [B, G, S, Dh]
            q, k = apply_rotary(torch.cat((q, k), dim=1), ctx.cos, ctx.sin).split((self.n_heads, self.n_kv_heads),
                                                                                  dim=1)
            if self.q_scale is not None:
                q = q * self.q_scale
            if cache is not None and ctx.slot is not None:
                k, v = cache.write_at(ctx.slot, k, v)  # [B, G, L, Dh], ctx.mask hides the slots past this one
            elif cache is not None:
                k, v = cache.update(ctx.start, k, v)  # [B, G, start+S, Dh]
        path = self.choice.attention(S == 1, ctx.is_causal, self.head_dim) if self.choice else kc.SDPA
        if self.sinks is not None:  # no library attention takes sinks: the softmax written out, in fp32
            out = sink_attention(q, k, v, ctx.explicit_mask(S, k.shape[2], q.device), self.sinks).to(x_BSD.dtype)
        elif S == 1 and path == kc.NATIVE_ATTENTION:  # one query: never causal (`AttentionContext.build`)
            # One query against the cache, in fp32: 31 -> 11 us a block (a bf16 cache: 52 -> 11) for a step of
            # `small` on 256 cache slots, 100 of them filled (torch's SDPA calls a matrix product per head and
            # reads the unfilled slots too; with a bf16 cache it first copies the whole cache to fp32). Where the
            # CPU has bf16 instructions, torch's bf16 SDPA calls MKL's generic bf16 product on an AMD CPU: 15% of
            # a compiled bf16 step of `small` (2 threads, an EPYC with AVX-512 bf16), so bf16 decodes with it too.
            out = native.decode_attention(q, k, v, ctx.mask).to(x_BSD.dtype)  # in fp32, k and v as they are
        elif ctx.pads is not None and self.choice is not None and self.choice.native:  # prompts padded to a batch
            out = self.attend_alone(q, k, v, ctx.pads, ctx.start)
        elif path == kc.NATIVE_PROMPT_ATTENTION:  # a prompt from slot 0, no padding: k and v are its own
            # 1.1-1.4 ms against SDPA's 3.4-3.8 ms a block for a 512-token prompt of `small` (2 threads, an AVX-512
            # EPYC; torch's flash attention runs MKL's generic products there).
            out = native.prompt_attention(q, k, v)  # in fp32
        else:
            out = self.sdpa(q, k, v, path, ctx.mask, ctx.is_causal).to(x_BSD.dtype)
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))

    def sdpa(self, q, k, v, path: str, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if path == kc.SDPA_FP32:  # bf16 on a CPU without bf16 instructions (`KernelChoice.attends_fp32`)
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                                  enable_gqa=self.n_heads != self.n_kv_heads).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=self.n_heads != self.n_kv_heads)

    def attend_alone(self, q_BHSD, k_BGSD, v_BGSD, pads: tuple[int, ...], start: int) -> torch.Tensor:
        """Each sequence of a call from slot `start` over its own keys (from its first real slot, `pads`) by the path
        it takes alone, so that its attention is the same bits whatever it is batched with (the padded batch's masked
        SDPA gave other bits than the native kernel: a request's answer depended on its neighbours), and a prompt's
        later chunk (its earlier keys cached) gives the bits of the prompt in one call (the native kernel's rows
        depend on their position alone; SDPA's masked rows are only close). Padding queries get zeros."""
        B, H, S, D = q_BHSD.shape
        out = q_BHSD.new_zeros(B, S, H, D)
        for b, pad in enumerate(pads):
            first = max(pad - start, 0)  # the call's first query of this sequence
            before = start + first - pad  # the sequence's keys before it, cached by earlier calls
            q, k, v = q_BHSD[b:b + 1, :, first:], k_BGSD[b:b + 1, :, pad:], v_BGSD[b:b + 1, :, pad:]
            path = self.choice.attention(False, S - first > 1 or before > 0, self.head_dim)
            if path == kc.NATIVE_PROMPT_ATTENTION:
                one = native.prompt_attention(q, k, v, before)
            else:  # causal from the sequence's first slot: SDPA's own mask, or the bottom-right one of a later chunk
                mask = causal_mask(S - first, before + S - first, q.device) if before else None
                one = self.sdpa(q, k, v, path, mask, before == 0 and S - first > 1)
            out[b, first:] = one[0].transpose(0, 1)
        return out.transpose(1, 2)
