"""The server's engine loop, on every rank: each iteration rank 0 decides the plan (who leaves, who joins) and
broadcasts it; every rank applies it, prefills the joining sequences, then runs one decode step for every running
sequence. The head's rank samples; the tokens reach every rank in the step's one broadcast, as in `generate`.

Iteration-level continuous batching: a sequence joins between two steps and leaves as soon as it ends or its
client goes away; its rows of the KV cache are reused at once (`moe.serve.batch`).
"""

from __future__ import annotations

import math
import time

import torch

from moe.generation.sampler import packed_width, top_logprobs
from moe.serve.batch import Row, RunningBatch
from moe.serve.scheduler import Plan, Scheduler

LOAD_EVERY_S = 2.0  # how often the live expert load is gathered for /metrics (one all-reduce on N ranks)


class EngineLoop:
    def __init__(self, engine, dist, length: int, seqs: int, scheduler: Scheduler | None, chunk: int = 2048,
                 eos: tuple[int, ...] = ()) -> None:
        """`seqs`: the most sequences running at once; `scheduler` on rank 0 only; `dist` None for one process;
        `chunk`: prompt tokens a step prefills of the prompts longer than that (the same on every rank); `eos`: the
        model's end ids (held back by `min_tokens`).
        Where the RoPE angles depend on a call's length (dynamic NTK, longrope) a prompt is prefilled in one call, as
        `generate` does, or its first chunks' keys would turn at other angles than its answer alone has."""
        if engine.model.cfg.rope_scaling.by_length:
            chunk = length
        self.engine, self.dist, self.scheduler, self.chunk = engine, dist, scheduler, chunk
        self.batch = RunningBatch(engine, length, seqs, eos)
        choice = getattr(engine.model, "kernel_choice", None)  # alike on every rank (`moe.api`)
        self.apart = choice is not None and choice.prompts_apart  # joining prompts prefilled a call each
        self.distributed = dist is not None and dist.world_size > 1
        self.loads_at = -math.inf  # the first plan gathers the expert load: /metrics has it from the first request on

    def run(self) -> None:
        with torch.inference_mode():  # every step's tensors, caches and samplers: one entry for the server's life
            self._run()

    def _run(self) -> None:
        while True:
            plan = self._plan()
            if plan.stop:
                return
            self.batch.leave(plan.leave)
            if plan.join:
                rows = [Row(rid, prompt, params) for rid, prompt, params in plan.join]
                self._score([r for r in rows if r.params.prompt_logprobs is not None])
                if plan.score_only:  # scored, they are done: no row joins the batch
                    rows = [r for r in rows if r.request not in plan.score_only]
                    if self.scheduler is not None:
                        self.scheduler.finish_scored(plan.score_only)
                whole = [r for r in rows if len(r.prompt) <= self.chunk]
                for group in [[r] for r in whole] if self.apart else [whole]:
                    if group:
                        self._sample(self.batch.join(group), group)
                for row in rows:
                    if len(row.prompt) > self.chunk:
                        self.batch.start_prefill(row)
            for row, logits in self.batch.prefill_chunks(self.chunk):
                self._sample(logits, [row])
            if self.batch.rows:
                self._sample(self.batch.step(), self.batch.rows)
                if self.scheduler is not None:
                    self.scheduler.metrics.step(len(self.batch.rows))
            if plan.loads:
                counts = self.engine.load_stats()[0]
                if self.scheduler is not None:
                    self.scheduler.metrics.expert_load = counts.sum(dim=1).tolist()

    def _plan(self) -> Plan:
        """Rank 0's plan on every rank: a one-value broadcast says whether there is one, then the plan itself
        (most steps change nothing and cost one small broadcast)."""
        plan = self.scheduler.plan() if self.scheduler is not None else None
        if plan is not None and time.monotonic() - self.loads_at > LOAD_EVERY_S:
            plan.loads, self.loads_at = True, time.monotonic()
        if not self.distributed:
            return plan
        flag = torch.tensor([int(plan is not None and bool(plan))], device=self.dist.device)
        if int(self.dist.broadcast(flag, 0).item()) == 0:
            return Plan()
        return self.dist.broadcast_object(plan, 0)

    def _score(self, rows: list[Row]) -> None:
        """The prompt log-probabilities of joining sequences that ask (OpenAI's `echo` with `logprobs`): one more
        pass over each prompt, on every rank; rank 0 sends them to the request before its first token."""
        for row in rows:
            entries = self.batch.prompt_logprobs(row)
            if self.scheduler is not None:
                self.scheduler.scored(row.request, entries)

    def _sample(self, logits: torch.Tensor | None, rows: list[Row]) -> None:
        """Sample on the head's rank, share with every rank, record; rank 0 delivers to the requests."""
        top = top_logprobs([r.params for r in rows])
        width = packed_width(top)
        packed = (self.batch.sample(logits, rows) if logits is not None
                  else torch.zeros(len(rows), width, dtype=torch.long, device=self.engine.device))
        shared = packed if self.engine.alone else self.engine.share(packed.reshape(-1)).view(len(rows), width)
        host = shared.tolist()  # the step's one read: what each request receives
        self.batch.record([h[0] for h in host], rows, shared[:, 0])
        if self.scheduler is not None:
            self.scheduler.deliver([r.request for r in rows], host, top)

