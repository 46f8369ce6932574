"""A prompt's own log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): each token after the
first under the model's distribution given the tokens before it, and the N most likely there. Packed as the sampler
packs a step's (the chosen one's and the top-N's float32 bits, then the top-N's ids), so the head's rank sends a
[tokens, 1 + 2N] tensor, never the logits."""

from __future__ import annotations

import torch

from moe.generation.sampler import unpack_logprobs


def pack_prompt_logprobs(logits_SV: torch.Tensor, prompt: list[int], top: int) -> torch.Tensor:
    """[S - 1, 1 + 2 * top] int64 from a prompt's logits [S, V] (row i: token i + 1 given the tokens up to i)."""
    logp_SV = logits_SV[:-1].float().log_softmax(dim=-1)
    chosen = logp_SV.gather(1, torch.tensor(prompt[1:], dtype=torch.long, device=logp_SV.device)[:, None])
    best = logp_SV.topk(top, dim=-1)
    return torch.cat([torch.cat([chosen, best.values], dim=1).view(torch.int32).long(), best.indices], dim=1)


def prompt_width(top: int) -> int:
    return 1 + 2 * top


def unpack_prompt_logprobs(packed: list[list[int]], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    return [unpack_logprobs(row, top) for row in packed]
