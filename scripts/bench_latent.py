"""What the latent cache buys at long contexts (DeepSeek's multi-head latent attention): decode time and cache size,
absorbed form against expanded.

    python scripts/bench_latent.py --size deepseek --contexts 512 2048 8192
"""

import sys

from moe.cli.bench_latent import run

sys.exit(run())
