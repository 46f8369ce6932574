"""Rank 0's side of the server's engine loop: requests wait, join and leave; each step's plan is decided here and
broadcast, so every rank runs the same steps ("one decision, broadcast").

The HTTP side calls `submit` and `cancel` from its own thread; the engine loop calls `plan` and `deliver`. A request
is refused at once when the queue is full (never after a wait). Joins are limited by free slots and a token budget
per step, so that a step's prefill stays bounded while the running sequences wait for it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from moe.generation.loop import RowOutput, advance
from moe.generation.params import SamplingParams
from moe.generation.text import StopText
from moe.tokenizer import Tokenizer


class QueueFull(Exception):
    pass


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    # gets ("prompt", prompt log-probabilities) where asked, ("token", id, text piece, logprob entry or None) and
    # ("end", RowOutput)
    sink: Callable[[tuple], None]
    text: StopText | None = None  # made when submitted: the text streamed, held back for stop strings
    id: int = 0
    out: RowOutput = field(default_factory=RowOutput)
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    cancelled: bool = False
    # the chat template's end of turn where the request did not name it a stop id: it ends the answer as an
    # end-of-sequence id does, stop_reason null (as `model.chat` says, and vLLM, which reads it as an EOS)
    quiet_stop: int | None = None
    score_only: bool = False  # its prompt's log-probabilities and no token (echo with max_tokens 0)


@dataclass
class Plan:
    leave: set[int] = field(default_factory=set)
    join: list[tuple[int, list[int], SamplingParams]] = field(default_factory=list)
    stop: bool = False
    loads: bool = False  # gather the live expert load for /metrics this step
    score_only: set[int] = field(default_factory=set)  # joining requests that end once their prompt is scored

    def __bool__(self) -> bool:
        return bool(self.leave or self.join or self.stop or self.loads)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_queue: int, token_budget: int, eos: tuple[int, ...],
                 tokenizer: Tokenizer, metrics) -> None:
        self.max_num_seqs, self.max_queue, self.token_budget = max_num_seqs, max_queue, token_budget
        self.eos, self.tokenizer, self.metrics = eos, tokenizer, metrics
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.ids = itertools.count(1)
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.draining_until: float | None = None
        self.drain_asks: list[float] = []  # drains asked (seconds), started by the next plan
        self.dead = ""

    def submit(self, request: Request) -> Request:
        with self.lock:
            if self.dead or self.draining_until is not None or self.drain_asks:
                raise QueueFull("the server is shutting down" if not self.dead else self.dead)
            free = max(0, self.max_num_seqs - len(self.running))
            if len(self.waiting) >= self.max_queue + free:  # more than the free slots and the queue hold
                self.metrics.rejected += 1
                raise QueueFull(f"the queue is full ({len(self.waiting)} waiting, {len(self.running)} running)")
            request.id = next(self.ids)
            request.out.logprobs = [] if request.params.logprobs is not None else None
            request.text = StopText.of(self.tokenizer, request.prompt, request.params)
            self.waiting.append(request)
        self.wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """A client went away: its sequence leaves at the next step (or never starts)."""
        with self.lock:
            request.cancelled = True
        self.wake.set()

    def drain(self, seconds: float) -> None:
        """Accept nothing more; running and waiting requests have `seconds` to finish. Called from SIGTERM's or
        Ctrl-C's handler, which Python runs on the main thread, the engine loop's, between any two of its lines (inside
        `plan`'s `with self.lock` too): so it takes no lock (neither the scheduler's nor the wake event's), and the
        next plan starts the drain (within `idle_wait` when idle). A later call can shorten a drain (Ctrl-C after
        SIGTERM), never lengthen it."""
        self.drain_asks.append(seconds)  # one call: a handler that runs amid `plan`'s pops loses no ask

    def plan(self, idle_wait: float = 1.0) -> Plan:
        """The next step's changes. With nothing to do it waits (at most `idle_wait`: the other ranks wait in a
        collective meanwhile, which must not time out)."""
        if not self.running and not self.waiting and self.draining_until is None and not self.drain_asks:
            self.wake.wait(idle_wait)
        self.wake.clear()
        with self.lock:
            while self.drain_asks:
                until = time.monotonic() + self.drain_asks.pop(0)
                self.draining_until = until if self.draining_until is None else min(self.draining_until, until)
            plan = Plan()
            for rid, request in list(self.running.items()):
                if request.cancelled or request.out.finish_reason is not None:
                    plan.leave.add(rid)
                    del self.running[rid]
            if self.draining_until is not None and time.monotonic() >= self.draining_until:
                for request in [*self.running.values(), *self.waiting]:
                    request.sink(("error", "the server shut down before the request finished"))
                plan.leave |= set(self.running)
                self.running.clear()
                self.waiting.clear()
            budget = self.token_budget
            while self.waiting and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if request.cancelled:
                    self.waiting.popleft()
                    continue
                if plan.join and len(request.prompt) > budget:
                    break
                self.waiting.popleft()
                budget -= len(request.prompt)
                self.running[request.id] = request
                plan.join.append((request.id, request.prompt, request.params))
                if request.score_only:
                    plan.score_only.add(request.id)
            plan.stop = self.draining_until is not None and not self.running and not self.waiting
            self.metrics.running, self.metrics.waiting = len(self.running), len(self.waiting)
            return plan

    def deliver(self, requests: list[int], packed: list[list[int]], top: int | None) -> None:
        """The step's shared tokens of the running requests (rows in the batch's order)."""
        now = time.perf_counter()
        for rid, row in zip(requests, packed, strict=True):
            request = self.running.get(rid)
            if request is None or request.cancelled or request.out.finish_reason is not None:
                continue
            try:
                piece = advance(request.out, request.params, self.eos, request.text, row, top)
            except Exception as e:  # this request's text cannot be made: it ends, the others go on
                request.out.finish_reason = "abort"
                request.sink(("error", f"internal error in this request: {type(e).__name__}: {e}", 500))
                continue
            self.metrics.token(request, now)
            if piece is not None:
                entry = request.out.logprobs[-1] if request.out.logprobs else None
                request.sink(("token", row[0], piece, entry))
            if request.out.finish_reason is not None:
                if request.quiet_stop is not None and request.out.stop_reason == request.quiet_stop:
                    request.out.stop_reason = None
                if rest := request.text.rest():
                    request.sink(("token", None, rest, None))
                request.sink(("end", request.out))
                self.metrics.finished(request)

    def scored(self, rid: int, entries: list) -> None:
        """A joining request's prompt log-probabilities, before its first token."""
        request = self.running.get(rid)
        if request is not None and not request.cancelled:
            request.sink(("prompt", entries))

    def finish_scored(self, rids: set[int]) -> None:
        """Requests that only score their prompt end once scored, having made no token (their rows never join)."""
        with self.lock:
            for rid in rids:
                request = self.running.pop(rid, None)
                if request is not None and not request.cancelled:
                    request.out.finish_reason = "length"
                    request.sink(("end", request.out))
                    self.metrics.finished(request)

    def fail_all(self, why: str) -> None:
        """A rank died: every request gets the error; nothing more is accepted."""
        with self.lock:
            self.dead = why
            for request in [*self.running.values(), *self.waiting]:
                request.sink(("error", why))
            self.running.clear()
            self.waiting.clear()
