"""The tokenizer beside the weights: `tokenizer.json` through Hugging Face's `tokenizers` library (what transformers'
fast tokenizers load, and the only file most MoE checkpoints ship), else a SentencePiece `tokenizer.model`; special
tokens and whether to add BOS from `tokenizer_config.json`. Plus an incremental decoder for streaming text.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from moe.checkpoint.files import CheckpointError, mistral_tokenizers


class Tokenizer:
    """encode / decode / ids of the special tokens, whichever file backs it (`load_tokenizer`)."""

    path: Path
    bos_id: int | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str, bos: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; `skip_special_tokens` leaves out the special tokens' text (transformers' meaning)."""
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:
        """Text with special tokens written out (a rendered chat template) as ids: no BOS added, each special
        token's text its id (as transformers tokenizes `apply_chat_template`'s text)."""
        raise NotImplementedError

    @property
    def special_texts(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token, pad_token as text, where the tokenizer has them (for chat templates)."""
        raise NotImplementedError

    def is_special(self, token: int) -> bool:
        raise NotImplementedError

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            continue_final_message: bool = False, **kwargs):
        """transformers' method of this name (v5): the rendered text when `tokenize=False`, else the ids (a dict
        with `input_ids` and `attention_mask` when `return_dict`); a list of them for a list of conversations.
        `chat_template` is a template's source or the name of one of the checkpoint's named templates;
        `continue_final_message`: end inside the last message, for the model to go on with it."""
        from moe.chat.template import render

        source = self.chat_template(chat_template)
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        texts = [render(source, c, self.special_texts, add_generation_prompt, tools, documents,
                       continue_final_message, **kwargs)
                 for c in (conversation if batched else [conversation])]
        if tokenize:
            ids = [self.encode_special(t) for t in texts]
            texts = [{"input_ids": i, "attention_mask": [1] * len(i)} if return_dict else i for i in ids]
        return texts if batched else texts[0]

    def chat_template(self, given: str | None = None) -> str:
        """The template's source: `given` (the name of one of the checkpoint's named templates, or a source), else
        the checkpoint's (`moe.chat.template.find_chat_template`)."""
        from moe.chat.template import NoChatTemplate

        found, named = self._templates
        if given is not None:
            return named.get(given, given)
        if found is None:
            raise NoChatTemplate(f"{self.path.parent}: the checkpoint has no chat template (chat_template.jinja or "
                                 "tokenizer_config.json's chat_template); give one: --chat-template FILE, or "
                                 "chat_template=SOURCE")
        return found

    @functools.cached_property
    def _templates(self) -> tuple[str | None, dict[str, str]]:
        """The checkpoint's chat template and its named ones, read once: every chat call and server request asks."""
        from moe.chat.template import find_chat_template, named_templates

        return find_chat_template(self.path.parent), named_templates(self.path.parent)

    def token_text(self, token: int) -> str:
        """One token's text as it reads inside a text, for log-probability entries (vLLM's `decoded_token`): the
        leading space of a SentencePiece word, which a decode of the token alone drops, is kept, so that a
        sequence's token texts add up to its text. Decoded after an ordinary token; each id once."""
        if token not in self._token_texts:
            self._token_texts[token] = self.decode_continuation(self._anchor, [token], skip_special_tokens=False)
        return self._token_texts[token]

    @functools.cached_property
    def _token_texts(self) -> dict[int, str]:
        return {}

    @functools.cached_property
    def _anchor(self) -> list[int]:
        """An ordinary token for `token_text` to decode after."""
        return self.encode("a", bos=False)[:1]

    def decode_continuation(self, prompt: list[int], new: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `new` as it reads after `prompt`: a tokenizer may drop a leading space at the start of a
        decode, which would glue the first new word to the prompt's last one. Generated text leaves special tokens
        out by default, as vLLM, llama.cpp and transformers' pipelines do."""
        return self.decode(prompt + new, skip_special_tokens)[len(self.decode(prompt, skip_special_tokens)):]


def load_tokenizer(directory: str | Path) -> Tokenizer | None:
    """`tokenizer.json` if present (as transformers prefers its fast tokenizer), else `tokenizer.model`, else the
    newest `tokenizer.model.vN` (SentencePiece too: what mistral-inference downloads beside a consolidated
    checkpoint), else None."""
    d = Path(directory)
    if (d / "tokenizer.json").exists():
        return HFTokenizer(d / "tokenizer.json")
    if (d / "tokenizer.model").exists():
        return SentencePieceTokenizer(d / "tokenizer.model")
    versions = mistral_tokenizers(d)
    return SentencePieceTokenizer(versions[-1]) if versions else None


@functools.lru_cache(maxsize=4)
def tokenizer_of(directory: str | None) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory, read once per process: a rank reads it for stop strings."""
    return load_tokenizer(directory) if directory is not None else None


def special_tokens(directory: Path) -> dict:
    """`tokenizer_config.json`'s special tokens (as text) and `add_bos_token`, where the file says them."""
    path = directory / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from None
    out = {k: v.get("content") if isinstance(v, dict) else v for k, v in raw.items()
           if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    if "add_bos_token" in raw:
        out["add_bos_token"] = bool(raw["add_bos_token"])
    return out


class HFTokenizer(Tokenizer):
    """`tokenizer.json` through the `tokenizers` library: its ids and text. BOS comes from the file's own
    post-processor when it adds one (TemplateProcessing), else from `tokenizer_config.json` (`add_bos_token`)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as Fast

        try:
            self.tok = Fast.from_file(str(path))
        except Exception as e:  # the library raises its own exception type for a bad file
            raise CheckpointError(f"{path}: not a tokenizers file ({str(e).splitlines()[0]})") from None
        self.path = path
        self.config = config = special_tokens(path.parent)
        self.bos_id, self.eos_id = (self.tok.token_to_id(config[k]) if config.get(k) else None
                                    for k in ("bos_token", "eos_token"))
        adds = self.tok.encode("", add_special_tokens=True).ids
        self.post_adds_bos = bool(adds) and adds[0] == self.bos_id
        self.add_bos = config.get("add_bos_token", self.post_adds_bos) and self.bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=bos and self.post_adds_bos).ids
        if bos and self.add_bos and not self.post_adds_bos:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_special(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    @property
    def special_texts(self) -> dict[str, str]:
        return {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}

    def is_special(self, token: int) -> bool:
        added = self.tok.get_added_tokens_decoder().get(token)
        return added is not None and added.special


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | Path) -> None:
        import sentencepiece as spm

        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path}: tokenizer.model not found beside the weights (needed for text prompts)")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.path = path
        self.bos_id, self.eos_id = (i if i >= 0 else None for i in (self.sp.bos_id(), self.sp.eos_id()))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids past the vocabulary (a model's embedding padded beyond it) are dropped, as `tokenizers` drops them.
        A special token is its piece's text, the runs between decoded on their own (as transformers' slow
        tokenizers decode), unless skipped."""
        ids = [i for i in ids if 0 <= i < self.sp.get_piece_size()]
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if not self.is_special(i)])
        text, run = "", []
        for i in ids:
            if self.is_special(i):
                text, run = text + self.sp.decode(run) + self.sp.id_to_piece(i), []
            else:
                run.append(i)
        return text + self.sp.decode(run)

    @property
    def special_texts(self) -> dict[str, str]:
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.sp.unk_id()}
        return {k: self.sp.id_to_piece(i) for k, i in ids.items() if i is not None and i >= 0}

    def is_special(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and (self.sp.is_control(token) or self.sp.is_unknown(token))

    def encode_special(self, text: str) -> list[int]:
        """The text split at the special tokens' text (as transformers' slow tokenizers split at added tokens),
        each piece between encoded on its own."""
        specials = {t: self.sp.piece_to_id(t) for t in self.special_texts.values()}
        pattern = "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
        ids: list[int] = []
        for part in re.split(pattern, text) if specials else [text]:
            ids += [specials[part]] if part in specials else self.sp.encode(part) if part else []
        return ids


def train_tokenizer(text_file: Path, vocab_size: int, out: Path) -> None:
    """A SentencePiece BPE model with byte fallback (any text encodes), ids 0/1/2 = unk/bos/eos."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(text_file), model_prefix=str(out.with_suffix("")), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        input_sentence_size=200_000, shuffle_input_sentence=True, max_sentence_length=1 << 16, minloglevel=2,
    )
    out.with_suffix(".vocab").unlink(missing_ok=True)  # a human-readable copy nothing reads


class IncrementalDecoder:
    """Turns a growing list of token ids into new text pieces.

    A tokenizer decodes a piece differently depending on its neighbours (SentencePiece's leading spaces, the bytes
    of one UTF-8 character over several tokens), so each new token is decoded within a short window: the tokens
    since the last piece, after the ones before it as context, and only what is new and complete is emitted (as
    vLLM's and transformers' streamers do). A token costs the same at the 10th as at the 10,000th; decoding the
    whole text each time made a long answer's tokens cost more and more.
    """

    CONTEXT = 4  # prompt tokens kept before the new ones: enough for the space and UTF-8 decisions

    def __init__(self, tokenizer: Tokenizer, prompt: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.ids = tokenizer, list(prompt or [])[-self.CONTEXT:]  # the window
        self.skip = skip_special_tokens
        self.read = len(self.ids)  # the window's first token not yet emitted: the ones before it are its context
        self.known = self.decode(self.ids)  # the context's text, which the window's text begins with

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip)

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or len(text) <= len(self.known):
            return ""  # an incomplete UTF-8 character (wait for its other bytes), or no text yet
        new = text[len(self.known):]
        self.ids = self.ids[self.read:]  # the next window: this piece's tokens are its context
        self.read, self.known = len(self.ids), self.decode(self.ids)
        return new

    def flush(self) -> str:
        """At the end: what is left, an incomplete character's replacement mark included (as a decode gives it)."""
        text = self.decode(self.ids)
        new, self.read, self.known = text[len(self.known):], len(self.ids), text
        return new
