"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`): an answer held to a JSON schema, a
regular expression, a choice of strings or a Lark grammar. Each step the row's grammar matcher says which tokens may
come next and every other one is masked before the penalties; the token drawn moves the matcher on. Grammars and
masks are llguidance's (the library behind vLLM's `guidance` backend), an extra: pip install 'moe-shard[structured]'.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One of: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (strings), `grammar` (Lark, or
    llama.cpp's GBNF) or `json_object=True` (any JSON object), as vLLM's class of this name.
    `disable_any_whitespace`: JSON without optional whitespace (vLLM's; a small model may otherwise write whitespace
    at length)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes one of {', '.join(KINDS)}, got {given or 'none'}")
        if isinstance(self.json, dict):  # kept as text (properties in their order): the params stay hashable
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value: object) -> StructuredOutputsParams:
        """From a dict of the fields (a request's `structured_outputs`), or as given."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or not set(value) <= {f.name for f in fields(cls)}:
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}")
        return cls(**value)

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar."""
        matcher = llguidance().LLMatcher
        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else '{"type": "object"}'
            try:
                return matcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not a JSON schema: {e}") from None
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        try:  # Lark, or llama.cpp's GBNF (converted to Lark)
            return llguidance().grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar: {' '.join(str(e).split())}") from None


def llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install 'moe-shard[structured]'") from None
    return llguidance


@functools.lru_cache(maxsize=8)
def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the checkpoint's tokenizer.json (made once per tokenizer: it reads every token)."""
    backend = getattr(tokenizer, "tok", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise ValueError("structured outputs need the checkpoint's tokenizer.json (this one has only tokenizer.model)")
    eos = tokenizer.eos_id
    return llguidance().LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


def check_structured(spec: StructuredOutputsParams, tokenizer, vocab_size: int) -> None:
    """A grammar that does not compile is refused where the request is made, in one line."""
    error = llguidance().LLMatcher.validate_grammar(spec.grammar_text(), grammar_tokenizer(tokenizer, vocab_size))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs: {' '.join(line.strip() for line in error.splitlines())}")


def matchers_for(params: list, tokenizer, vocab_size: int, given: list | None = None) -> list:
    """Each row's grammar matcher: the one it has (a server's sequence, resumed in a new batch), a new one where its
    params ask for structured output, else None."""
    given = given or [None] * len(params)
    return [m if m is not None or p.structured_outputs is None else
            llguidance().LLMatcher(grammar_tokenizer(tokenizer, vocab_size), p.structured_outputs.grammar_text())
            for p, m in zip(params, given, strict=True)]


def end_ids(params, eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a row: the EOS ids and its stop ids (allowed where its answer may end)."""
    return tuple(eos) + tuple(params.stop_token_ids)


def grammars_for(params: list, tokenizer, vocab_size: int, eos: tuple[int, ...], device: torch.device,
                 given: list | None = None) -> Grammars | None:
    """A batch's grammars on the head's rank (None where no row asks): the rows' matchers, `given` ones kept."""
    if not any(p.structured_outputs for p in params):
        return None
    return Grammars(matchers_for(params, tokenizer, vocab_size, given), [end_ids(p, eos) for p in params],
                    vocab_size, device)


def move(matcher, token: int, ends: tuple[int, ...]) -> None:
    """A row's drawn token moves its matcher on (an end id ends the row instead)."""
    if matcher is not None and token not in ends and not matcher.is_stopped():
        matcher.consume_token(token)


class Grammars:
    """The grammar matchers of a batch's rows (None where a row has none), each step's mask of the tokens they
    allow, and their moves. Where the answer may end, the row's end ids (its EOS, stop ids) are allowed too."""

    def __init__(self, matchers: list, ends: list[tuple[int, ...]], vocab_size: int, device: torch.device) -> None:
        self.matchers, self.ends, self.V, self.device = matchers, ends, vocab_size, device
        self.bits = torch.arange(8, dtype=torch.uint8)

    def mask(self, logits_BV: torch.Tensor) -> torch.Tensor:
        allowed_BV = torch.ones(len(self.matchers), self.V, dtype=torch.bool)
        for b, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            packed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
            allowed_BV[b] = ((packed[:, None] >> self.bits) & 1).flatten()[:self.V].bool()
            if matcher.is_accepting():
                allowed_BV[b, list(self.ends[b])] = True
        return logits_BV.masked_fill(~allowed_BV.to(self.device, non_blocking=True), float("-inf"))

    def consume(self, tokens: list[int]) -> None:
        for matcher, token, ends in zip(self.matchers, tokens, self.ends, strict=True):
            move(matcher, token, ends)
