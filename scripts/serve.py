"""Serve a model over OpenAI's HTTP API with continuous batching, on one rank or over N.

    python scripts/serve.py --ckpt weights/tiny-moe-austen-bbe --port 8000
    python scripts/serve.py --ckpt DIR --gpus 2

Flags and examples: `python scripts/serve.py --help`; the command itself is `moe.cli.serve`.
"""

import sys

from moe.cli.serve import main

sys.exit(main())
