"""Batch-1 decode in turns with a peer: our 1-rank models (eager and compiled) and the peer's decode run one after
the other, round after round (the order reversed every other round), each round also reading the machine's read
bandwidth. The table's llama.cpp row comes from sessions run minutes before and after our cases; a shared machine
whose memory bandwidth changes between such spells (this one: 40-90 GB/s) can put the two sides in different
spells. In turns, each round's ratio sets both sides in one spell, and their median is the comparison. So is what a
step spends besides its weight products: the products alone (`moe.bench.speed.products_step`, compiled) take a turn
too, and each step is set against them in its own round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from moe.bench.in_turns import batch1_step, turn_order, warm_up
from moe.bench.speed import NEW_TOKENS, compiled_as_step, products_step, read_bandwidth

# eager, and the package compiled ahead of time (built on the first call, loaded from the step cache after)
OURS = {"ours x1": {"compile": False}, "ours-compiled x1": {"compile": True}}
PRODUCTS = "products alone"  # a turn of its own: a step's weight products, compiled, nothing else


def decode_in_turns(path: str, dtype: str, threads: int, peer: Callable[[int], float], rounds: int = 6,
                    new_tokens: int = NEW_TOKENS, ours: dict = OURS, products: bool = False) -> dict:
    """{"steps": {name: [step seconds per round]}, "read_gbs": [per round]}: the steps of our models (`ours`: name
    -> MoEModel options; each step from a generation of `new_tokens` after a DECODE_PROMPT-token prompt), the
    "peer" step `peer(new_tokens)` returns and, with `products`, the step's weight products alone (`PRODUCTS`:
    `new_tokens` calls of them), in turns."""
    from moe import MoEModel

    models, turns = {}, {"peer": lambda n, _round: peer(n)}
    try:
        for name, options in ours.items():
            models[name] = MoEModel.from_pretrained(path, dtype=dtype, threads=threads, **options)
            turns[name] = lambda n, r, model=models[name]: batch1_step(model, model.config.vocab_size, r, n)[0]
        for model in models.values():
            warm_up(model, model.config.vocab_size)
        if products:
            models[PRODUCTS] = MoEModel.from_pretrained(path, dtype=dtype, threads=threads, compile=False)
            net = models[PRODUCTS].engine.model
            with torch.inference_mode():
                turns[PRODUCTS] = products_turn(compiled_as_step(products_step(net, dtype), net.norm.weight.device))
        names = [*models, "peer"]
        steps: dict[str, list[float]] = {name: [] for name in names}
        read = []
        for r in range(rounds):
            for name in turn_order(names, r):
                steps[name].append(turns[name](new_tokens, r))
            read.append(read_bandwidth(threads, mib=256, repeats=5))
        return {"steps": steps, "read_gbs": read}
    finally:
        for model in models.values():
            model.close()


def products_turn(step: Callable) -> Callable[[int, int], float]:
    """A turn of the products alone: seconds per call over `n` calls (as a generation of `n` tokens has steps)."""

    def turn(n: int, _round: int) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            return (time.perf_counter() - t0) / n

    return turn


def ratios(turns: dict, name: str) -> list[float]:
    """Round by round, how many times faster our `name` decoded than the peer (> 1: ours faster)."""
    return [p / o for p, o in zip(turns["steps"]["peer"], turns["steps"][name], strict=True)]


def print_decode_in_turns(turns: dict, peer_name: str) -> None:
    steps = turns["steps"]
    rounds = len(steps["peer"])
    ours = [name for name in steps if name not in ("peer", PRODUCTS)]
    speeds = "; ".join(f"{name} {1 / statistics.median(steps[name]):.1f} tok/s" for name in ours)
    print(f"decode b1 in turns with {peer_name} ({rounds} rounds, order reversed every other round): {speeds}; "
          f"{peer_name} {1 / statistics.median(steps['peer']):.1f} tok/s; read bandwidth "
          f"{min(turns['read_gbs']):.1f}-{max(turns['read_gbs']):.1f} GB/s")
    for name in ours:
        each = ratios(turns, name)
        print(f"  {name} vs {peer_name}, round by round: {', '.join(f'{x:.2f}' for x in each)}x; median "
              f"{statistics.median(each):.2f}x (> 1: ours faster)")
    if PRODUCTS in steps:
        parts = [f"{peer_name if name == 'peer' else name} {statistics.median(besides_products(turns, name)) * 1e3:.2f}"
                 f" ms" for name in [*ours, "peer"]]
        print(f"  besides the weight products (each step less its round's products alone, compiled, median "
              f"{statistics.median(steps[PRODUCTS]) * 1e3:.2f} ms; medians): {'; '.join(parts)}")


def besides_products(turns: dict, name: str) -> list[float]:
    """Round by round, the seconds `name`'s step spent besides the weight products alone of the same round."""
    return [step - alone for step, alone in zip(turns["steps"][name], turns["steps"][PRODUCTS], strict=True)]
