"""Batched generation over any engine: left padding, prefill, then one token per step.

The loop is the same on one rank and on N: a stepper (an engine's stepping half) runs the forward
pass (the head's rank gets the logits, other ranks None) and shares the sampled tokens from the head's
rank, so every rank takes the same control-flow decisions (continue, stop at EOS) from the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        """Checked where the call is made, before any rank sees it: a bad argument never reaches a rank."""
        for name in ("max_new_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class Stepper(Protocol):
    """What the generation loop needs of an engine: a cache, a forward pass of new tokens, and the sampled
    tokens shared from the rank that holds the head (logits are None on the other ranks)."""

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        """A request of `batch` sequences, `length` cache slots each, left-padded by pad_B (CPU)."""

    def forward_last(self, tokens_BS: torch.Tensor, start: int) -> torch.Tensor | None: ...

    def share(self, decided: torch.Tensor) -> torch.Tensor:
        """The head's rank's `decided` (here: [B tokens, stop flag]) on every rank, on the engine's device."""

    @property
    def device(self) -> torch.device: ...


def sample(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    logits_BV = logits_BV.float()
    if params.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / params.temperature
    if params.top_k:
        kth = torch.topk(logits_BV, min(params.top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits_BV, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already cover top_p; the first token always stays.
        drop = probs.cumsum(-1) - probs > params.top_p
        logits_BV = logits_BV.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits_BV.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return tokens, pad


def check_prompts(prompts: list[list[int]], vocab_size: int, context: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= context:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {context} "
                             f"(max_position_embeddings), leaving no room to generate")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (size {vocab_size})")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt, EOS excluded
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cancelled: bool = False  # stopped on request (every rank stopped at the same step)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def generate_tokens(engine: Stepper, prompts: list[list[int]], params: SamplingParams, eos_ids: tuple[int, ...],
                    context: int, on_token: Callable[[int, int], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """Generate for a batch; `on_token(prompt_index, token)` sees each new token as it comes. `should_stop`
    (asked on every rank, decided by the head's rank and shared with its tokens) cancels the request between
    two steps on every rank at once."""
    t0 = time.perf_counter()
    tokens, pad = left_pad(prompts)
    B, P = tokens.shape
    steps = min(params.max_new_tokens, context - P)
    engine.start(B, P + steps, pad)
    generator = None  # made on the logits' device (a CPU generator cannot drive sampling on a GPU)
    out: list[list[int]] = [[] for _ in range(B)]
    done, cancelled = [False] * B, False
    logits = engine.forward_last(tokens, 0)
    t_prefill = None
    for step in range(steps):
        if logits is not None and generator is None:
            generator = torch.Generator(device=logits.device).manual_seed(params.seed)
        nxt = sample(logits, params, generator) if logits is not None else torch.zeros(B, dtype=torch.long,
                                                                                         device=engine.device)
        stop = torch.full((1,), int(should_stop is not None and should_stop()), dtype=nxt.dtype, device=nxt.device)
        shared = engine.share(torch.cat([nxt, stop]))  # [B tokens, stop]: one broadcast carries both
        *host, stop = shared.tolist()  # the step's one read: control flow (EOS, streaming, stop) runs on the host
        nxt = shared[:-1]  # stays on the device: the next step's input
        if stop:
            cancelled = True
            break
        if t_prefill is None:
            t_prefill = time.perf_counter()  # first token known everywhere: prefill done
        for b, t in enumerate(host):
            if done[b]:
                continue
            if t in eos_ids:
                done[b] = True
                continue
            out[b].append(t)
            if on_token:
                on_token(b, t)
        if all(done) or step == steps - 1:
            break
        logits = engine.forward_last(nxt[:, None], P + step)
    t_end = time.perf_counter()
    t_prefill = t_prefill or t_end
    return GenerationResult(out, sum(len(p) for p in prompts), t_prefill - t0, t_end - t_prefill, cancelled)
