"""Expert-load and placement-planning commands (scripts/expert_load.py, scripts/plan_placement.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe.api import MoEModel
from moe.cli.common import read_prompts, run_command
from moe.parallel.placement import Placement
from moe.reports.expert_load import ExpertLoadReport
from moe.reports.planner import plan_placement, predicted_imbalance


def report_out(report: ExpertLoadReport, out_dir: str | Path) -> None:
    print(report.table())
    for path in report.write(out_dir):
        print(f"wrote {path}")


def expert_load_main(args: argparse.Namespace) -> int:
    return run_command(_expert_load, args)


def _expert_load(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    with MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, gpus=args.gpus, placement=args.placement) as model:
        if args.debug_routing:
            model.set_debug_routing(True)
        model.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=0, seed=0)
        report_out(model.expert_load(), args.out)
    return 0


def read_counts(path: Path) -> tuple[torch.Tensor, Placement | None]:
    try:
        data = json.loads(path.read_text())
        counts = torch.tensor(data["counts"], dtype=torch.float64)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not an expert_load.json report ({e})") from None
    if counts.dim() != 2:
        raise ValueError(f"{path}: 'counts' must be a [blocks][experts] table")
    base = Placement.from_json(data["placement"]) if "placement" in data else None
    return counts, base


def plan_main(args: argparse.Namespace) -> int:
    return run_command(_plan, args)


def _plan(args: argparse.Namespace) -> int:
    counts, base = read_counts(Path(args.report))
    if args.gpus < 1 or args.replicas < 0:
        raise ValueError("--gpus must be >= 1 and --replicas >= 0")
    L, E = counts.shape
    default = Placement.default(L, E, args.gpus)
    before = base if base is not None and base.world_size == args.gpus else default
    plan = plan_placement(counts, args.gpus, args.replicas, before).validate(L, E, args.gpus)
    print(plan.table())
    print(f"predicted max/mean rank load (mean over blocks): default {predicted_imbalance(counts, default):.3f}"
          + (f", current {predicted_imbalance(counts, before):.3f}" if before is not default else "")
          + f", planned {predicted_imbalance(counts, plan):.3f}")
    plan.save(args.out)
    print(f"wrote {args.out}")
    return 0
