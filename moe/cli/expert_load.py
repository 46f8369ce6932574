"""`scripts/expert_load.py`: run prompts and write an expert-load report (JSON, CSV, heatmap, a table)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe.api import MoEModel
from moe.cli.common import add_model_args, read_prompts, refuse_gpus_under_torchrun, run_command
from moe.progress import Progress
from moe.reports.expert_load import ExpertLoadReport


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="expert_load.py",
                                 description="Measure which experts and ranks receive how many tokens.")
    add_model_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for more")
    ap.add_argument("--prompt-file", help="file with one prompt per non-empty line; - reads standard input")
    ap.add_argument("--out", required=True, help="directory for expert_load.json/.csv/.png")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    ap.add_argument("--debug-routing", action="store_true", help="round-robin routing (exact, known loads)")
    return ap.parse_args(argv)


def report_out(report: ExpertLoadReport, out_dir: str | Path) -> None:
    print(report.table())
    for path in report.write(out_dir):
        print(f"wrote {path}")


def expert_load(args: argparse.Namespace) -> int:
    refuse_gpus_under_torchrun(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    prompts = read_prompts(args)
    with MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, device=args.device, gpus=args.gpus,
                                  placement=args.placement, threads=args.threads, progress=not args.quiet,
                                  timeout_s=args.timeout) as model:
        model.track_router_entropy()
        if args.debug_routing:
            model.set_debug_routing(True)
        with Progress("prompts", unit="prompt", enabled=not args.quiet and model.rank == 0) as shown:
            shown.start(len(prompts))
            for i in range(0, len(prompts), args.batch_size):
                batch = prompts[i:i + args.batch_size]
                model.generate(batch, max_new_tokens=args.max_new_tokens, temperature=0, seed=0)
                shown.update(len(batch))
        report = model.expert_load()  # every rank takes part in gathering the counters
        if model.rank == 0:
            report_out(report, args.out)
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(expert_load, parse_args(argv))
