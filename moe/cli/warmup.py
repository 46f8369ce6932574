"""Build the decode step's compiled packages ahead of time (`moe.engine.ahead`), so that later runs load them.

    python scripts/warmup.py --ckpt weights/tiny-moe-austen-bbe
    python scripts/warmup.py --ckpt DIR --dtype int8 --batch 1 4 --length 256 1024
"""

from __future__ import annotations

import argparse
import time

from moe.cli.common import run_command


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (Hugging Face or Mistral consolidated)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"], default=None,
                    help="as generate's --dtype (a package serves one dtype)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (the packages run on any number)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], metavar="B",
                    help="batch sizes: one package each (default 1)")
    ap.add_argument("--length", type=int, nargs="+", default=[256], metavar="L",
                    help="positions a request holds, prompt and new tokens (rounded up to 256; default 256)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return ap


def warmup(args: argparse.Namespace) -> int:
    import torch

    from moe import MoEModel
    from moe.engine.ahead import cache_dir

    for flag, values in (("batch", args.batch), ("length", args.length)):
        if any(v < 1 for v in values):
            raise ValueError(f"--{flag} {' '.join(map(str, values))}: each must be a positive integer")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, compile=True, progress=False)
    ahead = getattr(model.engine, "ahead", None)
    if ahead is None:
        raise ValueError(f"compiled packages run on one CPU rank with the native kernels; this model runs "
                         f"{model.info.kernels}")
    limit = model.config.max_seq_len
    for batch in args.batch:
        for length in args.length:
            if length > limit:
                raise ValueError(f"--length {length}: the model holds at most {limit} positions")
            t0 = time.perf_counter()
            slots = ahead.cache_length(batch, length)
            state = "ready" if ahead.step_at(batch, slots) is not None else "not built"
            print(f"batch {batch}, {slots} cache slots: {state} ({time.perf_counter() - t0:.1f} s)")
    print(f"step cache: {cache_dir()}")
    return 0


def run(argv: list[str] | None = None) -> int:
    return run_command(warmup, parser().parse_args(argv))
