"""A prompt's own log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): each token after the
first under the model's distribution given the tokens before it, and the N most likely there. The prompt goes
through the engine in chunks on a cache of its own, so at most `SCORE_CHUNK` positions' logits exist at once; each
chunk is packed as the sampler packs a step's (the chosen one's and the top-N's float32 bits, then the top-N's ids),
so the head's rank sends [positions, 1 + 2N] values, never the logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe.generation.sampler import logprob_bits, unpack_logprobs

SCORE_CHUNK = 512  # positions whose logits exist at once: [512, V] in fp32, 311 MB at a 152k-token vocabulary


def prompt_scores(forward: Callable[[torch.Tensor, int], torch.Tensor | None],
                  share: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], top: int,
                  device: torch.device) -> list[tuple[float, list[tuple[int, float]]]]:
    """`forward(tokens [1, S], start)`: logits [1, S, V] of the next chunk on the prompt's cache (None off the head's
    rank); `share`: the head's packed values to every rank."""
    rows: list[list[int]] = []
    for start in range(0, len(prompt) - 1, SCORE_CHUNK):
        end = min(start + SCORE_CHUNK, len(prompt) - 1)  # positions start..end-1 foretell tokens start+1..end
        logits = forward(torch.tensor([prompt[start:end]]), start)
        following = prompt[start + 1:end + 1]
        packed = (pack(logits[0], following, top) if logits is not None else
                  torch.empty(len(following), 1 + 2 * top, dtype=torch.long, device=device))
        rows += share(packed).tolist()
    return [unpack_logprobs(row, top) for row in rows]


def pack(logits_SV: torch.Tensor, following: list[int], top: int) -> torch.Tensor:
    """[S, 1 + 2 * top] int64: position i's log-probability of following[i], and the `top` best (bits, then ids)."""
    following_S = torch.tensor(following, dtype=torch.long, device=logits_SV.device)
    return torch.cat(logprob_bits(logits_SV.float().log_softmax(dim=-1), following_S, top), dim=1)
