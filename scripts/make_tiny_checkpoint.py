"""Write a small random-weight Mixtral checkpoint (HF layout) with a SentencePiece tokenizer trained on a text.

Used for the shipped `weights/` example and by tests that need a checkpoint with a real tokenizer.
"""

import sys

from moe.cli.make_tiny_checkpoint import run

sys.exit(run())
