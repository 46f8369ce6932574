"""Stop strings in a row's generated text, found as tokens arrive, and the text that is safe to stream.

A stop string can span several tokens and a streamed piece's boundary, so the stream holds back the text's last
(longest stop - 1) characters until the next token says whether they begin a stop string (as vLLM does). The same
object, fed the same tokens, decides on every rank that a row has stopped and what the caller's stream shows.
"""

from __future__ import annotations

from collections.abc import Callable

from moe.generation.params import SamplingParams
from moe.tokenizer import IncrementalDecoder, Tokenizer


class StopText:
    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stops: tuple[str, ...],
                 skip_special_tokens: bool = True, min_tokens: int = 0, keep_stop: bool = False) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt, skip_special_tokens)
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.text, self.emitted, self.searched = "", 0, 0
        self.hit: str | None = None
        self.unchecked = min_tokens  # tokens whose text no stop string may end (vLLM's min_tokens)
        self.keep_stop = keep_stop  # the text ends after the stop string (vLLM's include_stop_str_in_output)

    @classmethod
    def of(cls, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams) -> StopText:
        return cls(tokenizer, prompt, params.stop, params.skip_special_tokens, params.min_tokens,
                   params.include_stop_str_in_output)

    def push(self, token: int) -> str:
        """Text to stream after `token` (maybe ""); `self.hit` is the stop string once one is found."""
        if self.hit is not None:
            return ""
        self.text += self.decoder.push(token)
        # each stop string where it may end in the new text; none before min_tokens tokens (as vLLM checks)
        found = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, self.searched - len(s) + 1))) >= 0] \
            if self.unchecked <= 0 else []
        self.unchecked -= 1
        self.searched = len(self.text)
        if found:
            at, self.hit = min(found)
            self.text = self.text[:at + len(self.hit) if self.keep_stop else at]
            return self.rest()
        end = max(self.emitted, len(self.text) - self.hold)
        piece, self.emitted = self.text[self.emitted:end], end
        return piece

    def rest(self) -> str:
        """What the stream still holds back (at the row's end; with an incomplete last character's mark, as the
        returned text has it)."""
        if self.hit is None:
            self.text += self.decoder.flush()
        piece, self.emitted = self.text[self.emitted:], len(self.text)
        return piece


def cut_at_stop(text: str, stops: tuple[str, ...], unchecked: int = 0, keep_stop: bool = False
                ) -> tuple[str, str | None]:
    """`text` up to the first stop string that ends past its first `unchecked` characters (the text of the first
    min_tokens tokens, where none is looked for), or through it where `keep_stop`, and that string (None if none
    occurs)."""
    found = [(i, s) for s in stops if (i := text.find(s, max(0, unchecked - len(s) + 1))) >= 0]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at + len(stop) if keep_stop else at], stop


class TextStreams:
    """A caller's streamer fed text pieces (text prompts) or token ids (token-id prompts) as tokens arrive."""

    def __init__(self, tokenizer: Tokenizer | None, prompts: list[list[int]], rows: list[SamplingParams],
                 streamer: Callable[[int, str | int], None], is_text: bool) -> None:
        self.streamer = streamer
        self.texts = [StopText.of(tokenizer, p, params) for p, params in zip(prompts, rows, strict=True)] \
            if is_text else None

    def on_token(self, b: int, token: int) -> None:
        if self.texts is None:
            self.streamer(b, token)
        elif piece := self.texts[b].push(token):
            self.streamer(b, piece)

    def finish(self) -> None:
        """What was held back for stop strings, at the end."""
        for b, text in enumerate(self.texts or []):
            if piece := text.rest():
                self.streamer(b, piece)
