"""What the latent cache buys at long contexts: decode time and cache size of multi-head latent attention in its
absorbed form (the default: attention over the cached latents themselves) against its expanded form (every cached
token's per-head keys and values made again at each step, what a per-head cache would hold).

    python scripts/bench_latent.py --size deepseek --contexts 512 2048 8192

Each context: one prompt of that many tokens, then `--new` tokens greedily, on 1 rank; the decode time per token
is the time from the first new token to the last over the tokens between, the median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe.api import MoEModel
from moe.bench.sizes import SIZES, write_sized_checkpoint
from moe.host import cpu_name


def decode_ms(model: MoEModel, prompt: list[int], new: int, repeats: int) -> float:
    """Median over `repeats` runs of the time between the first and the last of `new` tokens, per token."""
    def once() -> float:
        stamps: list[float] = []
        model.generate([prompt], max_new_tokens=new, ignore_eos=True,
                       streamer=lambda _, piece: stamps.append(time.perf_counter()))
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    return statistics.median(once() for _ in range(repeats)) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=[k for k, c in SIZES.items() if c.latent], default="deepseek")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--new", type=int, default=8, help="tokens generated after each prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    cfg = SIZES[args.size]
    element = torch.finfo(torch.float32 if args.dtype in ("float32", "fp32") else torch.bfloat16).bits // 8
    latent = (cfg.kv_lora_rank + cfg.head_dim) * element * cfg.n_layers
    per_head = cfg.n_heads * (cfg.qk_nope_dim + cfg.head_dim + cfg.v_head_dim) * element * cfg.n_layers
    print(f"{cfg_name(args.size)}; {args.dtype}; 1 rank; {torch.get_num_threads()} threads; {cpu_name()}")
    print(f"cache per token: latent {latent} B (kv_lora_rank {cfg.kv_lora_rank} + rotary {cfg.head_dim}, x "
          f"{cfg.n_layers} blocks) against {per_head} B of per-head keys and values: {per_head / latent:.1f}x less")
    print(f"{'context':>7} {'latent MiB':>10} {'per-head MiB':>12} {'absorbed ms':>11} {'expanded ms':>11} "
          f"{'speedup':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sized_checkpoint(Path(tmp) / args.size, args.size, max_seq_len=max(args.contexts) + args.new)
        model = MoEModel.from_pretrained(path, dtype=args.dtype, compile=False)
        attentions = [block.attention for block in model.engine.model.layers.values()]
        for context in args.contexts:
            prompt = torch.randint(3, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
            times = {}
            for form in ("absorbed", "expanded"):
                for a in attentions:
                    a.form = "auto" if form == "absorbed" else form
                times[form] = decode_ms(model, prompt, args.new, args.repeats)
            absorbed, expanded = times["absorbed"], times["expanded"]
            print(f"{context:>7} {latent * context / 2**20:>10.1f} {per_head * context / 2**20:>12.1f} "
                  f"{absorbed:>11.1f} {expanded:>11.1f} {expanded / absorbed:>6.1f}x")


def cfg_name(size: str) -> str:
    cfg = SIZES[size]
    return (f"{size}: dim {cfg.dim}, {cfg.n_layers} blocks, {cfg.n_heads} heads, latent {cfg.kv_lora_rank}, "
            f"{cfg.n_experts} experts top-{cfg.top_k}")


def run(argv: list[str] | None = None) -> int:
    main(argv)
    return 0
