"""Where ranks run: CUDA (NCCL, one GPU per rank) or CPU (gloo), chosen the same way on every rank.

`device="auto"` means CUDA when this machine has a GPU for each of its ranks and CPU when it has no GPU;
a machine with some GPUs but fewer than its ranks is an error (never a silent fall back to CPU). Under
torchrun the choice is made per machine, from LOCAL_WORLD_SIZE, and the ranks then check through the
rendezvous store that every machine chose alike before any backend starts (mixed backends would hang).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from moe.host import usable_cores

DEVICES = ("auto", "cuda", "cpu")


def resolve_device(device: str, ranks_here: int, cuda_devices: int | None = None) -> str:
    """"cuda" or "cpu" for `ranks_here` ranks on this machine, one GPU each; a one-line error otherwise."""
    if device not in DEVICES and not (device.startswith("cuda:") and ranks_here == 1):
        raise ValueError(f"device={device!r}: use one of {', '.join(DEVICES)}" + (" (or cuda:N for one rank)"
                                                                                  if ranks_here == 1 else ""))
    n = cuda_devices if cuda_devices is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device == "cpu" or (device == "auto" and n == 0):
        return "cpu"
    if n == 0:
        raise ValueError(f"device={device!r} but no CUDA device is visible; use --device cpu (device='cpu')")
    if ranks_here > n:
        raise ValueError(f"{ranks_here} GPU ranks on this machine but only {n} CUDA device(s); use --device cpu "
                         f"(device='cpu') to run {ranks_here} CPU processes, or fewer ranks")
    return "cuda"


RANKS_PER_CORE = 4  # more CPU ranks than this share a core so thinly that every collective crawls
RANK_BASELINE_MIB = 250  # a rank's interpreter, torch and process group before any weight


def ranks_device(device: str, ranks: int) -> str:
    """`resolve_device` for ranks started on this machine, CPU ranks bounded by its cores and memory."""
    kind = resolve_device(device, ranks)
    if kind == "cpu" and ranks > 1:
        from moe.memory import available_mib

        check_cpu_ranks(ranks, usable_cores(), available_mib())
    return kind


def check_cpu_ranks(ranks: int, cores: int, available_mib: float) -> None:
    """Refuse, before a process starts, more CPU ranks than this machine can run."""
    by_memory = int(available_mib // RANK_BASELINE_MIB) if math.isfinite(available_mib) else ranks  # unknown: inf
    limit = min(RANKS_PER_CORE * cores, by_memory)
    if ranks > limit:
        raise ValueError(f"--gpus {ranks}: this machine runs at most {limit} CPU ranks ({cores} cores, "
                         f"{available_mib / 1024:.1f} GiB free, about {RANK_BASELINE_MIB} MiB per rank before any "
                         "weight); ask for fewer")


def backend_for(kind: str) -> str:
    return "nccl" if kind == "cuda" else "gloo"


def torchrun_layout(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, ranks on this machine) from torchrun's environment."""
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", rank))
    return rank, world, local_rank, int(env.get("LOCAL_WORLD_SIZE", world))


def agree_on_device(store, rank: int, world_size: int, kind: str) -> None:
    """Every rank posts its choice to the rendezvous store and reads everyone's: a mismatch (machines with
    different GPU counts under device="auto") is one error, raised on every rank, before any backend starts."""
    store.set(f"moe/device/{rank}", kind)
    kinds = [store.get(f"moe/device/{r}").decode() for r in range(world_size)]
    if len(set(kinds)) > 1:
        by_kind = {k: [r for r, x in enumerate(kinds) if x == k] for k in sorted(set(kinds))}
        raise ValueError("ranks disagree on their device: " + "; ".join(f"{k} on ranks {v}" for k, v in by_kind.items())
                         + " (every machine needs a GPU per local rank for cuda); pass --device cpu or --device cuda")
