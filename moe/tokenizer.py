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

    def decode_continuation(self, prompt: list[int], new: list[int]) -> str:
        """Text of `new` as it reads after `prompt`: SentencePiece drops a leading space at the start of a
        decode, which would glue the first new word to the prompt's last one."""
        return self.sp.decode(prompt + new)[len(self.sp.decode(prompt)):]


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

    SentencePiece decodes a piece differently depending on its neighbours (leading spaces, byte-fallback
    pieces of one UTF-8 character), so decode the whole tail after a few prompt tokens of context and emit
    only what is new and complete. The context's own text is decoded once, not per token.
    """

    CONTEXT = 4  # prompt tokens kept before the new ones: enough for the space and UTF-8 decisions

    def __init__(self, tokenizer: Tokenizer, prompt: list[int] | None = None) -> None:
        self.tokenizer, self.ids, self.emitted = tokenizer, list(prompt or [])[-self.CONTEXT:], ""
        self.context_chars = len(tokenizer.decode(self.ids))

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)[self.context_chars:]
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character; wait for its other bytes
        new, self.emitted = text[len(self.emitted):], text
        return new
