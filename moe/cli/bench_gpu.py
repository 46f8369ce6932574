"""`scripts/bench_gpu.py`: on the GPUs found, decode speed, host syncs per decode step, and memory (GPU, and
host memory while loading), each case in a fresh process on a random checkpoint of a named size."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from moe.bench.sizes import SIZES, write_sized_checkpoint
from moe.bench.speed import prompts
from moe.bench.syncs import HostSyncCounter
from moe.cli.common import run_command
from moe.generation import SamplingParams, generate_tokens

NEW_TOKENS, PROMPT_LEN = 128, 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_gpu.py", description=__doc__)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"), help="where sized checkpoints are kept")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8", help="comma-separated (default float32,bfloat16,int8)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is shown")
    ap.add_argument("--case", nargs=3, metavar=("CKPT", "DTYPE", "GPUS"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def syncs_per_step(engine, counter_factory) -> float:
    """Syncs of 12 decode steps minus those of 4, per step: the decode step alone."""
    totals = []
    for n in (4, 12):
        with counter_factory() as count:
            generate_tokens(engine, prompts(2, PROMPT_LEN, 1000), SamplingParams(n, 0.0, 1.0, 0, 0), (), 10**6)
        totals.append(count())
    return (totals[1] - totals[0]) / 8


class _CudaSyncs:
    """CUDA's own detector: every synchronizing call warns while sync debug mode is on."""

    def __enter__(self):
        torch.cuda.synchronize()
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return lambda: sum("synchroniz" in str(w.message) for w in self.caught)

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)


class _CountedCalls(HostSyncCounter):
    def __enter__(self):
        super().__enter__()
        return lambda: self.total


def case(path: str, dtype: str, gpus: int, repeats: int) -> dict:
    from moe import MoEModel
    from moe.memory import host_peak_mib

    host_before = host_peak_mib()
    t0 = time.perf_counter()
    model = MoEModel.from_pretrained(path, dtype=dtype, device="cuda", gpus=gpus)
    load_s = time.perf_counter() - t0
    V = model.config.vocab_size
    with model:
        model.generate(prompts(1, 16, V), max_new_tokens=4, ignore_eos=True)  # warm-up
        steps = {1: [], 8: []}
        for r in range(repeats):
            for batch in steps:
                model.generate(prompts(batch, PROMPT_LEN, V, r), max_new_tokens=NEW_TOKENS, ignore_eos=True)
                steps[batch].append(model.last_result.decode_seconds / (NEW_TOKENS - 1))
        out = {"load_s": load_s, "decode1_tok_s": 1 / statistics.median(steps[1]),
               "decode8_tok_s": 8 / statistics.median(steps[8]), "memory": [vars(m) for m in model.memory()],
               "host_peak_during_load_mib": host_peak_mib() - host_before if gpus == 1 else None}
        if gpus == 1:  # syncs are counted in this process: the one-rank engine runs here
            out["syncs_calls"] = syncs_per_step(model.engine, _CountedCalls)
            out["syncs_cuda"] = syncs_per_step(model.engine, _CudaSyncs)
            out["blocks"] = model.config.n_layers
    return out


def bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device is visible: bench_gpu.py measures GPUs (scripts/bench.py measures CPUs)")
    gpus = torch.cuda.device_count()
    path = args.workdir / args.size
    if not (path / "config.json").exists():
        write_sized_checkpoint(path, args.size)
    size_mib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
    print(f"{torch.cuda.get_device_name(0)} x {gpus}; {args.size} checkpoint {size_mib:.0f} MiB (fp32 on disk)")
    print(f"{'case':>20} {'load s':>7} {'b1 tok/s':>9} {'b8 tok/s':>9} {'syncs/step':>11} {'(CUDA)':>7} "
          f"{'GPU peak MiB':>13} {'host +MiB load':>15}")
    for dtype in args.dtypes.split(","):
        for n in sorted({1, gpus}):
            cmd = [sys.executable, "-m", "moe.cli.bench_gpu", "--case", str(path), dtype, str(n),
                   "--repeats", str(args.repeats)]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            syncs = f"{r['syncs_calls']:.1f}/{r['blocks']}" if "syncs_calls" in r else "-"
            gpu_peak = "/".join(f"{m['gpu_peak']:.0f}" for m in r["memory"])
            print(f"{dtype + ' x' + str(n):>20} {r['load_s']:>7.2f} {r['decode1_tok_s']:>9.1f} "
                  f"{r['decode8_tok_s']:>9.1f} {syncs:>11} {r.get('syncs_cuda', float('nan')):>7.1f} "
                  f"{gpu_peak:>13} {r['host_peak_during_load_mib'] or float('nan'):>15.0f}")
    print("syncs/step: calls that wait for the GPU per decode step (moe.bench.syncs) over the MoE blocks; "
          "(CUDA): the same step as torch.cuda.set_sync_debug_mode counts it")
    return 0


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        path, dtype, gpus = args.case
        print(json.dumps(case(path, dtype, int(gpus), args.repeats)))
        return 0
    return run_command(bench, args)


if __name__ == "__main__":
    sys.exit(run())
