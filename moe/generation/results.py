"""What `generate` and `chat` return: one result per prompt that reads as its text (or, for token-id prompts, as
its new ids), so `print(model.generate([...])[0])` shows what it did before, and carries how it came about."""

from __future__ import annotations

from dataclasses import dataclass

from moe.generation.loop import RowOutput
from moe.generation.params import SamplingParams
from moe.generation.text import cut_at_stop
from moe.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the `top` most likely (id, log-probability), best first, from the
    model's distribution before penalties, temperature and filters (vLLM's default)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class _Outcome:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence, a stop string or stop token) or "length"
    stop_reason: str | int | None  # the stop string or stop token id that ended it; None otherwise
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int
    seed: int  # the seed its samples were drawn with
    # with prompt_logprobs=N: None for the first prompt token, then each one's (vLLM's `prompt_logprobs`)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def _fill(self, token_ids, finish_reason, stop_reason, logprobs, prompt_tokens, seed) -> None:
        self.token_ids, self.finish_reason, self.stop_reason = list(token_ids), finish_reason, stop_reason
        self.logprobs, self.prompt_tokens, self.seed = logprobs, prompt_tokens, seed

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Completion(_Outcome, str):
    """The new text of a text prompt (a `str`), with `token_ids`, `finish_reason`, `stop_reason`, `logprobs`,
    `prompt_tokens` and `seed`."""

    def __new__(cls, text: str = "", token_ids=(), finish_reason: str = "length", stop_reason=None, logprobs=None,
                prompt_tokens: int = 0, seed: int = 0) -> Completion:
        self = str.__new__(cls, text)
        self._fill(token_ids, finish_reason, stop_reason, logprobs, prompt_tokens, seed)
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __reduce__(self):
        return (Completion, (self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs,
                             self.prompt_tokens, self.seed), {"prompt_logprobs": self.prompt_logprobs})


class TokenCompletion(_Outcome, list):
    """The new token ids of a token-id prompt (a `list`), with the same fields as `Completion`; `text` is their
    text when the checkpoint has a tokenizer, else None."""

    def __init__(self, token_ids=(), finish_reason: str = "length", stop_reason=None, logprobs=None,
                 prompt_tokens: int = 0, seed: int = 0, text: str | None = None) -> None:
        list.__init__(self, token_ids)
        self._fill(token_ids, finish_reason, stop_reason, logprobs, prompt_tokens, seed)
        self.text = text


def to_results(tokenizer: Tokenizer | None, prompts: list[list[int]], rows: list[RowOutput],
               row_params: list[SamplingParams], is_text: bool,
               scores: list | None = None) -> list[Completion] | list[TokenCompletion]:
    """The loop's rows as results; text (decoded after its prompt, cut before a stop string) where a tokenizer is;
    `scores`: each prompt's packed prompt log-probabilities (`Engine.prompt_logprobs`), where asked."""
    out = []
    for b, (prompt, row, params) in enumerate(zip(prompts, rows, row_params, strict=True)):
        logprobs = None if row.logprobs is None else [TokenLogprob(t, lp, tuple(top))
                                                      for t, (lp, top) in zip(row.tokens, row.logprobs, strict=True)]
        text = None
        if tokenizer is not None:
            text = tokenizer.decode_continuation(prompt, row.tokens, params.skip_special_tokens)
            unchecked = 0  # the text of the first min_tokens tokens, where no stop string is looked for
            if params.stop and params.min_tokens:
                first = row.tokens[:params.min_tokens]
                unchecked = len(tokenizer.decode_continuation(prompt, first, params.skip_special_tokens))
            text, _ = cut_at_stop(text, params.stop, unchecked, params.include_stop_str_in_output)
        fields = (row.tokens, row.finish_reason, row.stop_reason, logprobs, len(prompt), params.seed)
        out.append(Completion(text, *fields) if is_text else TokenCompletion(*fields, text=text))
        if params.prompt_logprobs is not None:
            out[-1].prompt_logprobs = [None] + [TokenLogprob(t, lp, tuple(top[:params.prompt_logprobs]))
                                                for t, (lp, top) in zip(prompt[1:], scores[b], strict=True)]
    return out
