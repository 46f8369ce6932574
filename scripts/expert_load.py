"""Run prompts and write an expert-load report (JSON, CSV, heatmap PNG, and a table on the terminal).

    python scripts/expert_load.py --ckpt weights/tiny-random-mixtral --gpus 4 --prompt-file prompts.txt --out load/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.cli.expert_load import expert_load_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Measure which experts and ranks receive how many tokens.")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for more")
    ap.add_argument("--prompt-file", help="file with one prompt per non-empty line")
    ap.add_argument("--out", required=True, help="directory for expert_load.json/.csv/.png")
    ap.add_argument("--gpus", type=int, default=1, help="number of ranks")
    ap.add_argument("--placement", default=None, help="placement plan JSON to measure under")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--debug-routing", action="store_true", help="round-robin routing (exact, known loads)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(expert_load_main(parse_args()))
