"""One rank's engine: runs its share of the model in lock-step with the other ranks.

The blocks are walked in order on every rank. The hidden states live on a set of ranks (all holding the same
values): a block's attention ranks (its owner, or its tensor group, which sums its heads by one all-reduce) attend;
then either the group that splits every expert runs them and sums by one all-reduce, or the first attention rank
routes and every rank enters the block's expert exchange (with no rows when it brings none). Between, the hidden
states go by point-to-point sends (or a broadcast over a group) to the ranks that need them and lack them. A block
with replicated attention has every rank attend and route its own rows of the batch: the batch is split before
it and gathered after it. Every `Engine` call returns the same value on every rank, so a rank process and a
torchrun process serve the same results.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from models.attention import AttentionContext, Padding
from models.kv_cache import KVCache
from models.transformer import Transformer, real_token_rows
from moe.checkpoint.distributed_save import save_distributed
from moe.engine.rows import Rows, balanced, homed
from moe.generation import GenerationResult, SamplingParams, generate_tokens, needs_tokenizer
from moe.generation.scoring import prompt_scores
from moe.memory import MemoryUse
from moe.parallel.agreement import check_routing_agrees
from moe.parallel.distributed import DistContext
from moe.parallel.gather import StepRows
from moe.parallel.placement import Placement
from moe.progress import Progress
from moe.reports.counters import local_load_stats, reset_load_stats, set_round_robin, track_entropy
from moe.tokenizer import tokenizer_of


class ShardedEngine:
    def __init__(self, model: Transformer, placement: Placement, dist: DistContext, dtype: torch.dtype,
                 step: StepRows | None = None) -> None:
        self.model, self.placement, self.dist, self.dtype = model, placement, dist, dtype
        self.step = step or StepRows()  # shared with every block's dispatcher (moe.parallel.gather)
        self.rank = dist.rank
        self.owns_group = False  # under torchrun the engine leaves the group on close()
        self.checkpoint_dir: str | None = None  # its tokenizer, read when a request has stop strings
        self.caches: dict[str, KVCache] = {}
        self.padding: Padding | None = None
        self.homes: list[Rows] | None = None  # the server's rows per rank in replicated blocks (`set_homes`)
        self._balanced: dict[int, list[Rows]] = {}
        self.my_blocks = placement.attended_by(self.rank)
        self.splits_batch = any(placement.strategy(i).attention == "replicated" for i in self.my_blocks)
        cfg = model.cfg  # what a rank sends when it has no token of its own in a block: made once, not per step
        self.no_rows = (torch.empty(0, cfg.dim, dtype=dtype, device=dist.device),
                        torch.empty(0, cfg.top_k, device=dist.device),
                        torch.empty(0, cfg.top_k, dtype=torch.long, device=dist.device))
        for i, ranks in self.routes_alike(batch=1).items():  # the blocks whose routing ranks compare
            if self.rank in ranks:
                self.model.layers[str(i)].feed_forward.checks_routing = True

    @property
    def head_rank(self) -> int:
        """The rank that gets the logits, samples and broadcasts the next tokens."""
        return self.placement.head_rank

    # -- stepping (moe.generation.Stepper) ---------------------------------------------------------
    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        cfg = self.model.cfg
        kv_heads = {str(i): self.model.layers[str(i)].attention.n_kv_heads for i in self.my_blocks}  # this rank's
        mine = self.rows_of(batch)[self.rank].count  # a replicated block caches this rank's rows of the batch only
        rows = {name: mine if self.placement.strategy(int(name)).attention == "replicated" else batch
                for name in kv_heads}
        if self.dist.device.type == "cuda":  # the user's process cannot see this GPU's free memory: check here
            self._check_kv_fits(sum(rows[k] * KVCache.bytes_per_token(cfg, self.dtype.itemsize, n)
                                    for k, n in kv_heads.items()) * length)
        self.caches = {name: KVCache.of(cfg, rows[name], length, self.dtype, self.dist.device, n)
                       for name, n in kv_heads.items()}
        self.padding = Padding.of(pad_B, self.dist.device)

    def _check_kv_fits(self, need: int) -> None:
        """Every rank compares its KV cache with its GPU's free memory; all raise the same error if one cannot
        hold it, so they stay in step (a user error: the model stays usable)."""
        free = torch.cuda.mem_get_info(self.dist.device)[0]
        short = [(r, n, f) for r, (n, f) in enumerate(self.dist.all_gather_object((need, free))) if n > f]
        if short:
            r, n, f = short[0]
            raise ValueError(f"rank {r}: a KV cache of {n / 2**30:.1f} GiB does not fit in its GPU's {f / 2**30:.1f} "
                             "GiB free; ask for fewer new tokens or fewer prompts")

    def forward_last(self, tokens_BS: torch.Tensor, start: int) -> torch.Tensor | None:
        logits = self.tokens_to_logits(tokens_BS, start, self.padding, self.caches, last_only=True)
        return logits[:, -1] if logits is not None else None

    @property
    def alone(self) -> bool:
        return self.dist.world_size == 1

    def share(self, decided: torch.Tensor) -> torch.Tensor:
        """The head's rank decided the next tokens (and whether to stop); every rank gets them, so every rank
        takes the same decisions."""
        return self.dist.broadcast(decided.to(self.dist.device), self.head_rank)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def _move(self, h: torch.Tensor | None, src: tuple[int, ...], dst: tuple[int, ...],
              shape: tuple[int, ...]) -> torch.Tensor | None:
        """The hidden states, held alike by the ranks `src`, onto the ranks `dst`: the first holder sends them to
        each rank of `dst` that lacks them (one broadcast over `dst` when that is a group and several lack them);
        holders outside `dst` let them go. Only those ranks take part."""
        if sum(d not in src for d in dst) > 1 and src[0] in dst and self.dist.has_group(dst):
            if self.rank not in dst:
                return None
            h = h if self.rank in src else torch.empty(shape, dtype=self.dtype, device=self.dist.device)
            return self.dist.broadcast(h, src[0], dst)
        if self.rank == src[0]:
            for d in dst:
                if d not in src:
                    self.dist.send(h, d)
        if self.rank not in dst:
            return None
        return h if self.rank in src else self.dist.recv(shape, self.dtype, src[0])

    def set_homes(self, homes: list[int] | None) -> None:
        """The rank that attends each row of the next calls' batch in replicated blocks (`moe.engine.rows`; the
        server's, whose sequences stay on one rank), or None: each rank a contiguous slice of any batch."""
        self.homes = None if homes is None else homed(homes, self.dist.world_size, self.dist.device)

    def split_caches(self) -> set[str]:
        """This rank's caches that hold its rows of the batch only (replicated blocks), not every row."""
        return {str(i) for i in self.my_blocks if self.placement.strategy(i).attention == "replicated"}

    def rows_of(self, batch: int) -> list[Rows]:
        """Per rank, its rows of a batch of `batch` sequences in replicated blocks."""
        if self.homes is None:
            if batch not in self._balanced:  # made once per batch size: a step's calls get the same objects
                self._balanced[batch] = balanced(batch, self.dist.world_size, self.dist.device)
            return self._balanced[batch]
        if sum(r.count for r in self.homes) != batch:
            raise ValueError(f"homes for {sum(r.count for r in self.homes)} rows, a batch of {batch}")
        return self.homes

    def _split(self, h: torch.Tensor | None, holders: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Full hidden states on `holders` -> every rank its rows of the batch (the first holder sends the others
        theirs)."""
        rows = self.rows_of(shape[0])
        if self.rank == holders[0]:
            for r, part in enumerate(rows):
                if r not in holders and part.count:
                    self.dist.send(h[part.device], r)
        mine = rows[self.rank]
        if self.rank in holders:
            return h[mine.device]
        return self.dist.recv((mine.count, *shape[1:]), self.dtype, holders[0]) if mine.count else \
            self.no_rows[0].new_empty((0, *shape[1:]))

    def _join(self, h: torch.Tensor, dst: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
        """Every rank's rows of the batch -> the full hidden states on the ranks `dst` (gathered on the first)."""
        first = dst[0]
        out = torch.empty(shape, dtype=self.dtype, device=self.dist.device) if self.rank == first else None
        for r, part in enumerate(self.rows_of(shape[0])):
            if not part.count:
                continue
            if self.rank == first:
                out[part.device] = h if r == first else self.dist.recv((part.count, *shape[1:]), self.dtype, r)
            elif self.rank == r:
                self.dist.send(h, first)
        return self._move(out, (first,), dst, shape)

    @torch.inference_mode()
    def tokens_to_logits(self, tokens_BS: torch.Tensor, start: int, padding: Padding | None,
                         caches: dict[str, KVCache] | None, last_only: bool) -> torch.Tensor | None:
        """Logits on the head's rank, None elsewhere."""
        cfg, p = self.model.cfg, self.placement
        B, S = tokens_BS.shape
        shape = (B, S, cfg.dim)
        device = self.dist.device
        h = self.model.embed(tokens_BS.to(device)) if self.rank in p.embed_ranks else None
        ctx = (AttentionContext.build(cfg, self.model.rotary, B, S, start, padding, device, self.dtype)
               if self.my_blocks else None)
        rows = real_token_rows(padding, S, start, device)
        self.step.most = B * S  # a block's first attention rank brings at most every token; the others none
        mine = self._slice_inputs(ctx, padding, S, start, B)  # for replicated blocks: this rank's rows
        holders, split = p.embed_ranks, False  # split: every rank holds its rows of the batch
        for name, block in self.model.layers.items():
            s = p.strategy(int(name))
            cache = caches.get(name) if caches is not None else None
            if s.attention == "replicated":
                h, split = h if split else self._split(h, holders, shape), True
                if h.shape[0]:
                    h = block.feed(block.attend(h, mine[0], cache), start > 0, mine[1])
                elif not block.feed_forward.dense:  # no sequence here: still take part in the block's exchanges
                    block.feed_forward.run_experts(*self.no_rows)
                continue
            if split:
                h, split = self._join(h, s.attention_ranks, shape), False
            else:
                h = self._move(h, holders, s.attention_ranks, shape)
            holders = s.attention_ranks
            if self.rank in holders:
                h = block.attend(h, ctx, cache)
            # the experts: on the group that splits them all, or reached by the exchange from the first rank
            experts_at = s.expert_groups[0] if s.local_tensor_experts else (s.leader,)
            h = self._move(h, holders, experts_at, shape)
            holders = experts_at
            if self.rank in holders:
                h = block.feed(h, start > 0, rows)
            elif s.needs_exchange and not block.feed_forward.dense:  # its exchanges, with no rows of our own
                block.feed_forward.run_experts(*self.no_rows)
        h = self._join(h, (p.head_rank,), shape) if split else self._move(h, holders, (p.head_rank,), shape)
        if self.rank != self.head_rank:
            return None
        if last_only:
            h = h[:, -1:]
        return self.model.head(h)

    def _slice_inputs(self, ctx: AttentionContext | None, padding: Padding | None, seq: int, start: int,
                      batch: int) -> tuple[AttentionContext | None, torch.Tensor | None]:
        """The attention context and real-token rows of this rank's rows of the batch (replicated blocks)."""
        if ctx is None or not self.splits_batch:
            return None, None
        mine = self.rows_of(batch)[self.rank]
        pad = Padding.of(padding.host_B[mine.host], self.dist.device) if padding is not None else None
        return ctx.rows(mine.device, mine.host), real_token_rows(pad, seq, start, self.dist.device)

    def routes_alike(self, batch: int) -> dict[int, tuple[int, ...]]:
        """Per block, the ranks that route the same tokens of a batch of `batch` sequences, where several do: the
        ranks of one group that splits every expert and holds the block's tokens."""
        alike = {}
        for i in range(len(self.placement.block_ranks)):
            s = self.placement.strategy(i)
            if s.local_tensor_experts and len(s.expert_groups[0]) > 1:
                alike[i] = s.expert_groups[0]
        return alike

    def check_routing(self, alike: dict[int, tuple[int, ...]]) -> None:
        """Ranks that routed the same tokens chose the same experts (one all-gather a request), or every rank raises
        `RoutingDiverged`."""
        local = torch.zeros(self.model.cfg.n_layers, dtype=torch.long, device=self.dist.device)
        for name, block in self.model.layers.items():
            if block.feed_forward.checks_routing:
                local[int(name)] = block.feed_forward.route_check
        gathered = self.dist.all_gather(local[None]).cpu()  # [ranks, blocks]
        check_routing_agrees(gathered, alike)

    # -- the Engine interface ----------------------------------------------------------------------
    def generate(self, ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 eos: tuple[int, ...], context: int, on_token: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        alike = self.routes_alike(len(ids))
        if alike:  # only blocks whose ranks compare their routing keep a checksum
            for block in self.model.layers.values():
                block.feed_forward.route_check.zero_()
        result = generate_tokens(self, ids, params, eos, context, on_token, should_stop,
                                 tokenizer_of(self.checkpoint_dir) if needs_tokenizer(params) else None)
        if alike and not result.cancelled:
            self.check_routing(alike)
        return result

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self.tokens_to_logits(tokens_BS, 0, None, None, last_only=False)
        if logits is None:
            B, S = tokens_BS.shape
            logits = torch.empty(B, S, self.model.cfg.vocab_size, dtype=self.dtype, device=self.dist.device)
        return self.dist.broadcast(logits, self.head_rank).cpu()

    def prompt_logprobs(self, ids: list[list[int]], top: int) -> list:
        out = []
        for prompt in ids:
            caches, padding = self._scoring_caches(len(prompt))
            out.append(prompt_scores(lambda t, s, c=caches, p=padding: self.tokens_to_logits(t, s, p, c, False),
                                     lambda packed: self.dist.broadcast(packed, self.head_rank), prompt, top,
                                     self.dist.device))
        return out

    def _scoring_caches(self, length: int) -> tuple[dict[str, KVCache], Padding]:
        """A batch of one's caches, made as an eager request's (not a compiled step's, which a shape would keep), for
        calls that pass them: the engine's own caches, padding and compiled step are left as they were."""
        kept = self.caches, self.padding, getattr(self, "compiled", None)
        self.compiled = None
        try:
            self.start(1, length, torch.zeros(1, dtype=torch.long))
            return self.caches, self.padding
        finally:
            self.caches, self.padding, self.compiled = kept

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing counters summed over all ranks, and the rows each rank's experts computed per block
        ([blocks, ranks]); one all-reduce, only when a report is asked for, so every rank gets the same."""
        counts, entropy = local_load_stats(self.model)
        received = torch.zeros(len(self.model.layers), self.dist.world_size, dtype=torch.float64)
        for i, block in enumerate(self.model.layers.values()):
            received[i, self.rank] = float(block.feed_forward.received_rows)  # a host read: only for reports
        packed = torch.cat([counts.double().reshape(-1), received.reshape(-1), entropy])
        packed = self.dist.all_reduce(packed.to(self.dist.device)).cpu()
        n = counts.numel()
        return (packed[:n].round().long().view(counts.shape), packed[-2:],
                packed[n:-2].round().long().view(received.shape))

    def reset_load_stats(self) -> None:
        reset_load_stats(self.model)
        for block in self.model.layers.values():
            block.feed_forward.received_rows.zero_()

    def set_round_robin(self, enabled: bool) -> None:
        set_round_robin(self.model, enabled)

    def track_entropy(self, enabled: bool) -> None:
        track_entropy(self.model, enabled)

    def save(self, out: str, max_shard_bytes: int | None, beside: list[Path],
             progress: bool = False) -> list[dict]:
        shown = Progress("saving", unit="B", enabled=progress and self.rank == 0)
        mine = save_distributed(self.model, self.model.cfg, out, self.dist, max_shard_bytes, beside, shown)
        return self.dist.all_gather_object(mine)

    def memory(self) -> list[MemoryUse]:
        return self.dist.all_gather_object(MemoryUse.now(self.dist.device))

    def random_seed(self) -> int:
        return int(self.dist.broadcast_object(random.randrange(2**31), 0))

    def close(self) -> None:
        self.caches = {}
        if self.owns_group:
            self.owns_group = False
            self.dist.destroy()
