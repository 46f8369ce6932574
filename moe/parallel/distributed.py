"""Distributed state, made once at the entry point and passed down: rank, world size, device, backend.

torch.distributed is the only transport: NCCL with one GPU per rank when CUDA devices exist, gloo on
CPU otherwise. Nothing here reads the environment except `from_torchrun`, called by entry points.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take `group=group.WORLD` as a default, bound
# when the module is imported, and torch.compile imports it. Imported after `init_process_group`, it would hold the
# default group past `destroy_process_group`, and gloo's threads with it, into interpreter exit: there a worker
# releasing a finished collective's tensors needs the GIL, and the process aborts ("terminate called": rank 0 of 2
# compiled torchrun ranks, now and then; `tests/test_group_shutdown.py`).
import torch.distributed.nn.functional  # noqa: F401

from moe.parallel.devices import agree_on_device, backend_for, resolve_device, torchrun_layout

# How long a collective may wait for the slowest rank: loading or saving tens of GB from cold storage takes
# minutes. A rank that dies is found sooner: by the launcher (its pipe closes) or by torchrun's agent.
DEFAULT_TIMEOUT_S = 1800.0


# Renamed in torch 2.13 (the old names warn there); older releases have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str  # "nccl", "gloo", or "none" for one rank without a process group
    groups: dict = field(default_factory=dict, compare=False, repr=False)  # ranks -> process group (make_groups)
    # Wait for a gloo collective by polling it (yielding the core between polls) instead of sleeping in it: for a
    # rank with cores of its own (`moe.workers.rank.keep_to_share`), where a sleeping core is one the host may give
    # away, and waking it took milliseconds (`_finish` says more).
    poll: bool = field(default=False, compare=False)
    # Collectives and point-to-point moves this rank has entered (eager ones; a compiled step's are inside its
    # graph): an error raised after the count moved within a call is no user error, since other ranks may be
    # waiting in a collective this rank will not enter (`moe.workers.rank.serve`).
    entered: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.backend != "none"

    @property
    def collectives(self) -> int:
        return self.entered[0]

    def _on_device(self, *tensors: torch.Tensor) -> None:
        """NCCL moves GPU memory only: a CPU tensor here is a bug of ours, named at once instead of a crash or a
        hang inside NCCL."""
        if self.backend == "nccl":
            for t in tensors:
                if t.device.type != "cuda":
                    raise RuntimeError(f"rank {self.rank}: a {t.device.type} tensor {list(t.shape)} was handed to an "
                                       "NCCL collective")

    # Point-to-point moves of hidden states between block owners.
    def send(self, t: torch.Tensor, dst: int) -> None:
        self._on_device(t)
        self.entered[0] += 1
        dist.send(t.contiguous(), dst)  # not polled: gloo's point-to-point work never says it is completed

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.entered[0] += 1
        dist.recv(t, src)
        return t

    def _finish(self, work) -> None:
        """Wait for a collective started with async_op. Polled on gloo where `poll` is set: a rank that sleeps in a
        collective is woken by gloo's threads, and on a virtual machine's idle core that wake-up took 3-5 ms one
        call in ten (a 2-rank all-gather after equal products on both ranks: mean 0.82 ms, p90 3.35 ms sleeping;
        0.25 and 0.27 polling). Between polls the core is yielded, so gloo's own threads on it run at once. The
        error or timeout of a failed operation is raised by `wait` as before."""
        self.entered[0] += 1
        if self.poll and self.backend == "gloo":
            while not work.is_completed():
                os.sched_yield()
        work.wait()

    # Collectives. With one rank and no process group each is the identity, so engines, dispatchers and
    # the trainer run unchanged in one process.
    def broadcast(self, t: torch.Tensor, src: int, ranks: tuple[int, ...] | None = None) -> torch.Tensor:
        """`src`'s `t` on every rank (or every rank of a group made by `make_groups`), in place."""
        if self.distributed:
            self._on_device(t)
            self._finish(dist.broadcast(t, src, group=self._group(ranks), async_op=True))
        return t

    def has_group(self, ranks: tuple[int, ...]) -> bool:
        return self._is_world(ranks) or ranks in self.groups

    def _group(self, ranks: tuple[int, ...] | None):
        return None if ranks is None or self._is_world(ranks) else self.groups[ranks]

    def _is_world(self, ranks: tuple[int, ...]) -> bool:
        return sorted(ranks) == list(range(self.world_size))

    def make_groups(self, groups: list[tuple[int, ...]]) -> None:
        """Collective: the process groups of tensor-parallel groups, made once and in the same order on every
        rank (torch.distributed needs every rank at every group's creation, members or not)."""
        for ranks in sorted(set(groups)):
            if self.distributed and ranks not in self.groups and 1 < len(ranks) < self.world_size:
                self.groups[ranks] = dist.new_group(list(ranks))

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...] | None = None) -> torch.Tensor:
        """Sum over ranks (all, or a group made by `make_groups`), in place."""
        if not self.distributed or (ranks is not None and len(ranks) == 1):
            return t
        self._on_device(t)
        self._finish(dist.all_reduce(t, group=self._group(ranks), async_op=True))
        return t

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Rows of x go to the ranks in order (in_splits rows each); out receives out_splits rows from each."""
        if self.distributed:
            self._on_device(out, x)
            self._finish(dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, async_op=True))
        else:
            out.copy_(x)
        return out

    # The two fixed-size collectives of a gathered decode step. gloo's own all-gather and reduce-scatter cost 0.64
    # and 1.5 ms for a decode step's few rows on this machine, its all-to-all 0.4 ms, so on gloo both are an
    # all-to-all with equal splits; NCCL runs its own.
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's equally shaped `t`, concatenated along dim 0 in rank order, on every rank."""
        if not self.distributed:
            return t
        self._on_device(t)
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        if self.backend == "gloo":  # a block of copies, one per rank (`cat`: 1 us here, `repeat` 6)
            self._finish(dist.all_to_all_single(out, torch.cat([t] * self.world_size), async_op=True))
        else:
            self._finish(_all_gather(out, t.contiguous(), async_op=True))
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` [world x rows, ...]: this rank's block of rows (rank x rows onwards), summed
        in rank order."""
        if not self.distributed:
            return t
        self._on_device(t)
        rows = t.shape[0] // self.world_size
        if self.backend != "gloo":
            out = t.new_empty((rows, *t.shape[1:]))
            self._finish(_reduce_scatter(out, t.contiguous(), async_op=True))
            return out
        parts = torch.empty_like(t)
        # equal splits: block r of `parts` came from rank r
        self._finish(dist.all_to_all_single(parts, t.contiguous(), async_op=True))
        return _blocks_summed_in_order(parts, self.world_size)

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t`, added in rank order here: the same bits on every rank, whatever the backend
        (one all-gather; for a decode step's few rows, where the volume is nothing and the call is everything).
        In a compiled step, one opaque op of the graph (`_summed_over_ranks`)."""
        if not self.distributed:
            return t
        if torch.compiler.is_compiling():
            return torch.ops.moe_dist.sum_in_rank_order(t, self.world_size, self.poll)
        return _blocks_summed_in_order(self.all_gather(t), self.world_size)

    def gather(self, t: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's equally shaped `t`, in rank order, on `dst`; None elsewhere."""
        if not self.distributed:
            return [t]
        self._on_device(t)
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == dst else None
        self._finish(dist.gather(t, parts, dst=dst, async_op=True))
        return parts

    def all_gather_object(self, obj: object) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        self.entered[0] += 1
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: object, src: int) -> object:
        if not self.distributed:
            return obj
        box = [obj]
        self.entered[0] += 1
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            self.entered[0] += 1
            dist.barrier()

    def destroy(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        self.groups.clear()  # a group held here would keep its gloo threads running


def _blocks_summed_in_order(parts: torch.Tensor, world_size: int) -> torch.Tensor:
    """`parts` [world x rows, ...] as `world_size` blocks of rows, one per rank, summed in rank order."""
    rows = parts.shape[0] // world_size
    if world_size == 1:
        return parts.clone()
    out = parts[:rows] + parts[rows:2 * rows]
    for r in range(2, world_size):
        out += parts[r * rows:(r + 1) * rows]
    return out


def _summed_over_ranks(t: torch.Tensor, world_size: int, poll: bool) -> torch.Tensor:
    """`DistContext.sum_in_rank_order` over the default group, as an op a compiled step calls: dynamo cannot trace
    a collective waited for by polling, so the graph calls this (from inductor's C++ wrapper), which waits as the
    eager step does."""
    here = DistContext(dist.get_rank(), world_size, t.device, dist.get_backend(), poll=poll)
    return here.sum_in_rank_order(t)


# Registered with a plain `Library` rather than `torch.library.custom_op`, whose Python wrapper around the kernel
# cost about 10 us a call here (37 against 26 us, one process), and a decode step calls the op once per block.
_LIBRARY = torch.library.Library("moe_dist", "DEF")
_LIBRARY.define("sum_in_rank_order(Tensor t, int world_size, bool poll) -> Tensor")
_LIBRARY.impl("sum_in_rank_order", _summed_over_ranks, "CompositeExplicitAutograd")


@torch.library.register_fake("moe_dist::sum_in_rank_order", lib=_LIBRARY)
def _(t: torch.Tensor, world_size: int, poll: bool) -> torch.Tensor:
    return torch.empty_like(t)


def single_process(device: str | torch.device = "cpu") -> DistContext:
    return DistContext(0, 1, torch.device(device), "none")


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, kind: str = "cpu",
                       local_rank: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                       poll: bool = False) -> DistContext:
    """Join a group whose ranks were started here (all on this machine, the device kind chosen by the parent);
    `poll`: see `DistContext.poll`."""
    device = _bind(kind, local_rank if local_rank is not None else rank)
    dist.init_process_group(backend_for(kind), init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if kind == "cuda" else None)
    return DistContext(rank, world_size, device, backend_for(kind), poll=poll)


def _bind(kind: str, local_rank: int) -> torch.device:
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def under_torchrun() -> bool:
    """torchrun (or any launcher of its kind) made this process one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def from_torchrun(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[DistContext, bool] | None:
    """Join the group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), if
    any: (its context, whether this call created the group). A process that joined already (a second model in
    the same job) reuses its group."""
    if not under_torchrun():
        return None
    rank, world_size, local_rank, local_world = torchrun_layout(os.environ)
    if dist.is_initialized():
        backend = dist.get_backend()
        return DistContext(rank, world_size, _bind("cuda" if backend == "nccl" else "cpu", local_rank), backend), False
    kind = resolve_device(device, local_world)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    agree_on_device(store, rank, world_size, kind)
    bound = _bind(kind, local_rank)
    dist.init_process_group(backend_for(kind), store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=bound if kind == "cuda" else None)
    made = DistContext(rank, world_size, bound, backend_for(kind))
    atexit.register(made.destroy)  # for a script that never closes its model: gloo's threads end before exit
    return made, True


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
