"""`scripts/generate.py`: generate text on one rank, on N ranks started here, or as one rank under torchrun.

Every case goes through `MoEModel`; under torchrun each process is one rank, runs the same calls, and only
rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

from models.kernels.choice import CPU_KERNELS_HELP, KERNELS
from moe.api import MoEModel
from moe.checkpoint.formats import detect
from moe.cli.common import (
    add_model_args,
    add_sampling_args,
    parse_blocks_per_rank,
    read_prompts,
    refuse_gpus_under_torchrun,
    run_command,
    sampling_args,
    sampling_settings,
    say_from,
)
from moe.generation import GenerationResult, SamplingParams
from moe.memory import MemoryUse, describe
from moe.parallel.devices import ranks_device
from moe.parallel.distributed import under_torchrun
from moe.parallel.placement import resolve_placement
from moe.workers.group import cpu_threads_per_rank

EXAMPLES = """examples:
  python scripts/generate.py --ckpt weights/tiny-moe-austen-bbe --prompt "It is a truth universally acknowledged, that"
  python scripts/generate.py --ckpt DIR --gpus 4 --temperature 0.7 --top-p 0.9 --seed 1 --prompt "..."
  torchrun --nproc-per-node 2 scripts/generate.py --ckpt DIR --prompt "..."

where it runs: --gpus N starts N ranks on this machine, one GPU each with NCCL when there are N GPUs, or,
on a machine without GPUs (or with --device cpu), N CPU processes over gloo (cores shared out, --threads
per rank). Under torchrun every process is one rank of torchrun's group, on one machine or several; --gpus
then does not apply.
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="generate.py", epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Generate text with a mixture-of-experts model sharded over ranks.")
    add_model_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    ap.add_argument("--prompt-file", help="file with one prompt per non-empty line; - reads standard input")
    add_sampling_args(ap)
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    ap.add_argument("--blocks-per-rank", default=None,
                    help="comma-separated block counts per rank, e.g. 3,2,2,1 (default: balanced ranges)")
    ap.add_argument("--attention", choices=["layer", "replicated", "tensor"], default="layer",
                    help="every block's attention: layer: on one rank (layer placement, default); replicated: every "
                         "rank holds the dense weights and runs its slice of the batch (throughput on batches); "
                         "tensor: heads split over all ranks (one all-reduce per block)")
    ap.add_argument("--experts", choices=["expert", "tensor", "layer"], default="expert",
                    help="every block's experts: expert: whole experts placed over the ranks (default); tensor: each "
                         "expert's hidden dimension split over all ranks (one all-reduce per block); layer: all on "
                         "the block's owner, a pipeline of whole blocks (no collective inside a block). Per-block "
                         "strategies: a --placement file (docs/parallelism.md)")
    ap.add_argument("--exchange", choices=["auto", "all-to-all", "gather"], default="auto",
                    help="how token copies reach the experts' ranks: auto (default) gathers a decode step's few rows "
                         "to every rank (2 collectives per block) and uses all-to-all for prompts; or force one")
    ap.add_argument("--cpu-kernels", choices=KERNELS, default="auto", help=CPU_KERNELS_HELP)
    ap.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                    help="one CPU rank: build the decode step's compiled package for this model, batch and cache "
                         "length if it is missing (about half a minute on a 2-core CPU, once; scripts/warmup.py "
                         "builds it ahead) and use it; without this flag a package already built is used. On N ranks "
                         "(--attention replicated, or --experts layer) and GPUs: torch.compile in this process")
    ap.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                    help="eager decode steps, even where a compiled package is cached")
    ap.add_argument("--expert-load", default=None, metavar="DIR",
                    help="after generating, write an expert-load report (JSON, CSV, PNG) to DIR")
    ap.add_argument("--master-port", type=int, default=None,
                    help="port for the ranks to meet on 127.0.0.1 (default: a free one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    return run_command(generate, parser().parse_args(argv))


def generate(args: argparse.Namespace) -> int:
    refuse_gpus_under_torchrun(args)
    SamplingParams(**sampling_args(args), seed=args.seed or 0)  # checked before loading
    prompts = read_prompts(args)
    cfg = detect(args.ckpt).config
    torchrun = under_torchrun()
    ranks = int(os.environ["WORLD_SIZE"]) if torchrun else args.gpus
    say = say_from(int(os.environ.get("RANK", 0)))  # before the model exists: the entry point reads torchrun's rank
    kind = None if torchrun else ranks_device(args.device, ranks)  # checked before any table; torchrun: per machine
    plan = None
    if ranks > 1 or args.placement:
        plan = resolve_placement(args.placement, cfg, ranks, parse_blocks_per_rank(args.blocks_per_rank),
                                 args.attention, args.experts)
        say(plan.table())
        if args.attention == "replicated":
            say("attention replicated: every rank holds the embedding, all blocks' attention and the head, "
                "and runs its slice of the batch; experts as above")
        if not torchrun and kind == "cpu":
            threads = args.threads or cpu_threads_per_rank(ranks)
            say(f"running {ranks} ranks as CPU processes over gloo, {threads} thread(s) each")
    if args.threads and (torchrun or ranks == 1):
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, device=args.device, gpus=args.gpus, placement=plan,
                                     master_port=args.master_port, threads=args.threads, progress=not args.quiet,
                                     cpu_kernels=args.cpu_kernels, timeout_s=args.timeout,
                                     exchange=args.exchange, compile=args.compile)
    load_s = time.perf_counter() - t0
    with model:
        run_and_print(model, args, prompts, load_s, say_from(model.rank))
    return 0


def run_and_print(model: MoEModel, args: argparse.Namespace, prompts: list[str], load_s: float, say) -> None:
    cfg = model.config
    seed = args.seed if args.seed is not None else model.random_seed()  # drawn on one rank, shared
    say(f"model: {args.ckpt} ({model.info.format}), {cfg.n_layers} blocks, "
        f"{cfg.n_experts} experts top-{cfg.top_k}, dim {cfg.dim}; ranks: {model.info.ranks}")
    shown, note = sampling_settings(model, args)
    say(f"settings: {shown} seed={seed} dtype={model.info.dtype} prompts={len(prompts)}{note}")
    if args.expert_load:
        model.track_router_entropy()
    single = len(prompts) == 1
    if single:
        say(prompts[0], end="", flush=True)
    streamer = (lambda b, piece: say(piece, end="", flush=True)) if single else None
    outputs = model.generate(prompts, seed=seed, streamer=streamer, **sampling_args(args))
    say()
    if not single:
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
            say(f"[{i}] {p}{o}")
    say(summary(load_s, model.last_result, outputs, model.memory()))
    if args.expert_load:
        report = model.expert_load()  # every rank takes part in gathering the counters
        if model.rank == 0:
            from moe.cli.expert_load import report_out

            report_out(report, args.expert_load)


def summary(load_s: float, r: GenerationResult, outputs: list, memory: list[MemoryUse]) -> str:
    decode_tokens = max(r.new_tokens - len(outputs), 0)
    ends = Counter(o.finish_reason if o.stop_reason is None else f"{o.finish_reason} ({o.stop_reason!r})"
                   for o in outputs)
    return (f"load {load_s:.2f} s | prompt {r.prompt_tokens} tok at {r.prompt_tokens / r.prefill_seconds:.1f} tok/s"
            f" | generated {r.new_tokens} tok at {decode_tokens / max(r.decode_seconds, 1e-9):.1f} tok/s"
            f" | finished: {', '.join(f'{n} {why}' for why, n in ends.items())} | {describe(memory)}")


if __name__ == "__main__":
    sys.exit(main())
