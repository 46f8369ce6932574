"""`scripts/shard.py`: re-shard a checkpoint into Hugging Face files, optionally aligned to ranks."""

from __future__ import annotations

import argparse

from moe.checkpoint.convert import parse_size
from moe.checkpoint.formats import detect
from moe.checkpoint.reshard import reshard
from moe.cli.common import run_command
from moe.parallel.placement import Placement, resolve_placement
from moe.progress import Progress

SHARD_HELP = """examples:
  python scripts/shard.py --ckpt DIR --out OUT --max-shard-size 200MB
  python scripts/shard.py --ckpt DIR --out OUT --max-shard-size 200MB --gpus 4        # rank-aligned
  python scripts/shard.py --ckpt DIR --out OUT --placement placement.json            # rank-aligned

Rank-aligned: each rank's tensors (under the default placement for --gpus N, or the given one) go to files
of their own, so a rank loading with that placement opens only its files. Tensors several ranks read
(replicated experts, tied embeddings) share files of their own. Memory stays within about one output file.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard.py", epilog=SHARD_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Re-shard a checkpoint into Hugging Face safetensors files.")
    ap.add_argument("--ckpt", required=True, help="source checkpoint (Hugging Face or Mistral consolidated)")
    ap.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    ap.add_argument("--max-shard-size", default="200MB", help="largest file, e.g. 200MB, 1GB (default 200MB)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=int, help="align files to the default placement over this many ranks")
    where.add_argument("--placement", help="align files to this placement JSON (scripts/plan_placement.py)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return ap.parse_args(argv)


def shard(args: argparse.Namespace) -> int:
    cfg = detect(args.ckpt).config
    plan = None
    if args.placement:
        loaded = Placement.load(args.placement)
        plan = resolve_placement(loaded, cfg, loaded.world_size)
    elif args.gpus is not None:
        plan = resolve_placement(None, cfg, args.gpus)
    result = reshard(args.ckpt, args.out, parse_size(args.max_shard_size), plan,
                     Progress("writing", unit="B", enabled=not args.quiet))
    for fname, ranks in result["files"].items():
        who = "" if plan is None else "  read by rank " + ",".join(map(str, ranks))
        print(f"  {fname}{who}")
    print(f"wrote {args.out} ({len(result['files'])} file(s))")
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(shard, parse_args(argv))
