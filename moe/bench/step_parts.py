"""Where a compiled N-rank decode step goes: a lone sequence on rank processes pinned as `MoEModel` pins them, each
timing its step, its sums over ranks (one per block, the compiled graph's opaque op), the step's token broadcast and,
in a pipeline of whole blocks, its hand-offs of the hidden states (sent on, and waited for from the rank before).
Steps are told from the prompt by difference: a run of 72 new tokens minus a run of 8, over 64 steps, three times.
What is left of a rank's step, its computing, is set against the compiled 1-rank step by the bench; a pipeline's
ranks take turns, so their computing together is set against the floor of the turns, the compiled 1-rank step on
one core, and what the step takes beyond their computing is what the turns cost.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = [[1, 45, 312, 9, 77, 8, 8, 100, 200, 300, 17, 18, 19, 20, 21, 22]]
SHORT, LONG, PAIRS = 8, 72, 3
KEYS = ("step", "sums", "broadcast", "sent", "waited")


def _time_calls(spent: dict[str, list[float]]) -> None:
    """Every sum over ranks (an all-gather: `moe.parallel.distributed`) and broadcast this process makes, timed
    into `spent`: a broadcast over the world with no group named is the step's token; one within a pair of ranks is
    a pipeline's hand-off, sent or waited for."""
    from moe.parallel.distributed import DistContext

    def timed(method, key_of):
        def call(ctx, *args, **kwargs):
            start = time.perf_counter()
            result = method(ctx, *args, **kwargs)
            spent[key_of(ctx, *args, **kwargs)].append(time.perf_counter() - start)
            return result
        return call

    def broadcast_kind(ctx, t, src, ranks=None) -> str:
        return "broadcast" if ranks is None else "sent" if src == ctx.rank else "waited"

    DistContext.all_gather = timed(DistContext.all_gather, lambda *_, **__: "sums")
    DistContext.broadcast = timed(DistContext.broadcast, broadcast_kind)


def compiled_step_parts(path: str, dtype: str, world_size: int, strategy: str = "replicated/tensor") -> list[dict]:
    """Per rank: {"step", "sums", "broadcast", "sent", "waited": seconds per step, medians over the pairs of runs
    ("sent": hidden states handed on, "waited": for them from the rank before); "sum_median", "sum_p90", "sum_max":
    one sum's seconds over every call, where the step has sums}. `strategy`: "layer/layer" for the pipeline."""
    from moe.workers.group import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(_parts_on_rank, world_size, path, dtype, strategy, out)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _parts_on_rank(rank: int, world_size: int, port: int, path: str, dtype: str, strategy: str, out: str) -> None:
    import torch

    from moe.bench.collectives import strategy_plan
    from moe.checkpoint.formats import detect
    from moe.generation import SamplingParams, generate_tokens
    from moe.parallel.distributed import init_process_group
    from moe.workers.rank import ShardSpec, keep_to_share, load_shard, lower_gloo_io_threads

    torch.set_num_threads(1)
    dist = init_process_group(rank, world_size, "127.0.0.1", port, poll=keep_to_share(rank, world_size, 1))
    plan = strategy_plan(detect(path).config, world_size, strategy)
    engine, _ = load_shard(ShardSpec(path, dtype, plan.to_json(), compile=True), dist)
    if dist.poll:  # as a rank process does
        lower_gloo_io_threads()

    def run(new_tokens: int) -> float:
        greedy = SamplingParams(new_tokens, 0.0, 1.0, 0, 0)
        return generate_tokens(engine, PROMPT, greedy, (), 10**6).decode_seconds

    run(SHORT)  # compiles
    spent: dict[str, list[float]] = {key: [] for key in KEYS[1:]}
    _time_calls(spent)
    pairs, calls = [], []
    for _ in range(PAIRS):
        runs = []
        for n in (SHORT, LONG):
            for times in spent.values():
                times.clear()
            runs.append((run(n), *(sum(spent[key]) for key in KEYS[1:])))
            calls += spent["sums"]
        pairs.append([(b - a) / (LONG - SHORT) for a, b in zip(*runs, strict=True)])
    calls.sort()
    result = {key: statistics.median(p[i] for p in pairs) for i, key in enumerate(KEYS)}
    if calls:
        result |= {"sum_median": statistics.median(calls), "sum_p90": calls[int(0.9 * len(calls))],
                   "sum_max": calls[-1]}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy()


def _computing(p: dict) -> float:
    """A rank's step less its time in sums over ranks, the token broadcast and hand-offs (0 where it has none)."""
    return p["step"] - p["sums"] - p["broadcast"] - p.get("sent", 0) - p.get("waited", 0)


def print_compiled_step_parts(parts: list[dict], blocks: int, one_rank_compiled_s: float | None,
                              strategy: str = "replicated/tensor") -> None:
    lines = []
    for rank, p in enumerate(parts):
        computing = _computing(p)
        against = f" = {computing / one_rank_compiled_s:.2f}x the compiled 1-rank step" if one_rank_compiled_s else ""
        lines.append(f"rank {rank}: step {p['step'] * 1e3:.2f} ms, of which {blocks} sums over ranks "
                     f"{p['sums'] * 1e3:.2f} (one: median {p['sum_median'] * 1e3:.2f} / p90 {p['sum_p90'] * 1e3:.2f} / "
                     f"max {p['sum_max'] * 1e3:.2f}), the token broadcast {p['broadcast'] * 1e3:.2f}, computing "
                     f"{computing * 1e3:.2f}{against}")
    print(f"{len(parts)} ranks, a lone sequence's compiled decode step ({strategy}), where it goes: "
          + "; ".join(lines))


def print_pipeline_step_parts(parts: list[dict], floor_s: float | None) -> None:
    """A pipeline's step: each rank's computing (its step less its time in hand-offs and the token broadcast), and
    their sum against the floor of ranks that take turns (`floor_s`, the compiled 1-rank step on one core)."""
    lines, computing = [], []
    for rank, p in enumerate(parts):
        computing.append(_computing(p))
        lines.append(f"rank {rank}: step {p['step'] * 1e3:.2f} ms, of which hidden states sent on "
                     f"{p['sent'] * 1e3:.2f}, waited for {p['waited'] * 1e3:.2f}, the token broadcast "
                     f"{p['broadcast'] * 1e3:.2f}, computing {computing[-1] * 1e3:.2f}")
    step, together = max(p["step"] for p in parts), sum(computing)
    floor = f" = {together / floor_s:.2f}x the floor (the compiled 1-rank step on one core)" if floor_s else ""
    print(f"{len(parts)} ranks, a lone sequence's compiled decode step (a pipeline of whole blocks), where it goes: "
          + "; ".join(lines) + f"; the ranks' computing together {together * 1e3:.2f} ms{floor}, the turns' "
          f"hand-offs {(step - together) * 1e3:.2f} ms a step")
