"""Batched generation over any engine: left padding, prefill, then one token per step.

The loop is the same on one rank and on N: a stepper (an engine's stepping half) runs the forward
pass (the head's rank gets the logits, other ranks None) and shares the sampled tokens from the head's
rank, so every rank takes the same control-flow decisions (continue, stop at EOS) from the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moe.generation.params import SamplingParams
from moe.generation.sampler import Sampler, packed_width, top_logprobs, unpack_logprobs
from moe.generation.structured import grammars_for
from moe.generation.text import StopText
from moe.tokenizer import Tokenizer


class Stepper(Protocol):
    """What the generation loop needs of an engine: a cache, a forward pass of new tokens, and the sampled
    tokens shared from the rank that holds the head (logits are None on the other ranks)."""

    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        """A request of `batch` sequences, `length` cache slots each, left-padded by pad_B (CPU)."""

    def forward_last(self, tokens_BS: torch.Tensor, start: int) -> torch.Tensor | None: ...

    def share(self, decided: torch.Tensor) -> torch.Tensor:
        """The head's rank's `decided` (here: [B tokens, stop flag]) on every rank, on the engine's device."""

    @property
    def alone(self) -> bool:
        """No other rank takes part: what this one decides needs no sharing."""

    @property
    def device(self) -> torch.device: ...


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return tokens, pad


def prompt_batch(prompts: object) -> tuple[list[str] | list[list[int]], bool]:
    """Prompts as vLLM's `LLM.generate` and OpenAI's `prompt` take them (a text, texts, token ids, lists of them) as
    a batch, and whether it is text; anything else is refused naming what it got (the server's and `generate`'s)."""
    def ids(p: object) -> bool:
        return isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompts, str):
        prompts = [prompts]
    elif ids(prompts) and prompts:
        prompts = [list(prompts)]
    if isinstance(prompts, list) and all(isinstance(p, str) for p in prompts):
        return prompts, bool(prompts)
    if isinstance(prompts, list) and all(ids(p) for p in prompts):
        return [list(p) for p in prompts], False
    kinds = sorted({type(p).__name__ for p in prompts}) if isinstance(prompts, list) else [type(prompts).__name__]
    hint = " (a tensor of ids: pass .tolist())" if hasattr(prompts, "tolist") else ""
    raise TypeError(f"prompts must be a text, a list of texts, a list of token ids, or a list of such lists; got "
                    f"{'a list of ' if isinstance(prompts, list) else ''}{' and '.join(kinds)}{hint}")


def batch_of_prompts(prompts: object) -> tuple[list[str] | list[list[int]], bool]:
    """`generate`'s prompts as a batch (`prompt_batch`), no text empty."""
    prompts, is_text = prompt_batch(prompts)
    for i, p in enumerate(prompts if is_text else ()):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    return prompts, is_text


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
class RowOutput:
    """One prompt's generation: its new tokens (no EOS or stop token), why it ended ("stop": an end-of-sequence
    id, a stop token or a stop string; "length": its max_new_tokens or the context), the stop string or stop
    token that ended it, and per token (log-probability, [(id, log-probability)] of the N most likely)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class GenerationResult:
    rows: list[RowOutput]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cancelled: bool = False  # stopped on request (every rank stopped at the same step)

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.rows]

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


class Rows:
    """The host's bookkeeping of a batch: each row's tokens and end, decided from the shared tokens alone, so
    every rank decides alike (the stop strings through every rank's own copy of the tokenizer)."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], eos: tuple[int, ...],
                 tokenizer: Tokenizer | None) -> None:
        self.params, self.eos = params, eos
        self.out = [RowOutput(logprobs=[] if p.logprobs is not None else None) for p in params]
        if any(p.stop for p in params) and tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer (tokenizer.json or tokenizer.model)")
        self.texts = [StopText.of(tokenizer, prompt, p) if p.stop else None
                      for p, prompt in zip(params, prompts, strict=True)]
        self.top = top_logprobs(params)
        self.width = packed_width(self.top)

    def take(self, b: int, packed: list[int], on_token: Callable[[int, int], None] | None) -> None:
        if advance(self.out[b], self.params[b], self.eos, self.texts[b], packed, self.top) is not None and on_token:
            on_token(b, packed[0])

    @property
    def done(self) -> bool:
        return all(r.finish_reason is not None for r in self.out)


def advance(row: RowOutput, params: SamplingParams, eos: tuple[int, ...], text: StopText | None, packed: list[int],
            top: int | None) -> str | None:
    """One shared token for a row: None where the row had ended or the token ends it (EOS, a stop token: not
    kept); else the token is kept and this returns the text a stream may show now ("" without a stop text). The
    row ends after it at a stop string or its max_new_tokens."""
    token = packed[0]
    if row.finish_reason is not None:
        return None
    if token in eos and not params.ignore_eos:
        row.finish_reason = "stop"
        return None
    if token in params.stop_token_ids:
        row.finish_reason, row.stop_reason = "stop", token
        return None
    row.tokens.append(token)
    if row.logprobs is not None:
        chosen, best = unpack_logprobs(packed[1:], top)
        row.logprobs.append((chosen, best[:params.logprobs]))
    piece = text.push(token) if text is not None else ""
    if text is not None and text.hit is not None:
        row.finish_reason, row.stop_reason = "stop", text.hit
    elif len(row.tokens) >= params.max_new_tokens:
        row.finish_reason = "length"
    return piece


def needs_tokenizer(params: SamplingParams | list[SamplingParams]) -> bool:
    """Whether a request has stop strings or structured outputs (and so needs the tokenizer where it runs)."""
    return any(p.stop or p.structured_outputs for p in (params if isinstance(params, list) else [params]))



def generate_tokens(engine: Stepper, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    eos: tuple[int, ...], context: int, on_token: Callable[[int, int], None] | None = None,
                    should_stop: Callable[[], bool] | None = None,
                    tokenizer: Tokenizer | None = None) -> GenerationResult:
    """Generate for a batch, each prompt under its own parameters (one for all if one is given);
    `on_token(prompt_index, token)` sees each new token as it comes. `should_stop` (asked on every rank, decided
    by the head's rank and shared with its tokens) cancels the request between two steps on every rank at once."""
    t0 = time.perf_counter()
    params = params if isinstance(params, list) else [params] * len(prompts)
    tokens, pad = left_pad(prompts)
    B, P = tokens.shape
    steps = min(max(p.max_new_tokens for p in params), context - P)
    engine.start(B, P + steps, pad)
    rows, sampler, cancelled, t_prefill = Rows(params, prompts, eos, tokenizer), None, False, None
    logits = engine.forward_last(tokens, 0)
    for step in range(steps):
        if logits is not None and sampler is None:  # the head's rank: it samples (on the logits' device)
            sampler = Sampler(params, prompts, logits.shape[-1], logits.device, eos=eos,
                              grammars=grammars_for(params, tokenizer, logits.shape[-1], eos, logits.device))
        packed = (sampler(logits) if logits is not None
                  else torch.zeros(B, rows.width, dtype=torch.long, device=engine.device))
        host, stop, nxt = decide(engine, packed, should_stop)
        if stop:
            cancelled = True
            break
        t_prefill = t_prefill or time.perf_counter()  # first token known everywhere: prefill done
        if sampler is not None:
            sampler.update(nxt, [h[0] for h in host])
        for b in range(B):
            rows.take(b, host[b], on_token)
        if rows.done or step == steps - 1:
            break
        logits = engine.forward_last(nxt[:, None], P + step)
    for row in rows.out:
        row.finish_reason = row.finish_reason or "length"  # the context ran out
    t_end = time.perf_counter()
    t_prefill = t_prefill or t_end
    return GenerationResult(rows.out, sum(len(p) for p in prompts), t_prefill - t0, t_end - t_prefill, cancelled)


def decide(engine: Stepper, packed_BW: torch.Tensor, should_stop: Callable[[], bool] | None
           ) -> tuple[list[list[int]], bool, torch.Tensor]:
    """The step's decisions on every rank: (each row's packed values on the host, whether to stop, the next
    tokens [B] on the device). The head's rank's tokens and stop flag go out in one broadcast, read on the host
    once: control flow (EOS, streaming, stop) runs there. Alone, nothing is packed for a broadcast (three ops fewer
    a step: 30-50 us on a 2-core AMD EPYC, where a step's weights have just pushed torch's code out of the caches)."""
    stop = should_stop is not None and should_stop()
    if engine.alone:
        return packed_BW.tolist(), stop, packed_BW[:, 0]
    B, W = packed_BW.shape
    flag = torch.full((1,), int(stop), dtype=torch.long, device=packed_BW.device)
    shared = engine.share(torch.cat([packed_BW.reshape(-1), flag]))
    *host, stop = shared.tolist()
    return [host[b * W:(b + 1) * W] for b in range(B)], bool(stop), shared[:-1].view(B, W)[:, 0]
