"""Score a checkpoint on a text file: nats per token and bits per byte.

    python scripts/evaluate.py --ckpt weights/tiny-moe-austen-bbe --text data/corpus/valid.txt

Documents are separated by empty lines; each is opened with BOS and closed with EOS, and the stream is
scored in consecutive windows of --seq-len tokens. Bits per byte divides by the text's UTF-8 size, so the
figure compares across tokenizers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe import MoEModel  # noqa: E402
from moe.cli.generate import run_command  # noqa: E402
from moe.evaluation import score_text  # noqa: E402
from moe.training.corpus import read_documents  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (with tokenizer.model)")
    ap.add_argument("--text", required=True, help="UTF-8 text file")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens predicted per window (default 256)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks to shard the model over")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (per rank)")
    return ap.parse_args(argv)


def evaluate(args: argparse.Namespace) -> int:
    path = Path(args.text)
    if not path.is_file():
        raise FileNotFoundError(f"--text {path}: no such file")
    try:
        docs = read_documents(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not docs:
        raise ValueError(f"--text {path}: no text to score")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, gpus=args.gpus, threads=args.threads) as model:
        if args.seq_len > model.config.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's context ({model.config.max_seq_len})")
        score = score_text(model, docs, model.tokenizer, args.seq_len, args.batch_size)
    print(f"{path}: {len(docs)} documents, {score.bytes:,} bytes, {score.tokens:,} tokens scored "
          f"({score.bytes / score.tokens:.2f} bytes/token) in {time.perf_counter() - t0:.1f} s")
    print(f"{score.nats_per_token:.4f} nats/token | {score.bits_per_byte:.4f} bits/byte")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(evaluate, parse_args()))
