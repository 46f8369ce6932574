"""`scripts/train.py`: train a small Mixtral-style model on the prepared corpus, on one rank or N
expert-parallel ranks."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.config import ConfigError
from moe.checkpoint.files import CheckpointError
from moe.cli.common import run_command
from moe.parallel.devices import DEVICES
from moe.tokenizer import SentencePieceTokenizer
from moe.training.steps import TrainSettings
from moe.training.trainer import TrainJob, run_training

EXAMPLES = """examples:
  python scripts/prepare_corpus.py --out data/corpus
  python scripts/train.py --corpus data/corpus --out weights/my-model --gpus 2 --threads 1 --minutes 20

Each rank holds the dense weights (gradients all-reduced) and its share of the experts; tokens reach the
experts by all-to-all, as in inference. The result is a Hugging Face directory any entry point loads.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train.py", epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Train a small Mixtral-style model, expert-parallel over N ranks.")
    ap.add_argument("--corpus", type=Path, required=True, help="directory with train.txt, valid.txt, tokenizer.model")
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (must not exist)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks (expert parallel)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--minutes", type=float, default=20.0, help="time budget; sets the schedule's length")
    ap.add_argument("--steps", type=int, help="fixed number of steps instead of --minutes")
    ap.add_argument("--device", choices=DEVICES, default="auto",
                    help="auto (default): CUDA when there is a GPU per rank, CPU when there is none; cuda; cpu")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    model = ap.add_argument_group("model")
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--hidden-dim", type=int, default=256, help="expert feed-forward width")
    model.add_argument("--experts", type=int, default=8)
    model.add_argument("--top-k", type=int, default=2)
    opt = ap.add_argument_group("optimisation")
    defaults = TrainSettings()
    opt.add_argument("--seq-len", type=int, default=defaults.seq_len)
    opt.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step, all ranks")
    opt.add_argument("--lr", type=float, default=defaults.lr)
    opt.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    opt.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    opt.add_argument("--balance-coef", type=float, default=defaults.balance_coef)
    opt.add_argument("--eval-every", type=int, default=200)
    opt.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def job_from_args(args: argparse.Namespace) -> TrainJob:
    """A checked job: every problem with the flags or the corpus is found before a rank starts."""
    for name in ("train.txt", "valid.txt", "tokenizer.model"):
        if not (args.corpus / name).is_file():
            raise FileNotFoundError(f"--corpus {args.corpus}: no {name} (run scripts/prepare_corpus.py)")
    if args.out.exists():
        raise CheckpointError(f"--out {args.out}: already exists")
    if args.dim % args.heads or args.heads % args.kv_heads:
        raise ConfigError(f"--dim {args.dim}, --heads {args.heads}, --kv-heads {args.kv_heads} do not divide")
    if args.batch_size % args.gpus:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --gpus {args.gpus}")
    vocab = SentencePieceTokenizer(args.corpus / "tokenizer.model").vocab_size
    return TrainJob(
        corpus=str(args.corpus), out=str(args.out), threads=args.threads, minutes=args.minutes, steps=args.steps,
        eval_every=args.eval_every, progress=not args.quiet, device=args.device,
        model=dict(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                   head_dim=args.dim // args.heads, hidden_dim=args.hidden_dim, vocab_size=vocab,
                   n_experts=args.experts, top_k=args.top_k, max_seq_len=4 * args.seq_len, rope_theta=10000.0),
        settings=TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                               warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                               grad_clip=args.grad_clip, balance_coef=args.balance_coef, seed=args.seed))


def train(args: argparse.Namespace) -> int:
    run_training(job_from_args(args), args.gpus)
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(train, parse_args(argv))
