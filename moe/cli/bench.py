"""Speed against Hugging Face transformers and against the machine's memory bandwidth.

    python scripts/bench.py --size small --threads 2 --gpus 4 --json bench.json
    python scripts/bench.py --size medium --dtype bfloat16
    LLAMA_CPP_DIR=~/llama.cpp python scripts/bench.py --size small --dtype int8 --gpus 2 --against llama.cpp

Builds a random checkpoint of the named size (kept in --workdir), then measures, each case in a fresh
process on the same weights and thread count: this project on 1 rank (its default kernels, the same with
decode steps compiled, oneDNN-packed weights, torch's plain products) and on --gpus ranks (the automatic
exchange, and all-to-all forced), and the peers named by --against: transformers' MixtralForCausalLM (when
installed) and llama.cpp (`llama-bench` on the same weights converted to GGUF at the matching precision;
moe.bench.llama_cpp; run before and after our cases, its figures the medians over both sessions; then batch-1
decode in turns with our 1-rank models, moe.bench.peer_turns). Figures are medians over --repeats runs. On N
ranks it also counts, inside the rank processes, the collectives and host syncs of a decode step.

Bounds: decode against memory bandwidth (weight bytes a step must read / step time), over the copy
bandwidth counted as bytes copied per second (the issue's definition) and over the read bandwidth (the
physical limit of a step that only reads weights); prefill against the matrix-product peak of torch's `a @ b`
(the issue's definition; MKL on CPU) and of oneDNN (what bf16 prompts run on a CPU with bf16 instructions;
the others run the project's native gemm).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from moe.bench.in_turns import memory_short
from moe.bench.llama_cpp import GGUF_NAMES, LlamaCpp, combine, print_peers
from moe.bench.peer_turns import OURS, decode_in_turns, print_decode_in_turns
from moe.bench.sizes import SIZES, write_sized_checkpoint
from moe.bench.speed import (
    NEW_TOKENS,
    PREFILL,
    checkpoint_config,
    decode_bytes_per_token,
    matmul_peak,
    memory_bandwidth,
    prefill_flops_per_token,
    read_bandwidth,
    warm_page_cache,
)
from moe.checkpoint.loader import activation_dtype
from moe.cli.common import run_command
from moe.host import cpu_name

# A sized random checkpoint has no tokenizer; llama.cpp's converter needs one (its vocabulary is padded to the model's).
BENCH_TOKENIZER = Path(__file__).resolve().parents[2] / "weights" / "tiny-moe-austen-bbe" / "tokenizer.model"
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}  # bytes per linear weight
IN_TURNS_ROUNDS = 8  # N ranks: rounds of batch-1 decode steps with every layout loaded at once (moe.bench.in_turns)


def run_case(args: argparse.Namespace, impl: str, gpus: int, path: Path, strategy: str | None = None) -> dict | None:
    cmd = [sys.executable, "-m", "moe.cli.bench", "--case", impl, "--ckpt", str(path), "--gpus", str(gpus),
           "--dtype", args.dtype, "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if strategy is not None:
        cmd += ["--strategy", strategy]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  {impl} on {gpus} rank(s) failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def case_main(args: argparse.Namespace) -> None:
    from moe.bench.speed import ours, products_alone, transformers_case

    if args.case == "ours-products":
        result = products_alone(args.ckpt, args.dtype, args.threads, args.repeats)
    elif args.case.startswith("ours"):
        attention = "replicated" if args.case == "ours-replicated" else "layer"
        kernels = {"ours-torch-kernels": "torch", "ours-onednn": "onednn"}.get(args.case, "auto")
        exchange = "all-to-all" if args.case == "ours-all-to-all" else "auto"
        result = ours(args.ckpt, args.gpus, args.dtype, args.threads, args.repeats, attention, kernels, exchange,
                      compile=args.case == "ours-compiled", strategy=args.strategy)
    else:
        result = transformers_case(args.ckpt, args.dtype, args.threads, args.repeats)
    print(json.dumps(result))


def machine_bounds(args: argparse.Namespace, path: Path) -> dict:
    """The machine's limits and what they allow this model: decode steps/s by bandwidth, prefill by peak."""
    cfg = checkpoint_config(path)
    bandwidth, read = memory_bandwidth(args.threads), read_bandwidth(args.threads)
    peaks = matmul_peak(args.threads, activation_dtype(args.dtype))
    step_bytes = decode_bytes_per_token(cfg, ELEMENT_SIZE[args.dtype])
    flops = prefill_flops_per_token(cfg, PREFILL)
    b = {"cfg": cfg, "bandwidth": bandwidth, "read": read, "peaks": peaks, "step_bytes": step_bytes,
         "decode": bandwidth * 1e9 / step_bytes, "decode_read": read * 1e9 / step_bytes,
         "prefill": peaks["torch"] * 1e9 / flops, "prefill_onednn": peaks.get("onednn", peaks["torch"]) * 1e9 / flops}
    print(f"machine: {cpu_name()}, {args.threads} thread(s); copy bandwidth {bandwidth:.1f} GB/s (bytes copied/s), "
          f"read {read:.1f} GB/s; {args.dtype} matmul {peaks['torch']:.0f} GFLOP/s with torch (a @ b), "
          f"{peaks.get('onednn', float('nan')):.0f} with oneDNN")
    print(f"model: {path.name}, dim {cfg.dim}, {cfg.n_layers} blocks, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"{args.dtype}; a decode step reads {step_bytes / 1e6:.0f} MB -> bound {b['decode']:.1f} tokens/s at "
          f"batch 1 (copy bandwidth), {b['decode_read']:.1f} (read); prefill bound {b['prefill']:.0f} tokens/s "
          f"(torch peak), {b['prefill_onednn']:.0f} (oneDNN peak)")
    return b


def print_table(rows: dict, b: dict) -> None:
    """One row per case; a peer that does not measure a figure (llama-bench: load, TTFT, batch 8) shows "-"."""
    print(f"{'':>24} {'load':>6} {'prefill':>8} {'% torch':>7} {'% oneDNN':>8} {'TTFT':>6} {'decode b1':>9} "
          f"{'% copy':>6} {'% read':>6} {'decode b8':>9} {'peak RSS':>14}")
    print(f"{'case':>24} {'s':>6} {'tok/s':>8} {'peak':>7} {'peak':>8} {'ms':>6} {'tok/s':>9} "
          f"{'bound':>6} {'bound':>6} {'tok/s':>9} {'MiB':>14}")

    def cell(value, width: int, fmt: str) -> str:
        return f"{value:>{width}{fmt}}" if value is not None else f"{'-':>{width}}"

    for name, r in rows.items():
        b1, pre = 1 / r["decode1_step_s"], PREFILL / r["prefill_s"]
        b8 = 8 / r["decode8_step_s"] if r.get("decode8_step_s") else None
        load, ttft = r.get("load_s"), r.get("ttft_s")
        rss = "/".join(f"{m:.0f}" for m in r["peak_rss_mib"]) if r.get("peak_rss_mib") else None
        print(f"{name:>24} {cell(load, 6, '.2f')} {pre:>8.0f} {100 * pre / b['prefill']:>6.0f}% "
              f"{100 * pre / b['prefill_onednn']:>7.0f}% {cell(ttft and ttft * 1e3, 6, '.0f')} {b1:>9.1f} "
              f"{100 * b1 / b['decode']:>5.0f}% {100 * b1 / b['decode_read']:>5.0f}% {cell(b8, 9, '.1f')} "
              f"{cell(rss, 14, '')}")
    for name in ("ours x1", "ours-compiled x1"):
        if name in rows:
            b1 = 1 / rows[name]["decode1_step_s"]
            print(f"headline: {name}: 1-rank decode at batch 1 runs at {b1:.1f} tok/s = "
                  f"{100 * b1 / b['decode_read']:.0f}% of the read-bandwidth bound ({b['decode_read']:.0f} tok/s)")


def print_products(products: dict, b: dict) -> None:
    """The step's products alone, one after the other in their own process; what whole steps spend besides them is
    set in the rounds in turns (`moe.bench.peer_turns`), where both fall in one spell of the machine's bandwidth."""
    for key, how in (("products_step_s", "called from Python"), ("products_compiled_step_s", "compiled")):
        if key in products:
            alone = products[key]
            print(f"products alone (1 rank, batch 1, {how}): {alone * 1e3:.2f} ms per step = {1 / alone:.1f} tok/s "
                  f"with nothing else in the step, reading {b['step_bytes'] / alone / 1e9:.1f} GB/s")
    if "eager_ops_per_block" in products:
        print(f"an eager decode step runs {products['eager_ops_per_block']:.0f} torch ops a block besides its "
              f"{products['eager_products_per_block']:.0f} that read weights (each 1-3 us through torch's dispatcher)")


def print_exchange_counts(path: Path, args: argparse.Namespace) -> None:
    """Collectives and host syncs per block and decode step, counted inside the rank processes."""
    from moe.bench.collectives import count_decode_step

    cases = [(f"exchange {exchange}", {"exchange": exchange}) for exchange in ("auto", "all-to-all")]
    cases.append(("replicated attention, one sequence", {"strategy": "replicated/expert", "sequences": 1}))
    cases.append(("a pipeline of whole blocks (experts layer)", {"strategy": "layer/layer"}))
    for label, how in cases:
        ranks = count_decode_step(str(path), args.gpus, dtype=args.dtype, **how)
        blocks = ranks[0]["blocks"]
        worst = max(ranks, key=lambda r: r["collectives"])
        kinds = ", ".join(f"{k} {v / blocks:g}" for k, v in sorted(worst["calls"].items()) if v)
        print(f"{args.gpus} ranks, {label}: per block and decode step {worst['collectives'] / blocks:.2f} "
              f"collectives ({kinds}; the step's one token broadcast included), host syncs "
              f"{max(r['syncs'] for r in ranks) / blocks:.2f} (worst rank)")


def print_n_ranks(path: Path, args: argparse.Namespace, cfg) -> dict:
    """N ranks: their collectives per block, their batch-1 steps measured in turns with the 1-rank step, where a
    compiled one goes, and what one collective costs here. Returns the figures for the JSON."""
    from moe.bench.collectives import strategy_plan
    from moe.bench.in_turns import ONE_CORE, decode_steps_in_turns, print_steps_in_turns
    from moe.bench.step_parts import compiled_step_parts, print_compiled_step_parts, print_pipeline_step_parts
    from moe.engine.pipeline import pipeline_refusal

    print_exchange_counts(path, args)
    in_turns = None
    if (short := memory_short(str(path))) is not None:
        print(f"{args.gpus} ranks, batch-1 decode steps in turns: not measured ({short})")
    else:
        in_turns, differ = decode_steps_in_turns(str(path), args.dtype, args.gpus, args.threads, IN_TURNS_ROUNDS)
        print_steps_in_turns(in_turns, differ, args.gpus, IN_TURNS_ROUNDS)
    parts = compiled_step_parts(str(path), args.dtype, args.gpus)
    print_compiled_step_parts(parts, cfg.n_layers, (in_turns or {}).get("1 rank, compiled"))
    pipeline = None
    if pipeline_refusal(strategy_plan(cfg, args.gpus, "layer/layer")) is None:  # a block on every rank
        pipeline = compiled_step_parts(str(path), args.dtype, args.gpus, "layer/layer")
        print_pipeline_step_parts(pipeline, (in_turns or {}).get(ONE_CORE))
    print_collective_cost(args.gpus, cfg.dim)
    return {"decode_steps_in_turns": in_turns, "compiled_step_parts": parts, "pipeline_step_parts": pipeline}


def print_collective_cost(gpus: int, dim: int) -> None:
    """What bounds N ranks on this machine: one step's collective, idle and between equal products."""
    from moe.bench.collectives import collective_cost

    cost = collective_cost(gpus, dim)

    def spread(case: str) -> str:
        c = cost[case]
        return f"median {c['median'] * 1e3:.2f} / mean {c['mean'] * 1e3:.2f} / p90 {c['p90'] * 1e3:.2f} ms"

    print(f"{gpus} ranks, one all-gather of a [1, {dim}] fp32 row (a lone sequence's block sum), a thread per rank, "
          f"idle / after an equal 16 MB product on every rank: waited for by sleeping {spread('idle')} / "
          f"{spread('working')}; by polling (rank processes with cores of their own) {spread('idle polled')} / "
          f"{spread('working polled')}")


def print_comparisons(rows: dict, gpus: int, cfg) -> None:
    one, many = rows.get("ours x1"), rows.get(f"ours x{gpus}")
    if one and many and gpus > 1:
        rows_per_token = many["rows_per_block_per_token"]
        print(f"{gpus} ranks: decode step {many['decode1_step_s'] * 1e3:.1f} ms = "
              f"{many['decode1_step_s'] / one['decode1_step_s']:.2f} x the 1-rank step; rows exchanged per block "
              f"and token: {', '.join(f'{x:.2f}' for x in rows_per_token)} (k = {cfg.top_k}), i.e. "
              f"{cfg.top_k} x {cfg.dim} values each way")
    replicated = rows.get(f"ours-replicated x{gpus}")
    if one and replicated and gpus > 1:
        print(f"{gpus} ranks, replicated attention: decode step {replicated['decode1_step_s'] * 1e3:.1f} ms = "
              f"{replicated['decode1_step_s'] / one['decode1_step_s']:.2f} x the 1-rank step (a lone sequence runs "
              "on every rank: one collective per block)")
    if many and replicated and gpus > 1:
        print(f"{gpus} ranks, batches: plain (layer placement) {8 / many['decode8_step_s']:.1f} / "
              f"{32 / many['decode32_step_s']:.1f} tok/s at batch 8 / 32; replicated attention "
              f"{8 / replicated['decode8_step_s']:.1f} / {32 / replicated['decode32_step_s']:.1f} tok/s; greedy "
              f"tokens {'identical' if many['tokens8_hash'] == replicated['tokens8_hash'] else 'DIFFERENT'}")
    for other, label in (("ours-onednn x1", "oneDNN-packed"), ("ours-torch-kernels x1", "torch")):
        if other in rows and one:
            print(f"default (streaming) kernels vs {label} kernels (1 rank): decode b1 "
                  f"{rows[other]['decode1_step_s'] / one['decode1_step_s']:.2f}x, prefill "
                  f"{rows[other]['prefill_s'] / one['prefill_s']:.2f}x")
    if "transformers x1" in rows and one:
        hf = rows["transformers x1"]
        print(f"vs transformers: decode b1 {hf['decode1_step_s'] / one['decode1_step_s']:.2f}x, decode b8 "
              f"{hf['decode8_step_s'] / one['decode8_step_s']:.2f}x, prefill {hf['prefill_s'] / one['prefill_s']:.2f}x")


def llama_cpp_after_ours(args: argparse.Namespace, path: Path, llama: LlamaCpp, gguf: Path, before: dict,
                         rows: dict) -> dict | None:
    """llama.cpp's session after our cases (its table row is the medians of both sessions, before and after), then
    batch-1 decode in turns with it (moe.bench.peer_turns). Returns the in-turns figures (None: memory too short)."""
    after = llama.run(gguf, args.threads, args.repeats, PREFILL, NEW_TOKENS)
    rows[f"llama.cpp {GGUF_NAMES[args.dtype]}"] = combine([before, after])
    if (short := memory_short(str(path), len(OURS) + 1)) is not None:  # and the products alone
        print(f"decode b1 in turns with llama.cpp: not measured ({short})")
        return None
    return decode_in_turns(str(path), args.dtype, args.threads, lambda n: llama.decode_step(gguf, args.threads, n),
                           products=True)


def main(args: argparse.Namespace) -> int:
    path = args.ckpt
    if path is None:
        path = args.workdir / args.size
        if not (path / "config.json").exists():
            print(f"writing a random {args.size} checkpoint to {path} ...")
            write_sized_checkpoint(path, args.size)
        if not (path / "tokenizer.model").exists() and BENCH_TOKENIZER.exists():
            shutil.copy(BENCH_TOKENIZER, path / "tokenizer.model")  # llama.cpp's converter wants one
    if args.strategies:
        from moe.cli.bench_strategies import compare_strategies

        return compare_strategies(args, path, run_case)
    bounds = machine_bounds(args, path)
    impls = [("ours", 1), ("ours-compiled", 1), ("ours-onednn", 1)]
    impls += [("ours-torch-kernels", 1)] if args.dtype != "int8" else []
    if args.gpus > 1:
        impls += [("ours", args.gpus), ("ours-all-to-all", args.gpus), ("ours-replicated", args.gpus)]
    against = {a.strip() for a in args.against.split(",") if a.strip()}
    if "transformers" in against and args.dtype != "int8":
        try:
            import transformers  # noqa: F401
            impls.append(("transformers", 1))
        except ImportError:
            print("transformers is not installed: not measured (pip install -e '.[bench]')")
    llama = LlamaCpp.find(args.llama_cpp) if "llama.cpp" in against else None
    gguf = llama.to_gguf(path, args.dtype, args.workdir / "gguf") if llama is not None else None
    warm_page_cache(path)
    before = llama.run(gguf, args.threads, args.repeats, PREFILL, NEW_TOKENS) if llama is not None else None
    rows = {}
    for impl, gpus in impls:
        r = run_case(args, impl, gpus, path)
        if r is not None:
            rows[f"{impl} x{gpus}"] = r
    peer_turns = llama_cpp_after_ours(args, path, llama, gguf, before, rows) if llama is not None else None
    print_table(rows, bounds)
    print_peers(rows)
    if peer_turns is not None:
        print_decode_in_turns(peer_turns, f"llama.cpp {GGUF_NAMES[args.dtype]}")
    products = run_case(args, "ours-products", 1, path)
    if products is not None:
        print_products(products, bounds)
    print_comparisons(rows, args.gpus, bounds["cfg"])
    n_ranks = print_n_ranks(path, args, bounds["cfg"]) if args.gpus > 1 else {}
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "dtype": args.dtype, "threads": args.threads,
                                         "cpu": cpu_name(), "bandwidth_gbs": bounds["bandwidth"],
                                         "read_gbs": bounds["read"], "matmul_gflops": bounds["peaks"],
                                         "decode_bytes": bounds["step_bytes"], "new_tokens": NEW_TOKENS,
                                         "prefill_tokens": PREFILL, "cases": rows,
                                         "decode_in_turns_with_peer": peer_turns, **n_ranks}, indent=1) + "\n")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--ckpt", type=Path, default=None, help="use this checkpoint instead of a sized random one")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"), help="where sized checkpoints are kept")
    ap.add_argument("--dtype", choices=sorted(ELEMENT_SIZE), default="float32")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (per rank for N ranks: --threads/N)")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--against", default="transformers",
                    help="peers, comma-separated: transformers (when installed), llama.cpp (needs --llama-cpp DIR or "
                         "LLAMA_CPP_DIR: a llama.cpp tree with a built llama-bench)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR", help="llama.cpp source tree (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--strategies", default=None, metavar="LIST",
                    help="compare sharding strategies on --gpus ranks instead: comma-separated attention/experts "
                         "for every block, e.g. layer/expert,tensor/tensor,layer/tensor:2 (:2 = expert groups of 2 "
                         "ranks); 'all' for each of them")
    ap.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=["ours", "ours-compiled", "ours-onednn", "ours-torch-kernels", "ours-all-to-all",
                                       "ours-replicated", "ours-products", "transformers"],
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    parsed = parse_args(argv)
    if parsed.case:  # one case, in a process of its own (started by `run_case`)
        case_main(parsed)
        return 0
    return run_command(main, parsed)


if __name__ == "__main__":
    sys.exit(run())
