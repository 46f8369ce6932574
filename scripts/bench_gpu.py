"""Decode speed, host syncs per decode step and memory on the GPUs found (needs CUDA).

    python scripts/bench_gpu.py --size small --dtypes float32,bfloat16

Every flag: `python scripts/bench_gpu.py --help` (the command is `moe.cli.bench_gpu`).
"""

import sys

from moe.cli.bench_gpu import run

sys.exit(run())
