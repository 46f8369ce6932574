"""`scripts/bench_serve.py`: our server under load, beside llama-server on the same weights and threads.

    python scripts/bench_serve.py --size small --threads 2 --concurrency 1,2,4,8,16
    LLAMA_CPP_DIR=~/llama.cpp python scripts/bench_serve.py --size small --against llama-server --gpus 1,2
    python scripts/bench_serve.py --size small --rate 3.2 --soak-seconds 600 --max-num-seqs 16 --concurrency 1

Each level is run on every server in turn (ours on each --gpus, then llama-server), the servers started once and
idle while another is measured. Prompts are the same token ids for every server; every request streams
`max_tokens` tokens with `ignore_eos`. llama-server runs with `-np` = the largest concurrency, `-t`/`-tb` = the
threads, prompt caching off. Also measured: `model.generate` alone, one request at a time, eager and (--compile)
compiled, the figures the servers' c=1 is set against (the 1-request goal); c=1 runs `--turns` rounds, the servers
and `model.generate` in turns, and the ratio is given for each round, with the CPU a token each process spent, by
thread (the server's HTTP thread is `http`), and the load generator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe.bench.serving import closed_loop, open_loop, process_tree_cpu_s, summary, table
from moe.cli.common import run_command


def start(cmd: list[str], url: str, env: dict | None = None) -> subprocess.Popen:
    """A server process, once its /health says 200. Its stderr goes to a file, not a pipe: a pipe nobody reads
    fills (a compile's progress, a long soak's warnings) and stops the server."""
    import urllib.error
    import urllib.request

    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):  # not listening yet, or 503 while it loads
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not become healthy within 600 s")


def tail(log) -> str:
    """The end of what a process wrote to its stderr file: why it stopped."""
    log.seek(0)
    return log.read()[-500:]


def servers(args, path: Path, levels: list[int]) -> dict[str, tuple[subprocess.Popen, str, str]]:
    from moe.parallel.distributed import free_port

    running, seqs = {}, args.max_num_seqs or max(levels)

    def ours(name: str, gpus: int, *flags: str) -> None:
        port = free_port()
        cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "serve.py"), "--ckpt", str(path),
               "--port", str(port), "--dtype", args.dtype, "--gpus", str(gpus), "--max-num-seqs", str(seqs),
               "--max-model-len", str(args.input_len + args.output_len + 8), "--max-queue", str(4 * seqs),
               "--threads", str(max(1, args.threads // gpus)), *flags,
               *(["--attention", args.attention, "--experts", args.experts] if gpus > 1 else [])]
        url = f"http://127.0.0.1:{port}"
        running[name] = (start(cmd, url), url, path.name)

    for gpus in args.rank_counts:
        ours(f"ours x{gpus}", gpus, "--no-compile")
        if args.compile and (gpus == 1 or args.experts == "layer"):  # as it starts by default: compiled steps
            ours(f"ours x{gpus} compiled", gpus)
    if "llama-server" in args.against:
        from moe.bench.llama_cpp import GGUF_NAMES, LlamaCpp

        llama = LlamaCpp.find(args.llama_cpp)
        gguf = llama.to_gguf(path, args.dtype, args.workdir / "gguf")
        port = free_port()
        ctx = seqs * (args.input_len + args.output_len + 8)
        cmd = [str(llama.bench.parent / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb",
               str(args.threads), "-np", str(seqs), "-c", str(ctx), "--no-cache-prompt", "--port", str(port),
               "--host", "127.0.0.1", "--no-webui"]
        url = f"http://127.0.0.1:{port}"
        running[f"llama-server {GGUF_NAMES[args.dtype]}"] = (start(cmd, url), url, gguf.name)
    return running


class GenerateAlone:
    """`model.generate` in a process of its own, kept loaded, timing one request at a time when told: the figure a
    server's c=1 is set against (the 1-request goal), its decode steps eager or compiled as that server's
    (`compile=True` builds the step's package in the warm-up where it is missing). It runs in turns with the servers,
    since a request is a few hundred ms of a machine whose bandwidth moves from one spell to the next."""

    def __init__(self, path: Path, args, prompts: list[list[int]], compile: bool) -> None:
        request = f"m.generate([prompts[i % len(prompts)]], max_new_tokens={args.output_len}, ignore_eos=True)"
        code = ("import json, sys, time, torch; from moe import MoEModel\n"
                f"torch.set_num_threads({args.threads}); prompts = {prompts!r}\n"
                f"m = MoEModel.from_pretrained({str(path)!r}, dtype={args.dtype!r}, compile={compile!r})\n"
                "i = 0\n"
                f"{request}\n"
                "print('ready', flush=True)\n"
                "for line in sys.stdin:\n"
                "    t = time.perf_counter()\n"
                "    for i in range(int(line)):\n"
                f"        {request}\n"
                "    seconds = time.perf_counter() - t\n"
                f"    print(json.dumps({{'seconds': seconds, 'tokens': int(line) * {args.output_len}}}), flush=True)")
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a compile's progress never fills it and blocks
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)

    def wait(self) -> None:
        """Until it is loaded and warm: nothing is measured while a process beside it loads."""
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"model.generate did not start: {tail(self.log)}")

    def measure(self, requests: int) -> dict:
        """The seconds and output tokens of `requests` requests one after another, as a closed loop at c=1 counts
        them."""
        self.proc.stdin.write(f"{requests}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"model.generate exited: {tail(self.log)}")
        return json.loads(line)  # {"seconds": ..., "tokens": ...}

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # its loop ends
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()


def bench(args: argparse.Namespace) -> int:
    import random

    from moe.bench.sizes import write_sized_checkpoint
    from moe.cli.bench import BENCH_TOKENIZER
    from moe.host import cpu_name
    from moe.tokenizer import SentencePieceTokenizer

    vocab = SentencePieceTokenizer(BENCH_TOKENIZER).vocab_size
    path = args.ckpt or args.workdir / f"{args.size}-vocab{vocab}"
    if args.ckpt is None and not (path / "config.json").exists():
        write_sized_checkpoint(path, args.size, vocab_size=vocab)  # every streamed token has text
    if not (path / "tokenizer.model").exists() and not (path / "tokenizer.json").exists():
        shutil.copy(BENCH_TOKENIZER, path / "tokenizer.model")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.input_len)] for _ in range(64)]
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"machine: {cpu_name()}; {args.threads} thread(s); model {path.name}, {args.dtype}; prompts of "
          f"{args.input_len} tokens, {args.output_len} new tokens each; commit {commit()}")
    running = servers(args, path, levels)
    alone: dict[str, GenerateAlone] = {}
    rows: dict[str, dict] = {}
    try:
        for name, compiled in (("model.generate", False), ("model.generate compiled", True)):
            if 1 in levels and (args.compile or not compiled):  # one after the other: a compile never slows a load
                alone[name] = GenerateAlone(path, args, prompts, compiled)
                alone[name].wait()
        for _, url, model in running.values():  # warm-up: first requests build kernels and caches
            asyncio.run(closed_loop(url, model, prompts, 4, 1, 1))
        if args.rate:
            for name, (_, url, model) in running.items():
                rows[f"{name} rate {args.rate}/s"] = soak(args, url, model, prompts, running[name][0].pid)
        for level in levels:
            rows.update(measure_level(args, running, alone if level == 1 else {}, prompts, level))
    finally:
        for worker in alone.values():
            worker.close()
        for proc, _, _ in running.values():
            proc.terminate()
            proc.wait(timeout=120)
    print(table({k: v for k, v in rows.items() if "ttft_ms" in v}))
    for name, how, server in (("model.generate c=1", "eager", "ours x1 c=1"),
                              ("model.generate compiled c=1", "compiled", "ours x1 compiled c=1")):
        if name in rows and server in rows:
            ratios = [a / b for a, b in zip(rows[server]["rounds"], rows[name]["rounds"], strict=True)]
            print(f"model.generate, one request at a time, {how} steps: {rows[name]['output_tokens_per_s']:.1f} tok/s; "
                  f"{server} / it, each round: {' '.join(f'{r:.2f}x' for r in ratios)} "
                  f"(median {statistics.median(ratios):.2f}x; the c=1 goal: >= 0.9x)")
    for name, row in rows.items():
        if "cpu_ms_per_token" in row:
            print(f"{name}: CPU a token {cpu_line(row['cpu_ms_per_token'])} (this machine: {os.cpu_count()} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_name(), "commit": commit(), "rows": rows}, indent=1))
    return 0


def measure_level(args, running: dict, alone: dict, prompts: list, level: int) -> dict[str, dict]:
    """Every server's closed loop at `level`, in turns; at c=1 `--turns` rounds of every server and every
    `model.generate` beside them (`alone`), each row's figures over all its rounds and its tokens/s in each."""
    n = args.requests or max(2 * level, 8)
    runs: dict[str, list[tuple[list, float]]] = {}  # a server's (results, seconds) in each round
    spent: dict[str, list[dict]] = {}  # a model.generate's seconds and tokens in each round
    cpu: dict[str, Cpu] = {}  # at c=1: each process's CPU a token, by thread, and the load generator's
    for _ in range(args.turns if level == 1 else 1):
        for name, (proc, url, model) in running.items():
            with cpu.setdefault(name, Cpu(proc.pid)) as reading:
                results, seconds = asyncio.run(closed_loop(url, model, prompts, args.output_len, level, n))
                reading.tokens += sum(t.tokens for t in results if t.ok)
            runs.setdefault(name, []).append((results, seconds))
        for name, worker in alone.items():
            with cpu.setdefault(name, Cpu(worker.proc.pid)) as reading:
                done = worker.measure(n)
                reading.tokens += done["tokens"]
            spent.setdefault(name, []).append(done)
    rows = {f"{name} c={level}": {**summary([r for results, _ in rs for r in results], sum(s for _, s in rs)),
                                  "rounds": [summary(*r)["output_tokens_per_s"] for r in rs]}
            for name, rs in runs.items()}
    for name, done in spent.items():
        rows[f"{name} c=1"] = {"requests": n * len(done), "rounds": [d["tokens"] / d["seconds"] for d in done],
                               "output_tokens_per_s": sum(d["tokens"] for d in done) / sum(d["seconds"] for d in done)}
    if level == 1:
        for name, reading in cpu.items():
            rows[f"{name} c=1"]["cpu_ms_per_token"] = reading.per_token()
    return rows


class Cpu:
    """CPU a token over the rounds it is entered for: the process's (and its ranks') threads by name, and this
    process's, the load generator's (0 where it only waits for a model.generate)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.spent, self.tokens = pid, {}, 0  # tokens: the output tokens of the rounds, added by the caller

    def __enter__(self) -> Cpu:
        self.before, self.own = process_tree_cpu_s(self.pid), sum(os.times()[:2])
        return self

    def __exit__(self, *exc) -> None:
        after = {**process_tree_cpu_s(self.pid), "load generator": sum(os.times()[:2])}
        before = {**self.before, "load generator": self.own}
        for name, seconds in after.items():
            self.spent[name] = self.spent.get(name, 0.0) + seconds - before.get(name, 0.0)

    def per_token(self) -> dict[str, float]:
        return {name: seconds * 1e3 / max(self.tokens, 1) for name, seconds in self.spent.items()}


def cpu_line(ms: dict[str, float]) -> str:
    """"4.10 ms: http 0.19, python 3.91; load generator 0.09": a process's threads by name, then the client's."""
    own = {k: v for k, v in ms.items() if k != "load generator" and v >= 0.005}
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(own.items(), key=lambda kv: -kv[1]))
    line = f"{sum(own.values()):.2f} ms: {parts}"
    return line + (f"; load generator {ms['load generator']:.2f}" if ms.get("load generator", 0) >= 0.005 else "")


def soak(args, url: str, model: str, prompts: list, pid: int) -> dict:
    """Open loop at --rate (for --soak-seconds, else --requests requests): vLLM's figures, and the server's
    resident memory (rank 0's process) sampled every 30 s, to tell a leak from a first allocation."""
    import threading

    samples, done = [rss_mib(pid)], threading.Event()

    def sample() -> None:
        while not done.wait(30):
            samples.append(rss_mib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    count = int(args.rate * args.soak_seconds) if args.soak_seconds else args.requests or 64
    results, seconds = asyncio.run(open_loop(url, model, prompts, args.output_len, args.rate, count))
    done.set()
    sampler.join()
    out = summary(results, seconds)
    out["rss_mib_every_30s"] = samples + [rss_mib(pid)]
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent)
    return done.stdout.strip() or "?"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_serve.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["small", "medium", "qwen3-moe"])
    ap.add_argument("--ckpt", type=Path, default=None, help="use this checkpoint instead of a sized random one")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"), help="where sized checkpoints are kept")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads in all (ours: split by ranks)")
    ap.add_argument("--gpus", dest="rank_counts", default="1",
                    help="our servers' rank counts, comma-separated (default 1)")
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop levels (default 1,2,4,8,16)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(2 x level, 8))")
    ap.add_argument("--turns", type=int, default=3,
                    help="rounds of c=1, every server and model.generate in turns (default 3)")
    ap.add_argument("--rate", type=float, default=None, help="also an open loop at this many requests/s")
    ap.add_argument("--soak-seconds", type=float, default=None,
                    help="the open loop's length (a soak: failures and memory over a long run)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="sequences each server decodes together (-np for llama-server; default: the largest level)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--against", default="", help="llama-server (needs --llama-cpp DIR or LLAMA_CPP_DIR)")
    ap.add_argument("--llama-cpp", default=None, metavar="DIR")
    ap.add_argument("--compile", action="store_true",
                    help="also our server as it starts by default, with compiled steps (one per batch size, built at "
                         "its start or loaded) on 1 rank, and on N with --experts layer; the others run --no-compile")
    ap.add_argument("--attention", default="layer", choices=["layer", "replicated", "tensor"],
                    help="every block's attention on N ranks")
    ap.add_argument("--experts", default="expert", choices=["expert", "tensor", "layer"],
                    help="every block's experts on N ranks (layer: a pipeline of whole blocks)")
    ap.add_argument("--json", default=None)
    return ap


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.rank_counts = [int(g) for g in args.rank_counts.split(",")]
    if args.turns < 1:
        parser().error(f"--turns {args.turns}: give at least 1 round")
    return run_command(bench, args)
