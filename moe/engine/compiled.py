"""The one-rank decode step compiled: `torch.compile` of `Transformer.decode_step`, whose shapes never change
within a request, so it compiles once per batch size and cache length and then runs as one graph.

On CPU inductor fuses the step's small operations (norms, rotary, routing, the weighted sum) around the streaming
kernel (an opaque op to it, `models.matvec`); on CUDA, `mode="reduce-overhead"` captures the step as a CUDA graph
(never run on CUDA yet). Caches are kept from one request to the next and their length rounded up to
`CACHE_BUCKET` slots, so a new request of the same batch size reuses both the cache and the compiled graph (the
mask hides slots past the current one, which may hold an earlier request's keys).
"""

from __future__ import annotations

import torch

from models.attention import KVCache
from models.transformer import Transformer

CACHE_BUCKET = 256  # cache lengths are multiples of this: few shapes, each a compile; at most 255 slots unused


def compile_step(step, device: torch.device):
    """`step` compiled as a decode step is: one graph of static shapes; on CUDA a CUDA graph, on CPU called from a
    C++ wrapper (0.3-0.5 ms less per step than inductor's Python one)."""
    if device.type == "cuda":
        return torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead")
    return torch.compile(step, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


class CompiledDecode:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.device = model.norm.weight.device
        self.step = compile_step(model.decode_step, self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # the step's cache slot, set in place
        self.caches: dict[str, KVCache] | None = None

    def caches_for(self, batch: int, length: int) -> dict[str, KVCache]:
        """Caches of at least `length` slots (rounded up to the bucket, within the model's context), kept when a
        request of the same shape comes next."""
        length = max(length, min(-(-length // CACHE_BUCKET) * CACHE_BUCKET, self.model.cfg.max_seq_len))
        current = next(iter(self.caches.values())).k.shape if self.caches else None
        if current is None or current[0] != batch or current[2] != length:
            self.caches = None  # free the old caches before allocating new ones
            self.caches = self.model.make_caches(batch, length)
            if self.device.type == "cuda":  # written in place inside the CUDA graph: their addresses never change
                for cache in self.caches.values():
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
        return self.caches

    def __call__(self, tokens_B1: torch.Tensor, start: int, pad_B: torch.Tensor | None) -> torch.Tensor:
        self.slot.fill_(start)
        return self.step(tokens_B1, self.slot, self.caches, pad_B)
