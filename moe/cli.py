"""What the scripts do, kept out of `scripts/` so they stay thin: read prompts, run, print, report errors."""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

import torch

from models.config import ConfigError
from moe.api import MoEModel
from moe.checkpoint.files import CheckpointError

USER_ERRORS = (CheckpointError, ConfigError, ValueError, FileNotFoundError)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {path}: no such file")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def generate_main(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, gpus=args.gpus)
    load_s = time.perf_counter() - t0
    with model:
        cfg = model.config
        print(f"model: {args.ckpt} ({model.info['format']}), {cfg.n_layers} blocks, "
              f"{cfg.n_experts} experts top-{cfg.top_k}, dim {cfg.dim}; ranks: {args.gpus}")
        seed = args.seed if args.seed is not None else random.randrange(2**31)
        print(f"settings: max_new_tokens={args.max_new_tokens} temperature={args.temperature} top_p={args.top_p} "
              f"top_k={args.top_k} seed={seed} dtype={model.info['dtype']} prompts={len(prompts)}")
        single = len(prompts) == 1
        streamer = (lambda b, piece: print(piece, end="", flush=True)) if single else None
        if single:
            print(prompts[0], end="", flush=True)
        outputs = model.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, seed=seed, streamer=streamer)
        print()
        if not single:
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
                print(f"[{i}] {p}{o}")
        r = model.last_result
        decode_tokens = max(r.new_tokens - len(prompts), 0)
        prefill_rate = r.prompt_tokens / r.prefill_seconds
        print(f"load {load_s:.2f} s | prompt {r.prompt_tokens} tok at {prefill_rate:.1f} tok/s | "
              f"generated {r.new_tokens} tok at {decode_tokens / max(r.decode_seconds, 1e-9):.1f} tok/s | "
              f"peak RSS {peak_rss_mib():.0f} MiB")
    return 0
