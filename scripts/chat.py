"""Chat with an instruct model through its chat template, on one rank or over N.

    python scripts/chat.py --ckpt DIR
    python scripts/chat.py --ckpt DIR --gpus 2 --system "Answer briefly."

Flags and examples: `python scripts/chat.py --help`; the command itself is `moe.cli.chat`.
"""

import sys

from moe.cli.chat import main

sys.exit(main())
