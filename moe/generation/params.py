"""One request's sampling parameters, named as in vLLM's `SamplingParams`, checked where the call is made."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, replace

from moe.generation.structured import StructuredOutputsParams, check_structured

MAX_LOGPROBS = 20  # as vLLM's default limit and OpenAI's top_logprobs
DEFAULT_MAX_NEW_TOKENS = 64
SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes any 64-bit value; keep it one JSON-safe signed integer


@dataclass(frozen=True)
class SamplingParams:
    """What one prompt's generation does. `temperature` 0 is greedy; `top_k` 0 (or -1, vLLM's spelling) and
    `top_p` 1 and `min_p` 0 are off. Penalties: `repetition_penalty` divides positive (multiplies negative) logits
    of every token in the prompt or the output (transformers' and vLLM's definition); `presence_penalty` and
    `frequency_penalty` subtract from the logits of output tokens once and per occurrence (OpenAI's). `stop`
    strings end the text right before the first one; `stop_token_ids` end it without the token. `logprobs=N`:
    the chosen token's log-probability and the N most likely tokens', from the model's raw distribution.
    `skip_special_tokens` leaves special tokens' text (e.g. `<|im_end|>`) out of the text, as vLLM does by default.
    `min_tokens`: no end-of-sequence or stop token can be drawn, nor a stop string end the text, before this many
    new tokens (vLLM's; transformers' `min_new_tokens`). `include_stop_str_in_output` ends the text after the stop
    string rather than before it (vLLM's). `logit_bias` ({token id: bias in [-100, 100]}, OpenAI's) is added to the
    raw logits before the penalties (vLLM's and transformers' order); the log-probabilities stay the raw ones.
    `allowed_token_ids` (vLLM's): only these tokens can be drawn, every other one masked before the penalties.
    `truncate_prompt_tokens=K` (vLLM's): only the prompt's last K tokens are read (-1: the model's context length).
    `bad_words` (vLLM's): words the answer may not write; a word's last token is held back wherever the answer's
    last tokens spell the rest of it (each word tokenized as it reads alone and after a space, as vLLM does);
    `bad_words_ids` (transformers'): the same as token-id sequences. `structured_outputs` (vLLM's): the answer held
    to a JSON schema, a regex, a choice or a grammar (`moe.generation.structured.StructuredOutputsParams`, or its
    fields as a dict).
    `prompt_logprobs=N`: each prompt token's log-probability given the ones before it, and the N most likely
    (vLLM's; one more forward pass over the prompt).
    `seed` drives this prompt's own random stream: its samples do not depend on the rest of the batch; None (the
    default, as vLLM's) draws a fresh one where the request runs. `max_tokens` is vLLM's name for `max_new_tokens`:
    either may be given (`SamplingParams(temperature=0.8, max_tokens=32)`); it is read as `max_new_tokens`."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | dict | None = None
    prompt_logprobs: int | None = None
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None) -> None:
        """A bad value is refused in one line naming it and its range, before any rank sees it."""
        if max_tokens is not None:
            _integer("max_tokens", max_tokens)
            _within("max_tokens", max_tokens, 1, math.inf, "at least 1")
            if self.max_new_tokens not in (DEFAULT_MAX_NEW_TOKENS, max_tokens):
                raise ValueError(f"max_tokens={max_tokens} and max_new_tokens={self.max_new_tokens}: give one "
                                 "(max_tokens is vLLM's name for max_new_tokens)")
            object.__setattr__(self, "max_new_tokens", max_tokens)
        for name in ("max_new_tokens", "top_k", "min_tokens"):
            _integer(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name))
        _within("max_new_tokens", self.max_new_tokens, 1, math.inf, "at least 1")
        _within("temperature", self.temperature, 0, math.inf, ">= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _within("top_k", self.top_k, -1, math.inf, ">= 0 (0 or -1: off)")
        _within("min_p", self.min_p, 0, 1, "in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        _within("presence_penalty", self.presence_penalty, -2, 2, "in [-2, 2]")
        _within("frequency_penalty", self.frequency_penalty, -2, 2, "in [-2, 2]")
        if self.seed is not None:
            _integer("seed", self.seed)
            _within("seed", self.seed, 0, SEED_LIMIT - 1, "in [0, 2**63)")
        _within("min_tokens", self.min_tokens, 0, self.max_new_tokens, f"in [0, max_new_tokens={self.max_new_tokens}]")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _biases(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise ValueError("allowed_token_ids must name at least one token (None: every token)")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        kept_length(self.truncate_prompt_tokens, math.inf)
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of words (strings that are not blank), got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        if not isinstance(self.bad_words_ids, (list, tuple)) or not all(self.bad_words_ids):
            raise ValueError(f"bad_words_ids must be a list of token-id sequences, got {self.bad_words_ids!r}")
        object.__setattr__(self, "bad_words_ids", tuple(_token_ids(w, "bad_words_ids") for w in self.bad_words_ids))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name))
                _within(name, getattr(self, name), 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _integer(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _number(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _within(name: str, value: float, low: float, high: float, says: str) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be {says}, got {value}")


def _stop_strings(stop: object) -> tuple[str, ...]:
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def _token_ids(ids: object, name: str = "stop_token_ids") -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                     for i in ids):
        raise ValueError(f"{name} must be a list of token ids (integers >= 0), got {ids!r}")
    return tuple(ids)


def _biases(bias: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as integers, or as the decimal strings of OpenAI's JSON), kept as sorted pairs: the
    params stay hashable and picklable for the ranks."""
    if bias is None:
        return ()
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        out = {int(i) if isinstance(i, str) and i.strip().isdigit() else i: v for i, v in pairs}
    except (TypeError, ValueError):
        out = None
    if out is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in out):
        raise ValueError(f"logit_bias must map token ids (integers >= 0) to numbers, got {bias!r}")
    for i, v in out.items():
        _number(f"logit_bias[{i}]", v)
        _within(f"logit_bias[{i}]", v, -100, 100, "in [-100, 100]")
    return tuple(sorted((i, float(v)) for i, v in out.items()))


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Token ids of the parameters must be the model's: a bias on an id outside it would index past the logits."""
    for name, ids in (("logit_bias", [i for i, _ in params.logit_bias]),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("bad_words_ids", [i for word in params.bad_words_ids for i in word])):
        if bad := [i for i in ids if i >= vocab_size]:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary (size {vocab_size})")


def kept_length(keep: object, context: float) -> int | None:
    """vLLM's `truncate_prompt_tokens`: how many of a prompt's last tokens are read (None: all; -1: the context)."""
    if keep is None:
        return None
    _integer("truncate_prompt_tokens", keep)
    if keep == 0 or keep < -1:
        raise ValueError(f"truncate_prompt_tokens must be at least 1 (or -1: the model's context), got {keep}")
    if keep > context:
        raise ValueError(f"truncate_prompt_tokens must be at most the model's context length ({context}), got {keep}")
    return context if keep == -1 else keep


def prepared(ids: list[list[int]], rows: list[SamplingParams], vocab_size: int, context: int,
             tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts and their rows as an engine takes them: each prompt's last `truncate_prompt_tokens`, each row's
    `bad_words` as token ids (by `tokenizer`), every row's token ids checked against the vocabulary."""
    if any(p.bad_words or p.structured_outputs for p in rows) and tokenizer is None:
        raise ValueError("bad_words and structured_outputs are read by the checkpoint's tokenizer, which it lacks")
    rows = [with_bad_word_ids(p, tokenizer) for p in rows]
    for spec in dict.fromkeys(p.structured_outputs for p in rows if p.structured_outputs is not None):
        check_structured(spec, tokenizer, vocab_size)
    for params in rows:
        check_vocabulary(params, vocab_size)
    kept = [kept_length(params.truncate_prompt_tokens, context) for params in rows]
    return [p[-k:] if k else p for p, k in zip(ids, kept, strict=True)], rows


def with_bad_word_ids(params: SamplingParams, tokenizer) -> SamplingParams:
    """`bad_words` tokenized into `bad_words_ids`, as vLLM does: each word as it reads alone, and after a space
    where that spells it with other tokens of the same count."""
    if not params.bad_words:
        return params
    found = list(params.bad_words_ids)
    for word in params.bad_words:
        alone = tuple(tokenizer.encode(word.lstrip(), bos=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), bos=False))
        found += [alone] + [spaced] * (spaced[0] != alone[0] and len(spaced) == len(alone))
    return replace(params, bad_words=(), bad_words_ids=tuple(dict.fromkeys(found)))


def per_prompt_seeds(seed: int | list[int] | None, prompts: int) -> list[int] | None:
    """One seed per prompt: the given one for each, or the given list; None where fresh ones are to be drawn."""
    if seed is None:
        return None
    seeds = seed if isinstance(seed, list) else [seed] * prompts
    if len(seeds) != prompts:
        raise ValueError(f"seed: {len(seeds)} seeds for {prompts} prompts; give one, or one per prompt")
    for s in seeds:
        _integer("seed", s)
        _within("seed", s, 0, SEED_LIMIT - 1, "in [0, 2**63)")
    return seeds
