"""Score a checkpoint on a text file: nats per token and bits per byte.

    python scripts/evaluate.py --ckpt weights/tiny-moe-austen-bbe --text data/corpus/valid.txt

Documents are separated by empty lines; each is opened with BOS and closed with EOS, and the stream is
scored in consecutive windows of --seq-len tokens. Bits per byte divides by the text's UTF-8 size, so the
figure compares across tokenizers.
"""

import sys

from moe.cli.evaluate import run

sys.exit(run())
