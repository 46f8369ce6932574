"""Language-model quality on a text: nats per token and bits per byte.

The text's documents (separated by empty lines) become one token stream, each document opened by BOS and
closed by EOS. The stream is cut into consecutive windows of `seq_len` predicted tokens; every token but the
first is predicted exactly once. Bits per byte divides the total loss (every predicted token, EOS and BOS
included) by the UTF-8 size of the documents, so it compares across tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe.progress import Progress, silent
from moe.tokenizer import Tokenizer


def token_stream(docs: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:  # each document between the tokenizer's BOS and EOS, where it has them
        ids.extend(t for t in [tokenizer.bos_id] if t is not None)
        ids.extend(tokenizer.encode(doc, bos=False))
        ids.extend(t for t in [tokenizer.eos_id] if t is not None)
    return torch.tensor(ids, dtype=torch.int32)


def windows(stream: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Consecutive windows of seq_len + 1 tokens overlapping by one (the last may be shorter)."""
    return [stream[s:s + seq_len + 1] for s in range(0, stream.numel() - 1, seq_len)]


@dataclass(frozen=True)
class Score:
    nats: float  # total
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes of the text scored

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes


@torch.no_grad()
def score_windows(logits_fn: Callable[[torch.Tensor], torch.Tensor], wins: list[torch.Tensor], batch: int,
                  progress: Progress | None = None, bytes_per_token: float | None = None) -> tuple[float, int]:
    """Sum of next-token losses (nats) and the number of predicted tokens; batches windows of equal length.
    `progress` counts windows, with the running bits per byte when `bytes_per_token` is known."""
    nats, count = 0.0, 0
    by_length: dict[int, list[torch.Tensor]] = {}
    for w in wins:
        by_length.setdefault(w.numel(), []).append(w)
    for group in by_length.values():
        for i in range(0, len(group), batch):
            rows = torch.stack(group[i:i + batch]).long()
            logits = logits_fn(rows[:, :-1]).float()
            targets = rows[:, 1:].to(logits.device).reshape(-1)
            nats += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum"))
            count += rows[:, 1:].numel()
            if progress is not None:
                bpb = nats / math.log(2) / (count * bytes_per_token) if bytes_per_token else None
                progress.update(len(rows), **({"bits/byte": f"{bpb:.4f}"} if bpb is not None else {}))
    return nats, count


def score_text(logits_fn: Callable[[torch.Tensor], torch.Tensor], docs: list[str], tokenizer: Tokenizer,
               seq_len: int, batch: int = 8, progress: Progress | None = None) -> Score:
    stream = token_stream(docs, tokenizer)
    wins = windows(stream, seq_len)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    with progress or silent() as shown:
        shown.start(len(wins))
        nats, tokens = score_windows(logits_fn, wins, batch, shown, n_bytes / max(stream.numel() - 1, 1))
    return Score(nats, tokens, n_bytes)
