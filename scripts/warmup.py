"""Build the decode step's compiled packages for a checkpoint, so that generate, chat and the API load them.

    python scripts/warmup.py --ckpt weights/tiny-moe-austen-bbe
    python scripts/warmup.py --ckpt DIR --dtype int8 --batch 1 4 --length 256 1024
"""

import sys

from moe.cli.warmup import run

sys.exit(run())
