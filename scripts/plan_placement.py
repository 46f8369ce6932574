"""Plan expert placement from an expert-load report: balance measured load, optionally replicate hot experts.

    python scripts/plan_placement.py load/expert_load.json --gpus 4 --replicas 2 --out placement.json
"""

import sys

from moe.cli.plan_placement import run

sys.exit(run())
