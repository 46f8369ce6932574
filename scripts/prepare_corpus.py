"""Rebuild the training corpus offline (Jane Austen's six novels + the Bible in Basic English) and train
its SentencePiece BPE tokenizer.

    python scripts/prepare_corpus.py --out data/corpus

Writes train.txt and valid.txt (one paragraph per line, an empty line between chapters; every 20th
chapter held out) and tokenizer.model. Sources are downloaded once into --cache.
"""

import sys

from moe.cli.prepare_corpus import run

sys.exit(run())
