"""A batch's decode steps without the modules' checks of which path runs: `Attention.one_op_operands` and
`MoEFeedForward.one_op_operands` are asked once, at the batch's first decode step, and every later step calls the
block's two ops (`models.kernels.decode_block`) with what they gave, the halves that take another path through
their modules as `Block.forward` does. Why: a `qwen3-moe` step (bf16, 8 blocks, 2-core AMD EPYC Zen 4) spent
0.3 ms in those checks and the modules' calls, and each stretch of Python before an op made the op itself about 17
us slower (replayed ops with 15 us of Python before each: 0.5 ms a step slower, not 0.23).

What the checks read stays the same over a batch: the weights, the kernels, the hooks, the batch size and the
caches' layout. The engine makes a plan for each batch and drops it when its caches or padding change
(`moe.engine.local.LocalEngine`); steps whose tokens include padding, and a prompt's, run through the modules.
"""

from __future__ import annotations

import torch

from models.attention import Attention, AttentionContext, Padding
from models.basic import hooked
from models.kernels import decode_block
from models.kv_cache import KVCache
from models.transformer import Transformer


class DecodePlan:
    def __init__(self, model: Transformer, caches: dict[str, KVCache], padding: Padding | None) -> None:
        self.model, self.caches, self.padding = model, caches, padding
        self.hooked = hooked(model, *model.layers.values())  # steps then go through `Transformer.forward`, hooks run
        # per block: (name, block, the attention half's operands or None, whether it attends fully, the
        # feed-forward half's or None); made at the first step
        self.blocks: list[tuple] | None = None

    def runs(self, tokens_BS: torch.Tensor, start: int) -> bool:
        """A decode step of this batch: one token per sequence after the prompts, no padding among them."""
        return tokens_BS.shape[1] == 1 and start > 0 and (self.padding is None or start >= self.padding.longest) and \
            not self.hooked

    def logits(self, tokens_B1: torch.Tensor, start: int) -> torch.Tensor:
        """[B, V]: `Transformer.forward(tokens, start, caches, padding, last_only=True)[:, -1]`, the same bits."""
        model = self.model
        h = model.embed(tokens_B1)
        ctx = AttentionContext.build(model.cfg, model.rotary, h.shape[0], 1, start, self.padding, h.device, h.dtype)
        if self.blocks is None:
            self.blocks = [self._gather(name, block, h, ctx) for name, block in model.layers.items()]
        for name, block, attention, full, feed in self.blocks:
            cache = self.caches[name]
            if attention is None:
                h = block.attend(h, ctx, cache)
            else:
                h = Attention.add_with(h, attention, ctx.for_block(full), cache)
            h = block.feed(h, True) if feed is None else decode_block.add_routed_experts(h, *feed)
        return model.head(h)[:, -1]

    def _gather(self, name: str, block, h: torch.Tensor, ctx: AttentionContext) -> tuple:
        attention, full, feed = None, False, None
        if block.residual == 1.0:  # GraniteMoE scales each branch before adding it: its blocks keep the modules
            feed = block.feed_forward.one_op_operands(h, block.ffn_norm, True)
            if isinstance(block.attention, Attention):
                full = block.attention.full
                attention = block.attention.one_op_operands(h, block.attention_norm, ctx.for_block(full),
                                                            self.caches[name])
        return name, block, attention, full, feed
