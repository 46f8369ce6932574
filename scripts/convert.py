"""Convert a checkpoint between Hugging Face and Mistral consolidated layouts, and between fp32 / bf16 / fp16.

    python scripts/convert.py --ckpt weights/tiny-random-mixtral --out /tmp/consolidated --format mistral
    python scripts/convert.py --ckpt /tmp/consolidated --out /tmp/hf-bf16 --format hf --dtype bfloat16
"""

import sys

from moe.cli.convert import run

sys.exit(run())
