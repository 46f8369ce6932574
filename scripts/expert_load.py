"""Run prompts and write an expert-load report (JSON, CSV, heatmap PNG, and a table on the terminal).

    python scripts/expert_load.py --ckpt weights/tiny-random-mixtral --gpus 4 --prompt-file prompts.txt --out load/
"""

import sys

from moe.cli.expert_load import run

sys.exit(run())
