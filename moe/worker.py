"""A rank's life: join the group, load its share, then serve requests in lock-step with the other ranks.

The parent (`moe.launcher.WorkerGroup`) sends every rank the same request over its pipe; the ranks run
it together over torch.distributed and reply. Under torchrun, `load_shard` is used directly instead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config import ConfigError
from moe.build import build_model
from moe.checkpoint.distributed_save import save_distributed
from moe.checkpoint.files import CheckpointError
from moe.checkpoint.formats import detect
from moe.checkpoint.loader import parse_dtype
from moe.distributed import DistContext, init_process_group
from moe.generation import generate_tokens
from moe.load_stats import set_round_robin
from moe.memory import peak_memory_mib
from moe.placement import Placement, PlacementError
from moe.replicated import ReplicatedAttentionEngine
from moe.sharded import ShardedEngine, apply_expert_placement, apply_placement

USER_ERRORS = (CheckpointError, PlacementError, ConfigError, ValueError)


@dataclass(frozen=True)
class ShardSpec:
    path: str
    dtype: str | None
    placement: dict  # Placement.to_json(), already validated by the parent
    progress: bool = False  # rank 0 prints a line per checkpoint file it has read
    attention: str = "owner"  # "owner": layer placement; "replicated": every rank attends for its batch slice
    cpu_kernels: str = "onednn"  # see MoEModel.from_pretrained


def load_shard(spec: ShardSpec, dist: DistContext) -> tuple[ShardedEngine, dict]:
    placement = Placement.from_json(spec.placement)
    torch_dtype = parse_dtype(spec.dtype, detect(spec.path).torch_dtype)
    progress = print_progress if spec.progress and dist.rank == 0 else None
    replicated = spec.attention == "replicated"  # every rank keeps the dense weights; only experts are placed
    prune, engine = (apply_expert_placement, ReplicatedAttentionEngine) if replicated else (apply_placement,
                                                                                           ShardedEngine)
    model, _, stats = build_model(spec.path, torch_dtype, dist.device, progress=progress,
                                  prune=lambda m: prune(m, placement, dist.rank), pack=spec.cpu_kernels == "onednn")
    return engine(model, placement, dist, torch_dtype), stats


def print_progress(line: str) -> None:
    print(f"rank 0: {line}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no rank outlives the process that started it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def cpu_share(rank: int, world_size: int) -> set[int]:
    """The cores a CPU rank keeps to: an equal slice, or one core round-robin when ranks outnumber cores.
    Pinned ranks stop migrating between cores, which makes gloo's collectives cheaper when they share."""
    cores = sorted(os.sched_getaffinity(0))
    if world_size <= len(cores):
        per = len(cores) // world_size
        return set(cores[rank * per:(rank + 1) * per])
    return {cores[rank % len(cores)]}


def worker_main(rank: int, world_size: int, port: int, threads: int, conn, spec: ShardSpec) -> None:
    _die_with_parent()
    torch.set_num_threads(threads)
    try:
        dist = init_process_group(rank, world_size, "127.0.0.1", port)
        share = cpu_share(rank, world_size)
        if dist.device.type == "cpu" and world_size > 1 and threads <= len(share):
            os.sched_setaffinity(0, share)  # not when asked for more threads than cores: they would spin-wait
        baseline = peak_memory_mib(dist.device)  # the process before any weight is read
        engine, stats = load_shard(spec, dist)
        names = sorted(name for name, _ in engine.model.named_parameters())  # not state_dict(): it unpacks weights
        conn.send(("ok", {"rank": rank, "params": names, **stats,
                          "baseline_mib": baseline, "loaded_peak_mib": peak_memory_mib(dist.device),
                          "device": str(dist.device), "backend": dist.backend}))
        serve(engine, conn)
    except BaseException as e:  # report, then exit: the parent stops the other ranks
        kind = "user" if isinstance(e, USER_ERRORS) else "fault"
        detail = "" if kind == "user" else traceback.format_exc(limit=-3)
        try:
            conn.send(("error", kind, type(e).__name__, str(e).splitlines()[0] if str(e) else "", detail))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def serve(engine: ShardedEngine, conn) -> None:
    rank = engine.rank
    while True:
        op, *args = conn.recv()
        if op == "close":
            conn.send(("ok", None))
            return
        if op == "generate":
            ids, params, eos, context = args
            on_token = (lambda b, t: conn.send(("token", b, t))) if rank == 0 else None
            result = generate_tokens(engine, ids, params, eos, context, on_token)
            conn.send(("ok", result if rank == 0 else None))
        elif op == "logits":
            logits = engine.logits(args[0])
            conn.send(("ok", logits.cpu() if logits is not None else None))
        elif op == "save":
            out, max_shard_bytes, tokenizer = args
            conn.send(("ok", save_distributed(engine.model, engine.model.cfg, out, engine.dist,
                                              max_shard_bytes, tokenizer)))
        elif op == "memory":
            conn.send(("ok", peak_memory_mib(engine.dist.device)))
        elif op == "load_stats":
            conn.send(("ok", engine.load_stats()))
        elif op == "reset_load_stats":
            engine.reset_load_stats()
            conn.send(("ok", None))
        elif op == "set_round_robin":
            set_round_robin(engine.model, bool(args[0]))
            conn.send(("ok", None))
        elif op == "fail":  # fault injection for tests: this rank raises, the others wait in a collective
            if rank == args[0]:
                raise RuntimeError(f"injected failure on rank {rank}")
            torch.distributed.barrier()
            conn.send(("ok", None))
        else:
            raise ValueError(f"unknown request {op!r}")


ATTENTION_MODES = ("owner", "replicated")


def spec_for(path: str | Path, dtype: str | None, placement: Placement, progress: bool = False,
             attention: str = "owner", cpu_kernels: str = "onednn") -> ShardSpec:
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention={attention!r}: use one of {', '.join(ATTENTION_MODES)}")
    return ShardSpec(str(path), dtype, placement.to_json(), progress, attention, cpu_kernels)
