"""Speed against Hugging Face transformers and against the machine's own bounds.

    python scripts/bench.py --size small --threads 2 --gpus 4 --json bench.json

The cases, the bounds and every flag: `python scripts/bench.py --help` (the command is `moe.cli.bench`).
"""

import sys

from moe.cli.bench import run

sys.exit(run())
