"""`scripts/evaluate.py`: nats per token and bits per byte of a checkpoint on a text file, on any ranks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from moe import MoEModel
from moe.cli.common import add_model_args, refuse_gpus_under_torchrun, run_command, say_from
from moe.evaluation import score_text
from moe.progress import Progress
from moe.training.corpus import read_documents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="evaluate.py", description="Score a checkpoint on a text file: nats per "
                                 "token and bits per byte (documents separated by empty lines, each opened with BOS "
                                 "and closed with EOS, scored in consecutive windows).")
    add_model_args(ap)
    ap.add_argument("--text", required=True, help="UTF-8 text file")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens predicted per window (default 256)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    return ap.parse_args(argv)


def read_text(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"--text {path}: no such file")
    try:
        docs = read_documents(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not docs:
        raise ValueError(f"--text {path}: no text to score")
    return docs


def evaluate(args: argparse.Namespace) -> int:
    refuse_gpus_under_torchrun(args)
    path = Path(args.text)
    docs = read_text(path)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, device=args.device, gpus=args.gpus,
                                  threads=args.threads, placement=args.placement, progress=not args.quiet,
                                  timeout_s=args.timeout) as model:
        if args.seq_len > model.config.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's context ({model.config.max_seq_len})")
        shown = Progress("scoring", unit="window", enabled=not args.quiet and model.rank == 0)
        score = score_text(model, docs, model.tokenizer, args.seq_len, args.batch_size, shown)
        say = say_from(model.rank)
    say(f"{path}: {len(docs)} documents, {score.bytes:,} bytes, {score.tokens:,} tokens scored "
        f"({score.bytes / score.tokens:.2f} bytes/token) in {time.perf_counter() - t0:.1f} s")
    say(f"{score.nats_per_token:.4f} nats/token | {score.bits_per_byte:.4f} bits/byte")
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(evaluate, parse_args(argv))
