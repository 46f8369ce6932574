"""Train a small Mixtral-style model on the prepared corpus, on one rank or N expert-parallel ranks.

    python scripts/prepare_corpus.py --out data/corpus
    python scripts/train.py --corpus data/corpus --out weights/my-model --gpus 2 --minutes 20

Each rank holds the dense weights (gradients all-reduced) and its share of the experts; tokens reach the
experts by all-to-all, as in inference. The result is a Hugging Face directory any entry point loads.
"""

import sys

from moe.cli.train import run

sys.exit(run())
