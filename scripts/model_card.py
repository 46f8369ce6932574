"""Write the model card (README.md) of a checkpoint trained by scripts/train.py, with its figures.

    python scripts/model_card.py --ckpt weights/tiny-moe-austen-bbe --corpus data/corpus --gpus 4

Measures everything it states: validation loss (as scripts/evaluate.py does), an expert-load run on held-out
text over --gpus ranks (heatmap), samples; draws the loss curve from the checkpoint's training_log.json.
"""

import sys

from moe.cli.model_card import run

sys.exit(run())
