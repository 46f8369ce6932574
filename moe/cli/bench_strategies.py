"""`scripts/bench.py --strategies`: the sharding strategies side by side on the same ranks and weights.

Each strategy (the same attention and experts strategy for every block) runs as a case of its own, in a fresh
process: prefill 512, decode at batch 1 and 8, peak memory and weights per rank. Then, counted inside the rank
processes, the collectives of one decode step and the bytes each rank sends per token (ring algorithms, as
NCCL): the figures that carry over from gloo on CPUs to GPUs, where a collective costs mostly its latency.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe.bench.speed import PREFILL, checkpoint_config

ALL = ("layer/expert", "replicated/expert", "tensor/expert", "layer/tensor", "tensor/tensor", "replicated/tensor",
       "layer/layer", "layer/tensor:2", "tensor/tensor:2")


def strategies_for(spec: str, ranks: int) -> list[str]:
    """The strategies named by --strategies ('all': each that fits `ranks`; expert groups only on 4+ ranks)."""
    if spec != "all":
        return [s.strip() for s in spec.split(",") if s.strip()]
    return [s for s in ALL if not s.endswith(":2") or (ranks >= 4 and ranks % 2 == 0)]


def compare_strategies(args: argparse.Namespace, path: Path, run_case) -> int:
    from moe.bench.collectives import count_decode_step, strategy_plan

    cfg = checkpoint_config(path)
    names = strategies_for(args.strategies, args.gpus)
    for name in names:  # every plan checked before anything runs
        strategy_plan(cfg, args.gpus, name)
    print(f"model: {path.name}, dim {cfg.dim}, {cfg.n_layers} blocks, {cfg.n_heads} heads ({cfg.n_kv_heads} KV), "
          f"{cfg.n_experts} experts top-{cfg.top_k}, F {cfg.hidden_dim}, {args.dtype}; {args.gpus} ranks, "
          f"{args.threads} thread(s) in all; medians of {args.repeats} runs")
    one = run_case(args, "ours", 1, path)  # the 1-rank reference of the same run
    rows = {}
    for name in names:
        r = run_case(args, "ours", args.gpus, path, strategy=name)
        if r is None:
            continue
        counts = count_decode_step(str(path), args.gpus, "auto", args.dtype, strategy=name)
        r["collectives_per_step"] = max(c["collectives"] for c in counts)
        r["p2p_per_step"] = max(c["calls"].get("send", 0) for c in counts)
        r["kib_sent_per_token"] = [c["bytes_per_token"] / 1024 for c in counts]
        rows[name] = r
    print_strategies(rows)
    if one is not None:
        print(f"1 rank, same run: prefill {PREFILL / one['prefill_s']:.0f} tok/s, decode b1 "
              f"{1 / one['decode1_step_s']:.1f} tok/s, b8 {8 / one['decode8_step_s']:.1f} tok/s; decode step at batch "
              f"1 on {args.gpus} ranks over the 1-rank step: " + ", ".join(
                  f"{name} {r['decode1_step_s'] / one['decode1_step_s']:.2f}x" for name, r in rows.items()))
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "dtype": args.dtype, "threads": args.threads,
                                         "ranks": args.gpus, "strategies": rows}, indent=1) + "\n")
    share = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20 / args.gpus
    for name, r in rows.items():
        print(f"{name}: the fullest rank holds {100 * (max(r['weights_mib']) / share - 1):+.0f}% over an even share "
              f"of the weights ({share:.1f} MiB), its memory grew {max(r['loaded_over_baseline_mib']):.0f} MiB "
              "while loading")
    return 0


def print_strategies(rows: dict) -> None:
    print(f"{'attention/experts':>18} {'prefill':>8} {'decode b1':>9} {'decode b8':>9} {'collectives':>11} "
          f"{'sends':>5} {'KiB sent/token':>18} {'weights MiB':>17} {'peak RSS MiB':>19}")
    print(f"{'(every block)':>18} {'tok/s':>8} {'tok/s':>9} {'tok/s':>9} {'per step':>11} {'/step':>5} "
          f"{'per rank':>18} {'per rank':>17} {'per rank':>19}")

    def each(values, fmt: str) -> str:
        return "/".join(f"{v:{fmt}}" for v in values)

    for name, r in rows.items():
        print(f"{name:>18} {PREFILL / r['prefill_s']:>8.0f} {1 / r['decode1_step_s']:>9.1f} "
              f"{8 / r['decode8_step_s']:>9.1f} {r['collectives_per_step']:>11.1f} {r['p2p_per_step']:>5.1f} "
              f"{each(r['kib_sent_per_token'], '.1f'):>18} {each(r['weights_mib'], '.1f'):>17} "
              f"{each(r['peak_rss_mib'], '.0f'):>19}")
    hashes = {r["tokens8_hash"] for r in rows.values()}
    print(f"greedy tokens at batch 8: {'identical' if len(hashes) == 1 else 'DIFFERENT'} across the strategies")
