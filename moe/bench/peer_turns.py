"""Batch-1 decode in turns with a peer: our 1-rank models (eager and compiled) and the peer's decode run one after
the other, round after round (the order reversed every other round), each round also reading the machine's read
bandwidth. The table's llama.cpp row comes from sessions run minutes before and after our cases; a shared machine
whose memory bandwidth changes between such spells (this one: 40-90 GB/s) can put the two sides in different
spells. In turns, each round's ratio sets both sides in one spell, and their median is the comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from moe.bench.in_turns import batch1_step, turn_order, warm_up
from moe.bench.speed import NEW_TOKENS, read_bandwidth

# eager, and the package compiled ahead of time (built on the first call, loaded from the step cache after)
OURS = {"ours x1": {"compile": False}, "ours-compiled x1": {"compile": True}}


def decode_in_turns(path: str, dtype: str, threads: int, peer: Callable[[int], float], rounds: int = 6,
                    new_tokens: int = NEW_TOKENS, ours: dict = OURS) -> dict:
    """{"steps": {name: [step seconds per round]}, "read_gbs": [per round]}: the steps of our models (`ours`: name
    -> MoEModel options; each step from a generation of `new_tokens` after a DECODE_PROMPT-token prompt) and the
    "peer" step `peer(new_tokens)` returns, in turns."""
    from moe import MoEModel

    models = {}
    try:
        for name, options in ours.items():
            models[name] = MoEModel.from_pretrained(path, dtype=dtype, threads=threads, **options)
        vocab = next(iter(models.values())).config.vocab_size
        for model in models.values():
            warm_up(model, vocab)
        names = [*models, "peer"]
        steps: dict[str, list[float]] = {name: [] for name in names}
        read = []
        for r in range(rounds):
            for name in turn_order(names, r):
                step = peer(new_tokens) if name == "peer" else batch1_step(models[name], vocab, r, new_tokens)[0]
                steps[name].append(step)
            read.append(read_bandwidth(threads, mib=256, repeats=5))
        return {"steps": steps, "read_gbs": read}
    finally:
        for model in models.values():
            model.close()


def ratios(turns: dict, name: str) -> list[float]:
    """Round by round, how many times faster our `name` decoded than the peer (> 1: ours faster)."""
    return [p / o for p, o in zip(turns["steps"]["peer"], turns["steps"][name], strict=True)]


def print_decode_in_turns(turns: dict, peer_name: str) -> None:
    steps = turns["steps"]
    rounds = len(steps["peer"])
    ours = [name for name in steps if name != "peer"]
    speeds = "; ".join(f"{name} {1 / statistics.median(steps[name]):.1f} tok/s" for name in ours)
    print(f"decode b1 in turns with {peer_name} ({rounds} rounds, order reversed every other round): {speeds}; "
          f"{peer_name} {1 / statistics.median(steps['peer']):.1f} tok/s; read bandwidth "
          f"{min(turns['read_gbs']):.1f}-{max(turns['read_gbs']):.1f} GB/s")
    for name in ours:
        each = ratios(turns, name)
        print(f"  {name} vs {peer_name}, round by round: {', '.join(f'{x:.2f}' for x in each)}x; median "
              f"{statistics.median(each):.2f}x (> 1: ours faster)")
