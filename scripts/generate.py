"""Generate text from a Mixtral/Mistral checkpoint, on one rank or with experts and layers over N ranks.

    python scripts/generate.py --ckpt weights/tiny-moe-austen-bbe --gpus 4 --prompt "It is a truth"
    torchrun --nproc-per-node 4 scripts/generate.py --ckpt weights/tiny-moe-austen-bbe --prompt "It is a truth"

Flags and examples: `python scripts/generate.py --help`; the command itself is `moe.cli.generate`.
"""

import sys

from moe.cli.generate import main

sys.exit(main())
