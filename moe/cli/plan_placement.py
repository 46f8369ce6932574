"""`scripts/plan_placement.py`: place experts over ranks to balance a measured load, optionally replicating
the hottest experts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe.cli.common import run_command
from moe.parallel.placement import Placement
from moe.reports.planner import plan_placement, predicted_imbalance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="plan_placement.py",
                                 description="Place experts over ranks to balance a measured load.")
    ap.add_argument("report", help="expert_load.json written by scripts/expert_load.py or generate.py")
    ap.add_argument("--gpus", type=int, required=True, help="number of ranks to place over")
    ap.add_argument("--replicas", type=int, default=0,
                    help="give the R hottest experts of each block an extra replica on another rank (default 0)")
    ap.add_argument("--out", required=True, help="placement JSON to write (use with --placement)")
    return ap.parse_args(argv)


def read_counts(path: Path) -> tuple[torch.Tensor, Placement | None, tuple[int, ...]]:
    """The report's counts, the placement it was measured under, and its blocks without experts."""
    try:
        data = json.loads(path.read_text())
        counts = torch.tensor(data["counts"], dtype=torch.float64)
        dense = tuple(int(i) for i in data.get("dense_blocks", ()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not an expert_load.json report ({e})") from None
    if counts.dim() != 2:
        raise ValueError(f"{path}: 'counts' must be a [blocks][experts] table")
    base = Placement.from_json(data["placement"]) if "placement" in data else None
    return counts, base, dense


def _plan(args: argparse.Namespace) -> int:
    counts, base, dense = read_counts(Path(args.report))
    if args.gpus < 1 or args.replicas < 0:
        raise ValueError("--gpus must be >= 1 and --replicas >= 0")
    L, E = counts.shape
    default = Placement.default(L, E, args.gpus)
    before = base if base is not None and base.world_size == args.gpus else default
    plan = plan_placement(counts, args.gpus, args.replicas, before, dense).validate(L, E, args.gpus)
    print(plan.table())
    print(f"predicted max/mean rank load (mean over blocks with experts): default "
          f"{predicted_imbalance(counts, default, dense):.3f}"
          + (f", current {predicted_imbalance(counts, before, dense):.3f}" if before is not default else "")
          + f", planned {predicted_imbalance(counts, plan, dense):.3f}")
    plan.save(args.out)
    print(f"wrote {args.out}")
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(_plan, parse_args(argv))
