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

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(t, src)
        return t


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


def from_torchrun() -> DistContext | None:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), if any."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return init_process_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                              os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                              int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


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
