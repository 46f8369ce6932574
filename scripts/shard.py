"""Re-shard a checkpoint into Hugging Face safetensors files, optionally aligned to ranks.

    python scripts/shard.py --ckpt DIR --out OUT --max-shard-size 200MB --gpus 4

What rank-aligned means and every flag: `python scripts/shard.py --help` (the command is `moe.cli.shard`).
"""

import sys

from moe.cli.shard import run

sys.exit(run())
