"""Plan expert placement from an expert-load report: balance measured load, optionally replicate hot experts.

    python scripts/plan_placement.py load/expert_load.json --gpus 4 --replicas 2 --out placement.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.cli.expert_load import plan_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Place experts over ranks to balance a measured load.")
    ap.add_argument("report", help="expert_load.json written by scripts/expert_load.py or generate.py")
    ap.add_argument("--gpus", type=int, required=True, help="number of ranks to place over")
    ap.add_argument("--replicas", type=int, default=0,
                    help="give the R hottest experts of each block an extra replica on another rank (default 0)")
    ap.add_argument("--out", required=True, help="placement JSON to write (use with --placement)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(plan_main(parse_args()))
