"""Generate text from a Mixtral/Mistral checkpoint, on one rank or with experts and layers over N ranks.

    python scripts/generate.py --ckpt weights/tiny-random-mixtral --gpus 4 --prompt "And God said"
    torchrun --nproc-per-node 4 scripts/generate.py --ckpt weights/tiny-random-mixtral --prompt "And God said"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.cli import generate_main  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Generate text with a mixture-of-experts model sharded over ranks.")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (Hugging Face or Mistral consolidated)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    ap.add_argument("--prompt-file", help="file with one prompt per non-empty line")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0 = off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="weights and activations dtype (default: the checkpoint's, else float32)")
    ap.add_argument("--gpus", type=int, default=1, help="number of ranks (GPUs, or CPU processes without CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    ap.add_argument("--placement", default=None,
                    help="placement plan JSON (owner rank of embedding, blocks, head; ranks of every expert)")
    ap.add_argument("--blocks-per-rank", default=None,
                    help="comma-separated block counts per rank, e.g. 3,2,2,1 (default: balanced ranges)")
    ap.add_argument("--attention", choices=["owner", "replicated"], default="owner",
                    help="owner: each block's attention on one rank (layer placement, default); replicated: every "
                         "rank holds the dense weights and runs its slice of the batch (throughput on batches)")
    ap.add_argument("--cpu-kernels", choices=["onednn", "torch"], default="onednn",
                    help="on CPU: linear weights packed for oneDNN (default, faster) or plain torch products")
    ap.add_argument("--expert-load", default=None, metavar="DIR",
                    help="after generating, write an expert-load report (JSON, CSV, PNG) to DIR")
    ap.add_argument("--master-port", type=int, default=None,
                    help="port for the ranks to meet on 127.0.0.1 (default: a free one)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(generate_main(parse_args()))
