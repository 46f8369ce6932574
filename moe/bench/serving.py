"""A load generator for OpenAI-compatible servers (ours, llama-server), with vLLM's serving-benchmark metrics.

Each request streams `/v1/completions` (raw server-sent events over aiohttp, `ignore_eos`, a fixed `max_tokens`) and
is timed from send: time to first token (TTFT), time per output token after the first (TPOT: (latency - TTFT) /
(tokens - 1)), and every gap between two streamed chunks (ITL). Closed loop: `concurrency` clients, each sending
its next request when the last one ends. Open loop: requests sent at Poisson arrivals of a given rate, whatever is
still running.

The client is aiohttp, as vLLM's serving benchmark's: on a machine of few cores the load generator shares them with
the server it measures, and httpx's streaming took 0.6 ms of CPU a streamed token here (a 6 ms decode step), aiohttp's
0.25 ms.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Timing:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(session, url: str, model: str, prompt, max_tokens: int) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out, start = Timing(), time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return out
            async for raw in response.content:  # one line at a time
                line = raw.rstrip(b"\r\n")
                if line == b"data: [DONE]":
                    out.ok = last is not None
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.gaps.append(now - last)
                last = now
                out.tokens = max(out.tokens, len(out.gaps) + 1)
    except Exception as e:  # counted as a failed request, with why
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency = time.perf_counter() - start
    if not out.ok and not out.error:
        out.error = "the stream ended without [DONE]" if last is not None else "no text streamed"
    return out


def _session(connections: int):
    """A connection per request, as vLLM's benchmark has: a kept-alive one is closed by llama-server after a few
    requests (cpp-httplib's keep-alive count), and a request sent on it as it closes fails."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=connections, force_close=True))


async def closed_loop(url: str, model: str, prompts: list, max_tokens: int, concurrency: int,
                      requests: int) -> tuple[list[Timing], float]:
    queue = list(range(requests))
    results: list[Timing] = []

    async def client_loop(session) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(session, url, model, prompts[i % len(prompts)], max_tokens))

    async with _session(concurrency + 4) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(session) for _ in range(concurrency)))
        return results, time.perf_counter() - start


async def open_loop(url: str, model: str, prompts: list, max_tokens: int, rate: float, requests: int,
                    seed: int = 0) -> tuple[list[Timing], float]:
    rng = random.Random(seed)
    async with _session(requests + 4) as session:
        start, tasks = time.perf_counter(), []
        for i in range(requests):
            tasks.append(asyncio.create_task(one_request(session, url, model, prompts[i % len(prompts)], max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summary(results: list[Timing], seconds: float) -> dict:
    """vLLM's figures: request throughput, output tokens/s, and TTFT, TPOT, ITL (ms) mean/median/p90/p99."""
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "median": None, "p90": None, "p99": None}
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
        return {"mean": statistics.fmean(values) * 1e3, "median": statistics.median(values) * 1e3,
                "p90": pick(0.9), "p99": pick(0.99)}

    return {"requests": len(results), "failed": len(results) - len(done), "seconds": seconds,
            "request_throughput": len(done) / seconds, "output_tokens_per_s": sum(r.tokens for r in done) / seconds,
            "ttft_ms": stats([r.ttft for r in done]),
            "tpot_ms": stats([(r.latency - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1]),
            "itl_ms": stats([g for r in done for g in r.gaps]),
            "errors": sorted({r.error for r in results if r.error})[:3]}


def table(rows: dict[str, dict]) -> str:
    head = (f"{'case':>28} {'req/s':>7} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} "
            f"{'ITL med':>8} {'ITL p99':>8} {'failed':>6}")
    lines = [head]
    for name, s in rows.items():
        f = lambda d, k: f"{d[k]:.1f}" if d[k] is not None else "-"  # noqa: E731
        lines.append(f"{name:>28} {s['request_throughput']:7.2f} {s['output_tokens_per_s']:10.1f} "
                     f"{f(s['ttft_ms'], 'median'):>9} {f(s['ttft_ms'], 'p99'):>9} {f(s['tpot_ms'], 'median'):>9} "
                     f"{f(s['itl_ms'], 'median'):>8} {f(s['itl_ms'], 'p99'):>8} {s['failed']:>6}")
    return "\n".join(lines)


def process_tree_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process and its descendants (a server's rank processes), summed by thread name."""
    from moe.host import process_tree, thread_cpu_s

    spent: dict[str, float] = {}
    for p in process_tree(pid):
        for name, seconds in thread_cpu_s(p).items():
            spent[name] = spent.get(name, 0.0) + seconds
    return spent

