"""What the scripts do, kept out of `scripts/` so they stay thin: read prompts, run, print, report errors.

Two ways to run N ranks: `--gpus N` starts them as local processes (via `MoEModel`); under torchrun each
process is one rank and runs the same generation loop in lock-step (output from rank 0 only).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from models.config import ConfigError
from moe.api import MoEModel, resolve_placement
from moe.checkpoint.files import CheckpointError
from moe.checkpoint.formats import detect
from moe.distributed import from_torchrun, pick_backend
from moe.generation import GenerationResult, SamplingParams, check_prompts, generate_tokens
from moe.launcher import RankFailure, cpu_threads_per_rank
from moe.placement import PlacementError
from moe.tokenizer import IncrementalDecoder, Tokenizer

USER_ERRORS = (CheckpointError, ConfigError, PlacementError, ValueError, FileNotFoundError)


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


def parse_blocks_per_rank(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--blocks-per-rank {text!r} must be comma-separated integers, e.g. 3,2,2,1") from None


def run_command(command, args: argparse.Namespace) -> int:
    """Run a command; a user error is one line and exit 2, a failed rank one line and exit 1."""
    try:
        return command(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def generate_main(args: argparse.Namespace) -> int:
    return run_command(_generate, args)


def _generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    cfg = detect(args.ckpt).config
    dist = from_torchrun()
    if dist is not None:
        return _generate_torchrun(args, prompts, seed, cfg, dist)
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = None
    if args.gpus > 1 or args.placement:
        plan = resolve_placement(args.placement, cfg.n_layers, cfg.n_experts, args.gpus,
                                 parse_blocks_per_rank(args.blocks_per_rank))
        print(plan.table())
        if args.attention == "replicated":
            print("attention replicated: every rank holds the embedding, all blocks' attention and the head, "
                  "and runs its slice of the batch; experts as above")
        if pick_backend(args.gpus)[0] == "gloo":
            threads = args.threads or cpu_threads_per_rank(args.gpus)
            print(f"no {args.gpus} CUDA devices: running {args.gpus} ranks as CPU processes over gloo, "
                  f"{threads} thread(s) each")
    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, gpus=args.gpus, placement=plan,
                                     master_port=args.master_port, threads=args.threads, progress=True,
                                     attention=args.attention, cpu_kernels=args.cpu_kernels)
    load_s = time.perf_counter() - t0
    with model:
        print(f"model: {args.ckpt} ({model.info['format']}), {cfg.n_layers} blocks, "
              f"{cfg.n_experts} experts top-{cfg.top_k}, dim {cfg.dim}; ranks: {args.gpus}")
        print_settings(args, seed, model.info["dtype"], len(prompts))
        single = len(prompts) == 1
        if single:
            print(prompts[0], end="", flush=True)
        streamer = (lambda b, piece: print(piece, end="", flush=True)) if single else None
        outputs = model.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, top_k=args.top_k, seed=seed, streamer=streamer)
        print()
        if not single:
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
                print(f"[{i}] {p}{o}")
        print(summary(load_s, model.last_result, len(prompts), model.engine.peak_memory_mib()))
        if args.expert_load:
            from moe.cli_load import report_out

            report_out(model.expert_load(), args.expert_load)
    return 0


def print_settings(args: argparse.Namespace, seed: int, dtype: str, n_prompts: int) -> None:
    print(f"settings: max_new_tokens={args.max_new_tokens} temperature={args.temperature} top_p={args.top_p} "
          f"top_k={args.top_k} seed={seed} dtype={dtype} prompts={n_prompts}")


def summary(load_s: float, r: GenerationResult, n_prompts: int, peak_mib: list[float]) -> str:
    decode_tokens = max(r.new_tokens - n_prompts, 0)
    peak = "/".join(f"{m:.0f}" for m in peak_mib)
    label = "peak RSS" if len(peak_mib) == 1 else "peak RSS per rank"
    return (f"load {load_s:.2f} s | prompt {r.prompt_tokens} tok at {r.prompt_tokens / r.prefill_seconds:.1f} tok/s"
            f" | generated {r.new_tokens} tok at {decode_tokens / max(r.decode_seconds, 1e-9):.1f} tok/s"
            f" | {label} {peak} MiB")


def _generate_torchrun(args: argparse.Namespace, prompts: list[str], seed: int, cfg, dist) -> int:
    """Every process is one rank; all run the same loop, rank 0 prints."""
    from moe.memory import peak_memory_mib
    from moe.worker import load_shard, spec_for

    plan = resolve_placement(args.placement, cfg.n_layers, cfg.n_experts, dist.world_size,
                             parse_blocks_per_rank(args.blocks_per_rank))
    say = print if dist.rank == 0 else (lambda *a, **k: None)
    say(plan.table())
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    spec = spec_for(args.ckpt, args.dtype, plan, progress=True, attention=args.attention, cpu_kernels=args.cpu_kernels)
    engine, _ = load_shard(spec, dist)
    load_s = time.perf_counter() - t0
    tokenizer = Tokenizer(Path(args.ckpt) / "tokenizer.model")
    ids = [tokenizer.encode(p) for p in prompts]
    check_prompts(ids, cfg.vocab_size, cfg.max_seq_len)
    if dist.rank == 0:
        print_settings(args, seed, str(engine.dtype).removeprefix("torch."), len(prompts))
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.top_k, seed)
    decoder = IncrementalDecoder(tokenizer, ids[0])
    say(prompts[0], end="", flush=True)
    on_token = (lambda b, t: say(decoder.push(t), end="", flush=True) if b == 0 else None)
    result = generate_tokens(engine, ids, params, tokenizer.eos_id, cfg.max_seq_len, on_token)
    say()
    for i, (p, t) in enumerate(zip(prompts[1:], result.tokens[1:], strict=True), 1):
        say(f"[{i}] {p}{tokenizer.decode_continuation(ids[i], t)}")
    peak = torch.tensor([peak_memory_mib(dist.device)], device=dist.device)
    gathered = [torch.zeros_like(peak) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, peak)
    say(summary(load_s, result, len(prompts), [float(g) for g in gathered]))
    torch.distributed.destroy_process_group()
    return 0
