"""Load time and per-rank peak memory: one checkpoint in three layouts, loaded on 1 and N ranks.

    python scripts/bench_load.py --size small --gpus 4 --json load.json

Layouts: one monolithic safetensors file; files of at most --max-shard-size; rank-aligned files of at most
--max-shard-size (scripts/shard.py --gpus N). Every load runs in fresh processes, so each peak RSS (VmHWM) is
that rank's own; "above base" subtracts the process's RSS before it read any weight. Prints the median load
time over --repeats runs, and the target the sharding issue sets: weights/N + 15%.

    python scripts/bench_load.py --size gpt-oss --mxfp4
    python scripts/bench_load.py --size deepseek --fp8

`--mxfp4`: the size's checkpoint with its experts as gpt-oss ships them (MXFP4 blocks and scales); `--fp8`: with its
linear weights as DeepSeek-V3 ships them (FP8, 128 x 128 block scales). Loaded at bf16 and int8 on 1 rank: peak
memory above base against the size of the loaded weights (decoding one tensor at a time should keep them close).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe.api import MoEModel
from moe.bench.sizes import SIZES, pack_experts_mxfp4, pack_linear_fp8, write_sized_checkpoint
from moe.checkpoint.convert import parse_size
from moe.checkpoint.reshard import reshard
from moe.parallel.placement import Placement


def load_once(path: Path, gpus: int) -> list[dict]:
    """Per-rank figures of one load. One rank runs in a subprocess so its memory is its own."""
    if gpus == 1:
        out = subprocess.run([sys.executable, "-m", "moe.cli.bench_load", "--single", str(path)],
                             capture_output=True, text=True, check=True).stdout
        return [json.loads(out)]
    t0 = time.perf_counter()
    with MoEModel.from_pretrained(path, gpus=gpus) as model:
        wall = time.perf_counter() - t0
        i = model.info
        return [{"rank": r, "baseline_mib": i.baseline_mib[r], "loaded_peak_mib": i.loaded_peak_mib[r],
                 "bytes_read": i.bytes_read[r], "files_read": i.files_read[r], "load_seconds": i.load_seconds[r],
                 "wall_seconds": wall} for r in range(i.ranks)]


def load_shipped(size: str, repeats: int, fmt: str) -> dict:
    """`--mxfp4`, `--fp8`: load the size's checkpoint in that format at bf16 and int8, each in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sized_checkpoint(Path(tmp) / fmt, size)
        path = pack_experts_mxfp4(path) if fmt == "mxfp4" else pack_linear_fp8(path)
        file_mib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        print(f"checkpoint {size} as {fmt}: {file_mib:.0f} MiB on disk; median of {repeats} loads")
        print(f"{'dtype':>9} {'load s':>6} {'base MiB':>8} {'peak MiB':>8} {'above':>6} {'bf16 weights MiB':>16}")
        result = {"file_mib": file_mib, "cases": {}}
        for dtype in ("bfloat16", "int8"):
            runs = [json.loads(subprocess.run([sys.executable, "-m", "moe.cli.bench_load", "--single", str(path),
                                               dtype], capture_output=True, text=True, check=True).stdout)
                    for _ in range(repeats)]
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("load_seconds", "baseline_mib", "loaded_peak_mib", "bf16_weights_mib")}
            print(f"{dtype:>9} {med['load_seconds']:>6.2f} {med['baseline_mib']:>8.0f} {med['loaded_peak_mib']:>8.0f} "
                  f"{med['loaded_peak_mib'] - med['baseline_mib']:>6.0f} {med['bf16_weights_mib']:>16.0f}")
            result["cases"][dtype] = runs
        return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--mxfp4", action="store_true", help="the size's experts as MXFP4 blocks, loaded at bf16 and int8")
    ap.add_argument("--fp8", action="store_true", help="the size's linear weights as block-scaled FP8, likewise")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--repeats", type=int, default=3, help="loads per case; the median is shown")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args(argv)
    if args.mxfp4 or args.fp8:
        result = load_shipped(args.size, args.repeats, "mxfp4" if args.mxfp4 else "fp8")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    shard_bytes = parse_size(args.max_shard_size)
    with tempfile.TemporaryDirectory() as tmp:
        mono = write_sized_checkpoint(Path(tmp) / "monolithic", args.size)
        cfg = SIZES[args.size]
        layouts = {"monolithic": mono, f"{args.max_shard_size} shards": Path(tmp) / "sharded",
                   "rank-aligned": Path(tmp) / "aligned"}
        reshard(mono, layouts[f"{args.max_shard_size} shards"], shard_bytes)
        reshard(mono, layouts["rank-aligned"], shard_bytes, Placement.default(cfg.n_layers, cfg.n_experts, args.gpus))
        weights_mib = sum(f.stat().st_size for f in mono.glob("*.safetensors")) / 2**20
        print(f"checkpoint {args.size}: {weights_mib:.0f} MiB of fp32 weights; median of {args.repeats} loads")
        print(f"{'layout':>14} {'ranks':>5} {'rank':>4} {'files':>5} {'read MiB':>8} {'load s':>6} {'wall s':>6} "
              f"{'base MiB':>8} {'peak MiB':>8} {'above':>6} {'target':>6}")
        result = {"weights_mib": weights_mib, "cases": {}}
        for layout, path in layouts.items():
            n_files = len(list(path.glob("*.safetensors")))
            for gpus in (1, args.gpus):
                runs = [load_once(path, gpus) for _ in range(args.repeats)]
                result["cases"][f"{layout}/{gpus}"] = runs
                target = weights_mib / gpus * 1.15
                for rank in range(gpus):
                    rows = [run[rank] for run in runs]
                    med = {k: statistics.median(r[k] for r in rows)
                           for k in ("load_seconds", "wall_seconds", "baseline_mib", "loaded_peak_mib")}
                    above = med["loaded_peak_mib"] - med["baseline_mib"]
                    print(f"{layout:>14} {gpus:>5} {rank:>4} {len(rows[0]['files_read']):>2}/{n_files:<2} "
                          f"{rows[0]['bytes_read'] / 2**20:>8.0f} {med['load_seconds']:>6.2f} "
                          f"{med['wall_seconds']:>6.2f} {med['baseline_mib']:>8.0f} {med['loaded_peak_mib']:>8.0f} "
                          f"{above:>6.0f} {target:>6.0f}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


def single(path: str, dtype: str | None = None) -> None:
    """One rank in a fresh process, so its peak RSS is its own."""
    from moe.memory import peak_memory_mib

    baseline = peak_memory_mib()
    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(path, dtype=dtype, compile=False)
    wall = time.perf_counter() - t0
    peak = peak_memory_mib()
    params = sum(p.numel() for p in model.engine.model.parameters())  # converted ones keep their shapes (on meta)
    print(json.dumps({"rank": 0, "baseline_mib": baseline, "loaded_peak_mib": peak,
                      "bytes_read": model.info.bytes_read[0], "files_read": model.info.files_read[0],
                      "load_seconds": model.info.load_seconds[0], "wall_seconds": wall,
                      "bf16_weights_mib": params * 2 / 2**20}))


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--single":  # one rank, in a process of its own (started by `load_once`)
        single(*argv[1:])
    else:
        main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(run())
