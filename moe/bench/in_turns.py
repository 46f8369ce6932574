"""Batch-1 decode steps of several layouts measured in turns: every layout loaded at once, each generating in its
turn, round after round (the order reversed every other round), so a slow or fast spell of a shared machine weighs
on all of them alike. `scripts/bench.py --gpus N` (N > 1) prints them against the 1-rank step of the same rounds:
the figure the N-rank latency target is set against.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path

import torch

from moe.bench.speed import DECODE_PROMPT, prompts

# name -> MoEModel.from_pretrained options besides the ranks: how a lone sequence is served on N ranks
LAYOUTS = {
    "layer/expert": {},
    "layer/tensor": {"experts": "tensor"},
    "replicated/expert, each rank its slice": {"attention": "replicated", "exchange": "gather"},
    "replicated/expert": {"attention": "replicated"},
    "replicated/tensor": {"attention": "replicated", "experts": "tensor"},
    "replicated/expert, compiled": {"attention": "replicated", "compile": True},
    "replicated/tensor, compiled": {"attention": "replicated", "experts": "tensor", "compile": True},
    "layer/layer": {"experts": "layer"},
    "layer/layer, compiled": {"experts": "layer", "compile": True},
}
# The 1-rank steps each layout is set against: eager against eager, compiled against compiled.
REFERENCES = {"1 rank": {"compile": False}, "1 rank, compiled": {"compile": True}}
# Not a reference but a floor: the whole compiled step on one of the N cores. Ranks that work one after another on a
# core each (a pipeline of whole blocks, batch 1) together take at least as long as this.
ONE_CORE = "1 rank on 1 core, compiled"


def reference_of(name: str) -> str:
    return "1 rank, compiled" if name == ONE_CORE or LAYOUTS.get(name, REFERENCES.get(name, {})).get("compile") \
        else "1 rank"


def memory_short(path: str, models: int = len(REFERENCES) + 1 + len(LAYOUTS)) -> str | None:
    """Why `models` models (by default every layout) cannot be loaded at once here (each holds about the checkpoint's
    bytes over its ranks, more with replicated attention), or None."""
    need = 1.3 * models * sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > free:
        return f"{models} models at once need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def warm_up(model, vocab: int) -> None:
    """A first short batch-1 request, before any is timed (a compiled model compiles its signatures)."""
    model.generate(prompts(1, DECODE_PROMPT, vocab), max_new_tokens=4, ignore_eos=True)


def batch1_step(model, vocab: int, seed: int, new_tokens: int) -> tuple[float, list]:
    """(Seconds per decode step, the tokens) of one generation of `new_tokens` after a DECODE_PROMPT-token prompt."""
    tokens = model.generate(prompts(1, DECODE_PROMPT, vocab, seed), max_new_tokens=new_tokens, ignore_eos=True)
    return model.last_result.decode_seconds / (new_tokens - 1), tokens


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's thread count set to `n` inside (None: left as it is), the previous one restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def turn_order(names: list[str], r: int) -> list[str]:
    """Round r's order: reversed every other round, so that no one always runs right after the same neighbour."""
    return names if r % 2 == 0 else names[::-1]


def decode_steps_in_turns(path: str, dtype: str, gpus: int, threads: int, rounds: int = 8, new_tokens: int = 64,
                          layouts: tuple[str, ...] = tuple(LAYOUTS)) -> tuple[dict[str, float], list[str]]:
    """({"1 rank": median step seconds, "1 rank, compiled": ..., ONE_CORE: ..., layout: ...}, those of `layouts`
    whose greedy tokens differed from their 1-rank reference's (`reference_of`) in some round). The 1-rank models
    get `threads`, ONE_CORE and each of the `gpus` ranks threads // gpus."""
    from moe import MoEModel

    models = {}
    per_rank = max(1, threads // gpus)
    # The 1-rank models set this process's torch threads to `threads` at load; ONE_CORE runs (and compiles) with
    # `per_rank` inside its turns only.
    own_threads = {ONE_CORE: per_rank}
    try:
        for name, options in REFERENCES.items():
            models[name] = MoEModel.from_pretrained(path, dtype=dtype, threads=threads, **options)
        models[ONE_CORE] = MoEModel.from_pretrained(path, dtype=dtype, compile=True)
        for name in layouts:
            models[name] = MoEModel.from_pretrained(path, dtype=dtype, gpus=gpus, threads=per_rank, **LAYOUTS[name])
        vocab = models["1 rank"].config.vocab_size
        for name, model in models.items():
            with torch_threads(own_threads.get(name)):
                warm_up(model, vocab)
        steps: dict[str, list[float]] = {name: [] for name in models}
        differ: set[str] = set()
        for r in range(rounds):
            tokens = {}
            for name in turn_order(list(models), r):
                with torch_threads(own_threads.get(name)):
                    step, tokens[name] = batch1_step(models[name], vocab, r, new_tokens)
                steps[name].append(step)
            differ |= {name for name, out in tokens.items() if out != tokens[reference_of(name)]}
        return {name: statistics.median(s) for name, s in steps.items()}, [n for n in layouts if n in differ]
    finally:
        for model in models.values():
            model.close()


def print_steps_in_turns(steps: dict[str, float], differ: list[str], gpus: int, rounds: int) -> None:
    ones = "; ".join(f"{name} {steps[name] * 1e3:.2f} ms" for name in REFERENCES if name in steps)
    parts = [f"{name} {s * 1e3:.2f} ms = {s / steps[reference_of(name)]:.2f}x"
             for name, s in steps.items() if name not in REFERENCES]
    print(f"{gpus} ranks, batch-1 decode step, every layout loaded at once and measured in turns ({rounds} rounds): "
          f"{ones}; {'; '.join(parts)} its 1-rank step (eager against eager, compiled against compiled); greedy "
          "tokens as on 1 rank: " + (f"all but {', '.join(differ)} (a rounding apart)" if differ else "all"))
