"""`scripts/convert.py`: convert a checkpoint between layouts (Hugging Face, Mistral) and dtypes."""

from __future__ import annotations

import argparse

from moe.checkpoint.convert import convert_checkpoint, parse_size
from moe.cli.common import run_command
from moe.progress import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Convert checkpoint layout and dtype.")
    ap.add_argument("--ckpt", required=True, help="source checkpoint directory (either layout)")
    ap.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    ap.add_argument("--format", choices=["hf", "mistral"], default="hf", help="output layout (default hf)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                    help="output dtype (default: the source's)")
    ap.add_argument("--max-shard-size", default=None, help="split HF output into files of at most this, e.g. 200MB")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return ap.parse_args(argv)


def convert(args: argparse.Namespace) -> int:
    size = parse_size(args.max_shard_size) if args.max_shard_size else None
    out = convert_checkpoint(args.ckpt, args.out, args.format, args.dtype, size,
                             Progress("writing", unit="B", enabled=not args.quiet))
    print(f"wrote {out}")
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(convert, parse_args(argv))
