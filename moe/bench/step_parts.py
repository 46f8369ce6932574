"""Where a compiled N-rank decode step goes: a lone sequence on rank processes pinned as `MoEModel` pins them, each
timing its step, its sums over ranks (one per block, the compiled graph's opaque op) and the step's token
broadcast. Steps are told from the prompt by difference: a run of 72 new tokens minus a run of 8, over 64 steps,
three times. What is left of a rank's step, its computing, is set against the compiled 1-rank step by the bench.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = [[1, 45, 312, 9, 77, 8, 8, 100, 200, 300, 17, 18, 19, 20, 21, 22]]
SHORT, LONG, PAIRS = 8, 72, 3


def compiled_step_parts(path: str, dtype: str, world_size: int, strategy: str = "replicated/tensor") -> list[dict]:
    """Per rank: {"step", "sums", "broadcast": seconds per step, medians over the pairs of runs; "sum_median",
    "sum_p90", "sum_max": one sum's seconds over every call}."""
    from moe.workers.group import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(_parts_on_rank, world_size, path, dtype, strategy, out)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]


def _parts_on_rank(rank: int, world_size: int, port: int, path: str, dtype: str, strategy: str, out: str) -> None:
    import torch

    from moe.bench.collectives import strategy_plan
    from moe.checkpoint.formats import detect
    from moe.generation import SamplingParams, generate_tokens
    from moe.parallel.distributed import DistContext, init_process_group
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
    spent: dict[str, list[float]] = {"all_gather": [], "broadcast": []}  # the sums are all-gathers (distributed.py)
    saved = {name: getattr(DistContext, name) for name in spent}
    for name, method in saved.items():
        def timed(ctx, *args, _name=name, _method=method, **kwargs):
            start = time.perf_counter()
            result = _method(ctx, *args, **kwargs)
            spent[_name].append(time.perf_counter() - start)
            return result
        setattr(DistContext, name, timed)
    pairs, calls = [], []
    for _ in range(PAIRS):
        runs = []
        for n in (SHORT, LONG):
            for times in spent.values():
                times.clear()
            runs.append((run(n), sum(spent["all_gather"]), sum(spent["broadcast"])))
            calls += spent["all_gather"]
        pairs.append([(b - a) / (LONG - SHORT) for a, b in zip(*runs, strict=True)])
    calls.sort()
    result = {key: statistics.median(p[i] for p in pairs) for i, key in enumerate(("step", "sums", "broadcast"))}
    result |= {"sum_median": statistics.median(calls), "sum_p90": calls[int(0.9 * len(calls))], "sum_max": calls[-1]}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy()


def print_compiled_step_parts(parts: list[dict], blocks: int, one_rank_compiled_s: float | None,
                              strategy: str = "replicated/tensor") -> None:
    lines = []
    for rank, p in enumerate(parts):
        computing = p["step"] - p["sums"] - p["broadcast"]
        against = f" = {computing / one_rank_compiled_s:.2f}x the compiled 1-rank step" if one_rank_compiled_s else ""
        lines.append(f"rank {rank}: step {p['step'] * 1e3:.2f} ms, of which {blocks} sums over ranks "
                     f"{p['sums'] * 1e3:.2f} (one: median {p['sum_median'] * 1e3:.2f} / p90 {p['sum_p90'] * 1e3:.2f} / "
                     f"max {p['sum_max'] * 1e3:.2f}), the token broadcast {p['broadcast'] * 1e3:.2f}, computing "
                     f"{computing * 1e3:.2f}{against}")
    print(f"{len(parts)} ranks, a lone sequence's compiled decode step ({strategy}), where it goes: "
          + "; ".join(lines))
