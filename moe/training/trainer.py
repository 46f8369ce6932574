"""The training run: data, schedule, validation, logging and saving around `moe.training.train_step`.

`run_training` starts one process per rank (or runs in this process for one rank); under torchrun each
process is a rank already. Rank 0 prints and writes the log; all ranks write their experts at the end.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.config import ModelConfig
from moe.checkpoint.distributed_save import save_distributed
from moe.evaluation import Score, score_windows, token_stream, windows
from moe.parallel.devices import resolve_device
from moe.parallel.distributed import DistContext, single_process
from moe.parallel.placement import Placement
from moe.progress import Progress
from moe.tokenizer import SentencePieceTokenizer
from moe.training.corpus import read_documents
from moe.training.steps import (
    TrainSettings,
    init_model,
    lr_at,
    make_optimizer,
    sample_batch,
    shard_experts,
    train_step,
)


@dataclass
class TrainJob:
    corpus: str  # directory with train.txt, valid.txt, tokenizer.model
    out: str
    model: dict  # ModelConfig fields
    settings: TrainSettings = field(default_factory=TrainSettings)
    steps: int | None = None  # fixed step count; else estimated from `minutes`
    minutes: float = 20.0
    eval_every: int = 200
    eval_windows: int = 64
    log_every: int = 20
    threads: int = 1
    progress: bool = False  # a bar on rank 0 (steps, loss, tokens/s, ETA) when standard error is a terminal
    device: str = "auto"  # see moe.parallel.devices


def say(ctx: DistContext, *args, **kwargs) -> None:
    if ctx.rank == 0:
        print(*args, **kwargs, flush=True)


def agree(value: float, ctx: DistContext) -> float:
    """Rank 0's value on every rank (decisions that depend on timing must be identical)."""
    return float(ctx.broadcast(torch.tensor([value], dtype=torch.float64, device=ctx.device), 0))


def validate(model, wins: list[torch.Tensor], ctx: DistContext, n_bytes_per_token: float) -> Score:
    """Loss over validation windows; rank r scores windows r, r+R, ...; sums are all-reduced."""
    model.eval()
    nats, tokens = 0.0, 0
    for i in range(math.ceil(len(wins) / ctx.world_size)):
        j = i * ctx.world_size + ctx.rank
        # Every rank runs the same number of forward passes (each one exchanges expert rows): a rank out
        # of windows scores the first one again and drops the result.
        n, t = score_windows(lambda t: model(t.to(ctx.device)), [wins[j if j < len(wins) else 0]], batch=1)
        if j < len(wins):
            nats, tokens = nats + n, tokens + t
    total = torch.tensor([nats, tokens], dtype=torch.float64, device=ctx.device)
    ctx.all_reduce(total)
    model.train()
    return Score(float(total[0]), int(total[1]), round(float(total[1]) * n_bytes_per_token))


@dataclass
class TrainData:
    train_stream: torch.Tensor
    valid_stream: torch.Tensor
    bytes_per_token: float  # of the validation text, for bits per byte
    step_windows: list[torch.Tensor]  # validated during training
    all_windows: list[torch.Tensor]  # validated at the end


def load_data(job: TrainJob) -> TrainData:
    corpus = Path(job.corpus)
    tokenizer = SentencePieceTokenizer(corpus / "tokenizer.model")
    train_docs, valid_docs = read_documents(corpus / "train.txt"), read_documents(corpus / "valid.txt")
    valid_stream = token_stream(valid_docs, tokenizer)
    all_windows = windows(valid_stream, job.settings.seq_len)
    full = [w for w in all_windows if w.numel() == job.settings.seq_len + 1][:job.eval_windows]
    return TrainData(token_stream(train_docs, tokenizer), valid_stream,
                     sum(len(d.encode()) for d in valid_docs) / (valid_stream.numel() - 1), full, all_windows)


def run_steps(job: TrainJob, model, optimizer, data: TrainData, ctx: DistContext, shown: Progress) -> list[dict]:
    """The training loop; returns one row of figures per step."""
    s = job.settings
    history: list[dict] = []
    total_steps = job.steps or 10**9
    t0 = time.perf_counter()
    shown.start(job.steps)
    step = 0
    while step < total_steps:
        lr = lr_at(step, total_steps, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        r = train_step(model, optimizer, sample_batch(data.train_stream, s.batch_size, s.seq_len, step, s.seed), s, ctx)
        step += 1
        elapsed = agree(time.perf_counter() - t0, ctx)
        if job.steps is None and step == 20:  # fix the schedule's length from the measured step time
            total_steps = max(step + 1, int(job.minutes * 60 / (elapsed / step)))
            shown.set_total(total_steps)
            shown.note(f"{elapsed / step:.3f} s/step -> {total_steps} steps in {job.minutes:g} min", sys.stdout)
        row = {"step": step, "tokens": step * s.batch_size * s.seq_len, "seconds": round(elapsed, 1),
               "lr": lr, "loss": r.loss, "balance": r.balance, "grad_norm": r.grad_norm}
        if step % job.eval_every == 0 or step == total_steps:
            v = validate(model, data.step_windows, ctx, data.bytes_per_token)
            row |= {"val_loss": v.nats_per_token, "val_bpb": v.bits_per_byte}
        history.append(row)
        shown.update(1, loss=f"{r.loss:.3f}", tok_s=f"{row['tokens'] / max(elapsed, 1e-9):.0f}")
        if step % job.log_every == 0 or "val_loss" in row:
            val = f" | val {row['val_loss']:.3f} nats/tok, {row['val_bpb']:.3f} bits/byte" if "val_loss" in row else ""
            shown.note(f"step {step:5d} | {elapsed:6.0f} s | lr {lr:.2e} | loss {r.loss:.3f} | "
                       f"balance {r.balance:.3f} | grad {r.grad_norm:.2f}{val}", sys.stdout)
    shown.close()
    return history


def train(job: TrainJob, ctx: DistContext) -> dict:
    torch.set_num_threads(job.threads)
    data = load_data(job)
    s = job.settings
    cfg = ModelConfig(**job.model)
    model = init_model(cfg, s.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if ctx.distributed:
        shard_experts(model, Placement.default(cfg.n_layers, cfg.n_experts, ctx.world_size), ctx)
    model.to(ctx.device).train()
    optimizer = make_optimizer(model, s)
    say(ctx, f"train {data.train_stream.numel():,} tokens, valid {data.valid_stream.numel():,} tokens; "
             f"{n_params:,} parameters; {ctx.world_size} rank(s) x {job.threads} thread(s)")
    shown = Progress("training", unit="step", enabled=ctx.rank == 0, bar=job.progress)  # log lines on rank 0
    t0 = time.perf_counter()
    history = run_steps(job, model, optimizer, data, ctx, shown)
    train_seconds = time.perf_counter() - t0
    final = validate(model, data.all_windows, ctx, data.bytes_per_token)
    say(ctx, f"validation (all {len(data.all_windows)} windows): {final.nats_per_token:.4f} nats/token, "
             f"{final.bits_per_byte:.4f} bits/byte")
    model.eval()
    save_distributed(model, cfg, job.out, ctx, beside=[Path(job.corpus) / "tokenizer.model"])
    steps = len(history)
    summary = {"steps": steps, "tokens_seen": steps * s.batch_size * s.seq_len, "train_seconds": round(train_seconds),
               "ranks": ctx.world_size, "threads_per_rank": job.threads, "settings": asdict(s),
               "train_tokens": data.train_stream.numel(), "eval_windows": len(data.step_windows),
               "val_nats_per_token": final.nats_per_token, "val_bits_per_byte": final.bits_per_byte,
               "history": history}
    if ctx.rank == 0:
        (Path(job.out) / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
        say(ctx, f"wrote {job.out}")
    return summary


def train_rank(rank: int, world_size: int, port: int, job: TrainJob, kind: str) -> None:
    from moe.parallel.distributed import init_process_group

    ctx = init_process_group(rank, world_size, "127.0.0.1", port, kind)
    try:
        train(job, ctx)
    finally:
        ctx.destroy()


def run_training(job: TrainJob, world_size: int) -> None:
    """Train on `world_size` ranks: this process for one, else rank processes (one GPU each with CUDA)."""
    kind = resolve_device(job.device, world_size)
    if world_size == 1:
        train(job, single_process(kind))
        return
    from moe.workers.group import run_ranks

    run_ranks(train_rank, world_size, job, kind)
