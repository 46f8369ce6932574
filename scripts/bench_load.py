"""Per-rank memory when loading: builds a checkpoint of a named size, loads it on 1 and N ranks, prints a table.

    python scripts/bench_load.py --size small --gpus 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.api import MoEModel  # noqa: E402
from moe.bench_models import SIZES, write_sized_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sized_checkpoint(Path(tmp) / args.size, args.size)
        weights_mib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        print(f"checkpoint {args.size}: {weights_mib:.0f} MiB of fp32 weights")
        print(f"{'ranks':>5} {'rank':>4} {'baseline MiB':>12} {'peak MiB':>9} {'above base':>10} "
              f"{'read MiB':>9} {'weights/N':>9}")
        result = {}
        for gpus in (1, args.gpus):
            if gpus == 1:
                out = subprocess.run([sys.executable, __file__, "--single", str(path)], capture_output=True,
                                     text=True, check=True).stdout
                ranks = [json.loads(out)]
            else:
                with MoEModel.from_pretrained(path, gpus=gpus) as model:
                    ranks = model.engine.group.ready
            result[gpus] = ranks
            for r in ranks:
                print(f"{gpus:>5} {r['rank']:>4} {r['baseline_mib']:>12.0f} {r['loaded_peak_mib']:>9.0f} "
                      f"{r['loaded_peak_mib'] - r['baseline_mib']:>10.0f} {r['bytes_read'] / 2**20:>9.0f} "
                      f"{weights_mib / gpus:>9.0f}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


def single(path: str) -> None:
    """One rank in a fresh process, so its peak RSS is its own."""
    from moe.memory import peak_memory_mib

    baseline = peak_memory_mib()
    model = MoEModel.from_pretrained(path)
    print(json.dumps({"rank": 0, "baseline_mib": baseline, "loaded_peak_mib": peak_memory_mib(),
                      "bytes_read": model.info["bytes_read"]}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--single":
        single(sys.argv[2])
    else:
        main()
