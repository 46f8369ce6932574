"""A thinking model's reasoning kept apart from its answer, as vLLM's `--reasoning-parser` and llama-server's
`--reasoning-format` do: Qwen3 and DeepSeek-R1 write `<think> ... </think>` before the answer, and the chat response
carries the first as the message's `reasoning` (vLLM's name; `reasoning_content` too, DeepSeek's and llama-server's)
and the rest as its `content`, whole or streamed alike.

Where the reasoning is: from the start of the answer when the answer opens with `<think>`, or when the prompt left a
`<think>` open (templates of thinking models that write it into the prompt), or always (`deepseek_r1`: R1 is made
to think first); up to the first `</think>`. An answer that never opens one is all content, one that never closes
it all reasoning (cut short). The tags themselves are in neither."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names for the two readings


class ReasoningSplit:
    """Text pieces in, (reasoning, content) pieces out; text that may be the beginning of a tag waits for the next
    piece, and `finish` gives what waited."""

    def __init__(self, parser: str, prompt_text: str) -> None:
        self.reasoning = parser == "deepseek_r1" or prompt_text.rfind(START) > prompt_text.rfind(END)
        self.decided = False  # whether the answer's start was read (a leading <think>, or not)
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        if not self.decided:
            opening = text.lstrip()
            if START.startswith(opening) and len(opening) < len(START):  # "", "<", "<thi", ...: not yet known
                self.held = text
                return "", ""
            self.decided = True
            if opening.startswith(START):
                self.reasoning, text = True, opening[len(START):]
        if not self.reasoning:
            return "", text
        if END in text:
            self.reasoning = False
            thought, _, answer = text.partition(END)
            return thought, answer
        keep = _tag_start_at_end(text, END)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return (held, "") if self.reasoning else ("", held)

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content), None for an empty part, as vLLM's parsers return them."""
        thought, answer = self.feed(text)
        more_thought, more_answer = self.finish()
        return (thought + more_thought) or None, (answer + more_answer) or None


def _tag_start_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text that may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
