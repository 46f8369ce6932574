"""llama.cpp's `convert_hf_to_gguf.py`, run so that a bench checkpoint with only a SentencePiece vocabulary converts.

The bench's random checkpoints carry the shipped model's `tokenizer.model`. llama.cpp's converters for several
families (Qwen2/3-MoE, OLMoE, GraniteMoE among them) read only a `tokenizer.json` whose pre-tokenizer hash they
know, so they stop at the vocabulary. Where the checkpoint has no `tokenizer.json`, this reads the SentencePiece
vocabulary instead; the weights, the architecture and so llama-bench's timings (it feeds random tokens) are those
of the family's own converter. Used as `python -m moe.bench.gguf_convert LLAMA_CPP_DIR CHECKPOINT [options]`.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    root = Path(argv[0])
    script = root / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's own module, from its tree

    bpe_vocab = TextModel._set_vocab_gpt2

    def vocab(self) -> None:
        if (Path(self.dir_model) / "tokenizer.json").exists():
            bpe_vocab(self)
        else:
            self._set_vocab_sentencepiece()

    TextModel._set_vocab_gpt2 = vocab
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
