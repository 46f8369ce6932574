"""SentencePiece tokenizer beside the weights, plus an incremental decoder for streaming text."""

from __future__ import annotations

from pathlib import Path

from moe.checkpoint.files import CheckpointError


class Tokenizer:
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
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_id, *ids] if bos and self.bos_id >= 0 else ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class IncrementalDecoder:
    """Turns a growing list of token ids into new text pieces.

    SentencePiece decodes a piece differently depending on its neighbours (leading spaces, byte-fallback
    pieces of one UTF-8 character), so decode the whole tail and emit only what is new and complete.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character; wait for its other bytes
        new, self.emitted = text[len(self.emitted):], text
        return new
