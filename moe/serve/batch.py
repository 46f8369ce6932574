"""The server's running sequences on one rank: their rows of the engine's KV caches, on a clock they share.

Every row writes the same cache column at a step (the clock), as a batch of `generate` does; a row's sequence
begins at its own column (`pad`, the left padding of `moe.generation`), so positions, masks and RoPE are the ones a
request gets alone. A sequence that joins is prefilled on its own into fresh rows that end at the clock (the clock
moves on when its prompt is longer than the clock), then its rows are copied in after the running ones'; one that
leaves has the rows after its own moved up (`moe.serve.slots`: the rows are kept in place). When the clock reaches
the end of the cache, every row moves left by the earliest row's start: relative positions, and so the keys already
rotated, stay valid. No sequence is ever recomputed.

Where blocks replicate attention over N ranks, each rank attends its own sequences and caches only their rows: a
sequence gets a home rank when it joins (the least loaded) and stays there until it leaves (`moe.engine.rows`),
so no cache row ever moves between ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from models.attention import Padding
from models.kv_cache import KVCache
from moe.engine.rows import least_loaded
from moe.generation import SamplingParams, left_pad
from moe.generation.sampler import Sampler
from moe.generation.structured import Grammars, end_ids, grammars_for, move
from moe.serve.slots import Slots
from moe.tokenizer import tokenizer_of


@dataclass
class Row:
    """One running sequence as every rank knows it (from the scheduler's plan and the shared tokens)."""

    request: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # the head's rank: this sequence's own random stream
    matcher: object = None  # the head's rank: its structured-output grammar's matcher, where it asks for one


@dataclass
class Prefill:
    """A prompt longer than a step's token budget, prefilled a chunk a step into rows of its own (positions from
    0), so the running sequences keep decoding meanwhile; it joins the batch when its last chunk is in."""

    row: Row
    caches: dict
    home: int  # the rank that attends it in replicated blocks (0 where none)
    done: int = 0


def chunk_size(budget: int, left: int) -> int:
    """A prefill's next chunk of the `left` tokens: `budget` of them, but never one alone (a one-token call takes a
    decode step's attention, whose bits are not those of the prompt kernel's row that the prompt alone runs): at
    least 2, and the last one too when only one would be left."""
    n = min(max(budget, 2), left)
    return left if left - n == 1 else n


class RunningBatch:
    def __init__(self, engine, length: int, seqs: int, eos: tuple[int, ...] = ()) -> None:
        """`seqs`: the most sequences that run at once (the rows of the caches' store)."""
        self.engine, self.length, self.eos = engine, length, eos
        self.rows: list[Row] = []
        self.prefills: list[Prefill] = []
        self.pad: list[int] = []  # per row, the cache column its sequence begins at
        self.clock = 0  # the column the next step writes
        self.sampler: Sampler | None = None  # the head's rank: rebuilt when the rows change
        # the running rows' last tokens on the device, as the last step's sample shared them: the next step's input
        # (no list made into a tensor, no copy from the host a step); made from the rows' records when the rows change
        self.last_B: torch.Tensor | None = None
        # replicated blocks' caches, which hold this rank's rows only, and every row's home rank
        self.split = engine.split_caches() if hasattr(engine, "split_caches") else set()
        self.ranks = engine.dist.world_size if self.split else 1
        self.homes: list[int] = []
        self.slots = Slots(seqs)  # the caches' rows, kept in place: the running rows are their first rows
        self.engine.caches, self.engine.padding = {}, None
        self.engine.exact_caches = True  # caches of this length, whatever a compiled step's rounding (moe.engine.local)

    def leave(self, requests: set[int]) -> None:
        if not requests:  # most steps: nobody leaves, and the rows stay the same list
            return
        self.prefills = [p for p in self.prefills if p.row.request not in requests]
        keep = [i for i, row in enumerate(self.rows) if row.request not in requests]
        if len(keep) == len(self.rows):
            return
        local = keep
        if self.split:  # a split cache's rows: this rank's sequences, in batch order
            mine = [g for g, h in enumerate(self.homes) if h == self.engine.dist.rank]
            kept = set(keep)
            local = [j for j, g in enumerate(mine) if g in kept]
        self.engine.caches = self.slots.keep({name: local if name in self.split else keep
                                              for name in self.engine.caches}, self.clock) if keep else {}
        self.rows, self.pad = [self.rows[i] for i in keep], [self.pad[i] for i in keep]
        self._keep_homes([self.homes[i] for i in keep] if self.split else [])
        self.sampler = self.last_B = None
        if not self.rows:
            self.clock = 0
        self._set_padding()

    def join(self, rows: list[Row]) -> torch.Tensor | None:
        """Prefill the new sequences into their own rows, ending at the clock, and append them: the logits of their
        last prompt tokens (on the head's rank; None elsewhere)."""
        longest = max(len(r.prompt) for r in rows)
        if longest > self.clock:
            self._shift(longest - self.clock)
        tokens = left_pad([r.prompt for r in rows])[0]
        pads = [self.clock - len(r.prompt) for r in rows]
        homes = self._new_homes(len(rows))
        with self._apart({}, homes):
            self.engine.start(len(rows), self.length, torch.tensor(pads))
            logits = self.engine.forward_last(tokens, self.clock - longest)
            joined = self.engine.caches
        self.engine.caches = self.slots.append(self.engine.caches, joined, self.clock)
        self.rows, self.pad, self.sampler, self.last_B = self.rows + rows, self.pad + pads, None, None
        self._keep_homes(self.homes + homes)
        self._set_padding()
        return logits

    def prompt_logprobs(self, row: Row) -> list:
        """A prompt's own log-probabilities (`Engine.prompt_logprobs`): a pass on caches of its own, on rows apart
        from the batch."""
        with self._apart({}, [0]):
            return self.engine.prompt_logprobs([row.prompt], row.params.prompt_logprobs)[0]

    def start_prefill(self, row: Row) -> None:
        (home,) = self._new_homes(1)
        with self._apart({}, [home]):
            self.engine.start(1, self.length, torch.zeros(1, dtype=torch.long))
            self.prefills.append(Prefill(row, self.engine.caches, home))

    def prefill_chunks(self, budget: int) -> list[tuple[Row, torch.Tensor | None]]:
        """Up to `budget` more prompt tokens of the pending prefills, oldest first; the rows whose prompt is in,
        merged into the batch, with the logits of their last prompt token (head's rank)."""
        finished = []
        for p in list(self.prefills):
            if budget <= 0:
                break
            n = chunk_size(budget, len(p.row.prompt) - p.done)
            chunk = torch.tensor([p.row.prompt[p.done:p.done + n]], dtype=torch.long)
            with self._apart(p.caches, [p.home]):
                logits = self.engine.forward_last(chunk, p.done)
                p.caches = self.engine.caches
            p.done, budget = p.done + n, budget - n
            if p.done == len(p.row.prompt):
                self.prefills.remove(p)
                self._merge(p)
                finished.append((p.row, logits))
        return finished

    def _merge(self, p: Prefill) -> None:
        """The prefilled rows moved to end at the clock, then appended."""
        length = len(p.row.prompt)
        if length > self.clock:
            self._shift(length - self.clock)
        by = self.clock - length
        _move_columns(p.caches, by, length, self.length)
        self.engine.caches = self.slots.append(self.engine.caches, p.caches, self.clock)
        self.rows, self.pad, self.sampler, self.last_B = self.rows + [p.row], self.pad + [by], None, None
        self._keep_homes(self.homes + [p.home])
        self._set_padding()

    def step(self) -> torch.Tensor | None:
        """One token per running sequence, after its last one, at the clock; the logits on the head's rank."""
        tokens_B = self.last_B
        if tokens_B is None:
            tokens_B = torch.tensor([r.generated[-1] for r in self.rows], device=self.engine.device)
        if self.clock == self.length:
            self._shift(-min(self.pad))
        logits = self.engine.forward_last(tokens_B[:, None], self.clock)
        self.clock += 1
        return logits

    def sample(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """The packed next tokens of `rows` (all running rows, or the ones just prefilled)."""
        if rows is self.rows and self.sampler is not None:
            return self.sampler(logits)
        for row in rows:
            if row.generator is None and not row.params.greedy:
                row.generator = torch.Generator(device=logits.device).manual_seed(row.params.seed)
        sampler = Sampler([r.params for r in rows], [r.prompt for r in rows], logits.shape[-1], logits.device,
                          outputs=[r.generated for r in rows], generators=[r.generator for r in rows], eos=self.eos,
                          grammars=self.grammars(rows, logits))
        if rows is self.rows:
            self.sampler = sampler
        return sampler(logits)

    def grammars(self, rows: list[Row], logits: torch.Tensor) -> Grammars | None:
        """The rows' structured-output matchers (made when a row first samples, then kept with it)."""
        if not any(r.params.structured_outputs for r in rows):  # the tokenizer is read only when one asks
            return None
        grammars = grammars_for([r.params for r in rows], tokenizer_of(self.engine.checkpoint_dir), logits.shape[-1],
                                self.eos, logits.device, [r.matcher for r in rows])
        for row, matcher in zip(rows, grammars.matchers, strict=True):
            row.matcher = matcher
        return grammars

    def record(self, tokens: list[int], rows: list[Row], device_tokens: torch.Tensor) -> None:
        for row, token in zip(rows, tokens, strict=True):
            row.generated.append(token)
            move(row.matcher, token, end_ids(row.params, self.eos))  # joining rows (sampled apart) and running
        if rows is self.rows:
            self.last_B = device_tokens
            if self.sampler is not None:
                self.sampler.update(device_tokens)

    def _shift(self, by: int) -> None:
        """Move every row's columns by `by` (right > 0, left < 0); the clock with them."""
        if self.rows and by:
            _move_columns(self.engine.caches, by, self.clock, self.length)
            self.pad = [p + by for p in self.pad]
        self.clock += by
        self._set_padding()

    def _new_homes(self, n: int) -> list[int]:
        """Homes for `n` sequences that start now, beside the running ones and the pending prefills."""
        return least_loaded(self.homes + [p.home for p in self.prefills], self.ranks, n) if self.split else [0] * n

    @contextmanager
    def _apart(self, caches: dict, homes: list[int]):
        """The engine's calls within run on rows outside the batch (sequences prefilled on their own): `caches`, no
        padding and, where caches are split, rows with `homes`; the running batch's are back after."""
        running, padding, rows = self.engine.caches, self.engine.padding, getattr(self.engine, "homes", None)
        self.engine.caches, self.engine.padding = caches, None
        if self.split:
            self.engine.set_homes(homes)
        try:
            yield
        finally:
            self.engine.caches, self.engine.padding = running, padding
            if self.split:
                self.engine.homes = rows  # the running rows' own, not made again

    def _keep_homes(self, homes: list[int]) -> None:
        """The running rows' homes, for the next steps."""
        if self.split:
            self.homes = homes
            self.engine.set_homes(homes)

    def _set_padding(self) -> None:
        self.engine.padding = Padding.of(torch.tensor(self.pad, dtype=torch.long), self.engine.device)


def _move_columns(caches: dict[str, KVCache], by: int, used: int, length: int) -> None:
    """Every cache's columns in use, [0, used), moved by `by` (right > 0, left < 0) within its `length`; the columns
    past them hold nothing a step reads, so they are not copied (a join of a longer prompt moved all `length`)."""
    if not by:
        return
    first, end = max(0, -by), min(used, length - max(0, by))
    for cache in caches.values():
        for t in (cache.k, cache.v):
            t[:, :, first + by:end + by] = t[:, :, first:end].clone()

