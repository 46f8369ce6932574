"""Convert a checkpoint between Hugging Face and Mistral consolidated layouts, and between fp32 / bf16 / fp16.

    python scripts/convert.py --ckpt weights/tiny-random-mixtral --out /tmp/consolidated --format mistral
    python scripts/convert.py --ckpt /tmp/consolidated --out /tmp/hf-bf16 --format hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.checkpoint.convert import convert_checkpoint, parse_size  # noqa: E402
from moe.cli.generate import run_command  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Convert checkpoint layout and dtype.")
    ap.add_argument("--ckpt", required=True, help="source checkpoint directory (either layout)")
    ap.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    ap.add_argument("--format", choices=["hf", "mistral"], default="hf", help="output layout (default hf)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="output dtype (default: the source's)")
    ap.add_argument("--max-shard-size", default=None, help="split HF output into files of at most this, e.g. 200MB")
    return ap.parse_args(argv)


def convert(args: argparse.Namespace) -> int:
    size = parse_size(args.max_shard_size) if args.max_shard_size else None
    out = convert_checkpoint(args.ckpt, args.out, args.format, args.dtype, size)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(convert, parse_args()))
