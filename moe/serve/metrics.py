"""The server's Prometheus text (`GET /metrics`): queue and batch, tokens, latencies, and the live expert load
per block and expert (which no other server exposes)."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        """Counted in the first bucket that holds it (one bisection: this runs twice a token, just after a step);
        `lines` adds them up as Prometheus's buckets are."""
        self.sum += value
        self.count += 1
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{edge}"}} {n}'
                for edge, n in zip(self.buckets, itertools.accumulate(self.counts), strict=True)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.waiting = self.rejected = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.finished_by: Counter[str] = Counter()
        self.ttft, self.itl = Histogram(), Histogram()
        self.batch = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.expert_load = None  # [blocks, experts] token copies routed since start, refreshed by the engine loop
        self.dense: tuple[int, ...] = ()  # blocks with no experts (a dense MLP): no series

    def token(self, request, now: float) -> None:
        with self.lock:
            self.generation_tokens += 1
            if request.first_token is None:
                request.first_token = now
                self.ttft.observe(now - request.arrived)
            else:
                self.itl.observe(now - request.last_token)
            request.last_token = now

    def finished(self, request) -> None:
        with self.lock:
            self.prompt_tokens += len(request.prompt)
            self.finished_by[request.out.finish_reason] += 1

    def step(self, rows: int) -> None:
        with self.lock:
            self.batch.observe(rows)

    def text(self) -> str:
        with self.lock:
            lines = [
                "# HELP moe_requests_running Sequences in the running batch.", "# TYPE moe_requests_running gauge",
                f"moe_requests_running {self.running}",
                "# HELP moe_requests_waiting Requests waiting for a slot.", "# TYPE moe_requests_waiting gauge",
                f"moe_requests_waiting {self.waiting}",
                "# HELP moe_requests_rejected_total Requests refused because the queue was full.",
                "# TYPE moe_requests_rejected_total counter", f"moe_requests_rejected_total {self.rejected}",
                "# HELP moe_requests_finished_total Requests finished, by finish reason.",
                "# TYPE moe_requests_finished_total counter",
                *[f'moe_requests_finished_total{{finish_reason="{k}"}} {n}'
                  for k, n in sorted(self.finished_by.items())],
                "# HELP moe_prompt_tokens_total Prompt tokens of finished requests.",
                "# TYPE moe_prompt_tokens_total counter", f"moe_prompt_tokens_total {self.prompt_tokens}",
                "# HELP moe_generation_tokens_total Tokens generated.", "# TYPE moe_generation_tokens_total counter",
                f"moe_generation_tokens_total {self.generation_tokens}",
                *self.ttft.lines("moe_time_to_first_token_seconds", "Time from arrival to the first token."),
                *self.itl.lines("moe_inter_token_latency_seconds", "Time between a request's tokens."),
                *self.batch.lines("moe_batch_size", "Running sequences per decode step."),
            ]
            if self.expert_load is not None:
                lines += ["# HELP moe_expert_tokens_total Token copies routed to each expert of each block.",
                          "# TYPE moe_expert_tokens_total counter"]
                lines += [f'moe_expert_tokens_total{{block="{b}",expert="{e}"}} {int(n)}'
                          for b, row in enumerate(self.expert_load) if b not in self.dense for e, n in enumerate(row)]
        return "\n".join(lines) + "\n"
