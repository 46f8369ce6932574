"""Distributed state, made once at the entry point and passed down: rank, world size, device, backend.

torch.distributed is the only transport: NCCL with one GPU per rank when CUDA devices exist, gloo on
CPU otherwise. Nothing here reads the environment except `from_torchrun`, called by entry points.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # backstop; launchers stop a failed group sooner


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str  # "nccl", "gloo", or "none" for one rank without a process group

    @property
    def distributed(self) -> bool:
        return self.backend != "none"

    # Point-to-point moves of hidden states between block owners.
    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous(), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src)
        return t

    # Collectives. With one rank and no process group each is the identity, so engines, dispatchers and
    # the trainer run unchanged in one process.
    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(t, src)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.distributed:
            dist.all_reduce(t)
        return t

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Rows of x go to the ranks in order (in_splits rows each); out receives out_splits rows from each."""
        if self.distributed:
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        else:
            out.copy_(x)
        return out

    def gather(self, t: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's equally shaped `t`, in rank order, on `dst`; None elsewhere."""
        if not self.distributed:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(t, parts, dst=dst)
        return parts

    def all_gather_object(self, obj: object) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: object, src: int) -> object:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def destroy(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def single_process(device: str | torch.device = "cpu") -> DistContext:
    return DistContext(0, 1, torch.device(device), "none")


def pick_backend(world_size: int) -> tuple[str, bool]:
    """(backend, uses_cuda): NCCL only when every rank can have a GPU of its own."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl", True
    return "gloo", False


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int,
                       local_rank: int | None = None) -> DistContext:
    backend, cuda = pick_backend(world_size)
    device = torch.device("cuda", local_rank if local_rank is not None else rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if cuda else None)
    return DistContext(rank, world_size, device, backend)


def under_torchrun() -> bool:
    """torchrun (or any launcher of its kind) made this process one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def from_torchrun() -> DistContext | None:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), if any; reuse the
    group when this process has joined it already (a second model in the same job)."""
    if not under_torchrun():
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if dist.is_initialized():
        backend = dist.get_backend()
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        return DistContext(rank, world_size, device, backend)
    return init_process_group(rank, world_size, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              int(os.environ.get("MASTER_PORT", "29500")), local_rank)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise ValueError(f"--master-port {port} is already in use on {host}; pick another or omit it") from None
