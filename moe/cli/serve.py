"""`scripts/serve.py` (`moe-serve`): an OpenAI-compatible server with continuous batching, on 1 or N ranks.

One engine loop owns the model: each step decodes one token for every running sequence, waiting requests join
between steps and finished or abandoned ones leave at once (`moe.serve`). Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import sys

from models.kernels.choice import CPU_KERNELS_HELP, KERNELS
from moe.cli.common import add_model_args, add_template_kwargs_arg, refuse_gpus_under_torchrun, run_command
from moe.parallel.distributed import under_torchrun
from moe.serve.reasoning import PARSERS

EXAMPLES = """examples:
  python scripts/serve.py --ckpt weights/tiny-moe-austen-bbe --port 8000
  python scripts/serve.py --ckpt DIR --gpus 2 --max-num-seqs 16 --api-key secret
  torchrun --nproc-per-node 2 scripts/serve.py --ckpt DIR

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "It is a truth", "max_tokens": 16, "temperature": 0}'
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="serve.py", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Serve a mixture-of-experts model over OpenAI's HTTP API.")
    add_model_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--attention", choices=["layer", "replicated", "tensor"], default="layer",
                    help="every block's attention (replicated: each rank attends the sequences it holds)")
    ap.add_argument("--experts", choices=["expert", "tensor", "layer"], default="expert", help="every block's experts")
    ap.add_argument("--cpu-kernels", choices=KERNELS, default="auto", help=CPU_KERNELS_HELP)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (KV-cache rows)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + completion tokens per sequence (default: the model's context, at most 4096)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait beyond the free slots; more get 503 at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prompt tokens prefilled per step (a longer prompt: in chunks of this size, one a step)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model's name in the API (default: the folder's, or a Hub snapshot's org/name)")
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 and /tokenize")
    ap.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="on SIGTERM, how long running requests may take to finish (default 30)")
    ap.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get 413")
    ap.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                    help="auto (default): the sampling values a request leaves out come from the checkpoint's "
                         "generation_config.json where it sets them; vllm: OpenAI's defaults (temperature 1, the rest "
                         "off), as vLLM's flag of that name")
    add_template_kwargs_arg(ap, "every chat request that does not set them (its chat_template_kwargs win)")
    ap.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                    help="a thinking model's <think> part of a chat answer as the message's `reasoning` (and "
                         "`reasoning_content`), the rest as its `content`, as vLLM's flag of that name")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="eager decode steps. By default one CPU rank runs compiled ones: a step for every batch size "
                         "up to --max-num-seqs, built at start-up before /health turns 200 where the step cache does "
                         "not hold it yet (20-30 s each for a small model on 2 cores, once); so does a pipeline on N "
                         "ranks (--experts layer), compiled at every start")
    return ap


def main(argv: list[str] | None = None) -> int:
    return run_command(serve_command, parser().parse_args(argv))


def serve_command(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("the server needs its extra: pip install 'moe-shard[serve]' (starlette, uvicorn)") from None
    from moe.serve.launch import ServeOptions, serve, serve_ranks

    refuse_gpus_under_torchrun(args)
    if args.placement and args.gpus == 1 and not under_torchrun():
        raise ValueError("--placement places blocks and experts over N ranks: give --gpus N, or run under torchrun")
    for flag in ("port", "max_num_seqs", "max_queue", "max_num_batched_tokens", "max_body_bytes"):
        if getattr(args, flag) < (0 if flag == "max_queue" else 1):
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    options = ServeOptions(args.ckpt, args.host, args.port, args.dtype, args.device, args.max_num_seqs,
                           args.max_model_len, args.max_queue, args.max_num_batched_tokens, args.served_model_name,
                           args.api_key, args.max_body_bytes, args.drain_timeout, args.threads, args.attention,
                           args.experts, args.placement, args.timeout, not args.quiet, args.compile,
                           args.generation_config == "auto", args.chat_template_kwargs, args.reasoning_parser,
                           cpu_kernels=args.cpu_kernels)
    if args.gpus > 1 and not under_torchrun():
        return serve_ranks(options, args.gpus)
    return serve(options)


if __name__ == "__main__":
    sys.exit(main())
