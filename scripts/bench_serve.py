"""Our server under load, beside llama-server on the same weights and threads (vLLM's serving metrics).

    python scripts/bench_serve.py --size small --threads 2 --concurrency 1,2,4,8,16
    LLAMA_CPP_DIR=~/llama.cpp python scripts/bench_serve.py --size small --against llama-server

Flags: `python scripts/bench_serve.py --help`; the command itself is `moe.cli.bench_serve`.
"""

import sys

from moe.cli.bench_serve import run

sys.exit(run())
