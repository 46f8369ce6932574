"""A rank process's life: join the group, load its share, then serve calls in lock-step with the other ranks.

The parent (`moe.workers.group.WorkerGroup`) sends every rank the same call over its pipe; each rank runs it
on its `ShardedEngine` (the same calls `moe.engine.base.ENGINE_CALLS` names) and rank 0 replies. Under
torchrun no rank process exists: `MoEModel` builds the same engine with `load_shard` in each process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from moe.checkpoint.loader import activation_dtype
from moe.engine.base import ENGINE_CALLS
from moe.engine.build import build_model
from moe.engine.layouts import compilable_plan, engine_type
from moe.engine.sharded import ShardedEngine
from moe.errors import USER_ERRORS, first_line
from moe.host import can_pin, core_ids, pin, usable_cores
from moe.memory import peak_memory_mib
from moe.parallel.distributed import DEFAULT_TIMEOUT_S, DistContext, init_process_group
from moe.parallel.gather import StepRows
from moe.parallel.placement import Placement
from moe.parallel.sharding import apply_placement, connect_ranks
from moe.progress import Progress

READY = 0  # the request id of the load report (moe.workers.group)
HEARTBEAT_S = 2.0  # a rank busy with a request says so this often


@dataclass(frozen=True)
class ShardSpec:
    path: str
    dtype: str  # resolved by the parent: "float32", "bfloat16", "float16", "int8"
    placement: dict  # Placement.to_json(), already validated by the parent
    progress: bool = False  # rank 0 shows checkpoint reading progress
    cpu_kernels: str = "auto"  # see MoEModel.from_pretrained
    device: str = "cpu"  # "cuda" (NCCL, GPU `rank` of this machine) or "cpu" (gloo); chosen by the parent
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a collective waits for the slowest rank
    exchange: str = "auto"  # the experts' exchange: "auto" (gather for decode), "all-to-all", "gather"
    compile: bool = False  # decode steps run compiled where the layout allows (moe.engine.layouts)


def load_shard(spec: ShardSpec, dist: DistContext) -> tuple[ShardedEngine, dict]:
    """Build this rank's share of the model and the engine that runs it."""
    placement = compilable_plan(Placement.from_json(spec.placement), spec.compile, spec.exchange)
    torch_dtype = activation_dtype(spec.dtype)
    progress = Progress.for_loading(enabled=spec.progress and dist.rank == 0)
    model, _, stats = build_model(spec.path, spec.dtype, dist.device, progress=progress,
                                  prune=lambda m: apply_placement(m, placement, dist.rank), kernels=spec.cpu_kernels)
    step = StepRows(spec.exchange)
    connect_ranks(model, placement, dist, step)
    engine = engine_type(placement)(model, placement, dist, torch_dtype, step)
    engine.checkpoint_dir = spec.path
    if spec.compile:
        engine.compile_decode()
    return engine, stats


def load_report(model: torch.nn.Module, stats: dict, baseline_mib: float, device: torch.device,
                backend: str) -> dict:
    """What a rank says once it holds its share; the same keys whether it is a rank process, a torchrun
    process or the only process (`moe.info.ModelInfo.from_reports`)."""
    return {"pid": os.getpid(), "params": sorted(name for name, _ in model.named_parameters()),  # not state_dict():
            **stats, "baseline_mib": baseline_mib, "loaded_peak_mib": peak_memory_mib(device),  # it unpacks weights
            "backend": backend}


def cpu_share(rank: int, world_size: int) -> set[int]:
    """The cores a CPU rank keeps to: an equal slice, or one core round-robin when ranks outnumber cores.
    Pinned ranks stop migrating between cores, which makes gloo's collectives cheaper when they share."""
    cores = core_ids()
    if world_size <= len(cores):
        per = len(cores) // world_size
        return set(cores[rank * per:(rank + 1) * per])
    return {cores[rank % len(cores)]}


def keep_to_share(rank: int, world_size: int, threads: int) -> bool:
    """Pin this CPU rank to its `cpu_share` (before its process group, so gloo's threads start there too), unless
    asked for more threads than the share has (they would spin-wait). True if the cores are this rank's alone,
    where waiting for a collective by polling costs no other rank anything (`DistContext.poll`)."""
    share = cpu_share(rank, world_size)
    if world_size == 1 or threads > len(share) or not can_pin():  # macOS, Windows: the system places the ranks
        return False
    alone = world_size <= usable_cores()
    pin(share)
    return alone


GLOO_IO_THREAD = "gloo_tcp_loop"  # the name gloo gives the thread of its TCP transport's event loop
PF_EXITING = 0x4  # a task's flag (the 9th field of /proc/.../stat) from the start of its exit


def gloo_io_threads() -> list[int]:
    """The thread ids of gloo's I/O threads in this process (one per gloo context). A thread past gloo's join but
    not yet reaped by the kernel is listed in /proc for a moment; it runs no more code and is not counted. Linux
    only; elsewhere none."""
    tasks = Path("/proc/self/task")
    found = []
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            if (task / "comm").read_text().strip() != GLOO_IO_THREAD:
                continue
            flags = int((task / "stat").read_text().rsplit(")", 1)[1].split()[6])
        except OSError:  # a thread that ended meanwhile
            continue
        if not flags & PF_EXITING:
            found.append(int(task.name))
    return found


def lower_gloo_io_threads() -> int:
    """Put gloo's I/O threads of this process at the lowest priority (nice 19) and return how many there were. On
    a rank with a core of its own, an I/O thread woken by a peer's bytes took the core from the rank's own thread in
    stretches of 1-10 ms (`perf sched` over 3 s of a 2-rank step: 190 such runs, 520 of the 760 ms the two I/O
    threads ran). At the lowest priority it runs when the rank waits for the collective (polling yields the core),
    and a compiled 2-rank bf16 step took 5.34 ms instead of 6.12 (6 rounds in turns). Linux only; elsewhere nothing."""
    lowered = 0
    for tid in gloo_io_threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            lowered += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return lowered


def worker_main(conn, rank: int, world_size: int, port: int, threads: int, spec: ShardSpec) -> None:
    torch.set_num_threads(threads)
    try:
        own_cores = spec.device == "cpu" and keep_to_share(rank, world_size, threads)
        dist = init_process_group(rank, world_size, "127.0.0.1", port, spec.device, timeout_s=spec.timeout_s,
                                  poll=own_cores)
        baseline = peak_memory_mib(dist.device)  # the process before any weight is read
        engine, stats = load_shard(spec, dist)  # every process group made: their I/O threads exist
        if own_cores:
            lower_gloo_io_threads()
        conn.send(("ok", READY, load_report(engine.model, stats, baseline, dist.device, dist.backend)))
        serve(engine, conn)
        dist.destroy()  # gloo's threads end here rather than during interpreter exit (moe.parallel.distributed)
    except BaseException as e:  # report, then exit: the parent stops the other ranks
        kind = "user" if isinstance(e, USER_ERRORS) else "fault"
        detail = "" if kind == "user" else traceback.format_exc(limit=-3)
        try:
            conn.send(("error", READY, kind, type(e).__name__, first_line(e), detail))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)


class Heartbeat:
    """While a request runs, a thread of the rank says it is alive every `HEARTBEAT_S` seconds, even when the
    main thread waits in a collective; a rank that is stopped or frozen falls silent, and the parent names it."""

    def __init__(self, conn) -> None:
        self.conn, self.req = conn, None
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            req = self.req
            if req is not None:
                try:
                    self.conn.send(("alive", req))
                except OSError:
                    return


def serve(engine: ShardedEngine, conn) -> None:
    """Run each call the parent sends on the engine, by name; rank 0 replies (every rank has the same answer).

    A user error (bad input found here, a save that cannot write) raised before the call's first collective is
    replied and the rank serves on: every rank meets it at the same point, so they stay in step. Anything else,
    a user error's type raised after a collective included, ends the process (`worker_main`)."""
    rank = engine.rank
    heartbeat = Heartbeat(conn)
    while True:
        heartbeat.req = None  # idle between requests: nothing to say, and nobody reading
        msg = conn.recv()
        if msg[0] == "cancel":
            continue  # for a request that ended before the cancel arrived
        req, streams, op, *args = msg
        heartbeat.req = req
        if op == "close":
            conn.send(("ok", req, None))
            return
        every_rank = op == "each"  # inspection: every rank's own answer, to check that they agree
        if every_rank:
            op, *args = args
        call = FAULTS.get(op) or (getattr(engine, op) if op in ENGINE_CALLS else None)
        if call is None:
            raise ValueError(f"unknown request {op!r}")
        entered = engine.dist.collectives
        try:
            result = call(engine, *args) if op in FAULTS else call(*args, **_request_hooks(op, req, rank, conn,
                                                                                          streams))
        except USER_ERRORS as e:
            line = first_line(e)
            if engine.dist.collectives != entered and not getattr(e, "agreed_by_all_ranks", False):
                # the other ranks may be waiting in a collective this rank will not enter
                raise RuntimeError(f"{type(e).__name__} after the call's first collective: {line}") from e
            conn.send(("error", req, "user", type(e).__name__, line, ""))
            continue
        if getattr(result, "cancelled", False):
            conn.send(("cancelled", req))
        else:
            conn.send(("ok", req, result if rank == 0 or every_rank else None))


def _fail(engine: ShardedEngine, failing: int, kind: str = "RuntimeError") -> None:
    """Fault injection for tests. RuntimeError: rank `failing` raises while the others wait in a barrier.
    ValueError: every rank enters a barrier, then rank `failing` raises a user error's type, which after a
    collective ends the model."""
    if kind == "RuntimeError" and engine.rank == failing:
        raise RuntimeError(f"injected failure on rank {failing}")
    engine.dist.barrier()
    if kind == "ValueError" and engine.rank == failing:
        raise ValueError(f"injected after a collective on rank {failing}")


def _skew_routers(engine: ShardedEngine, skewed: int) -> None:
    """Fault injection for tests: rank `skewed`'s routers favour its last expert, as a rank whose kernels or
    inputs differ would route otherwise."""
    if engine.rank == skewed:
        for block in engine.model.layers.values():
            gate = block.feed_forward.gate
            if gate is not None and gate.weight is not None:
                gate.weight.data[-1] += 0.5 * gate.weight.data.abs().max()


FAULTS = {"fail": _fail, "skew_routers": _skew_routers}


def _request_hooks(op: str, req: int, rank: int, conn, streams: bool) -> dict:
    """For generate: every rank can see a cancel waiting on its pipe (the head's rank decides, and its decision
    reaches the others with the next tokens), and rank 0 sends each token up if the caller `streams`. Otherwise
    the tokens come only with the result: each message wakes the user's process, which shares the ranks' cores,
    and costs a 2-rank step 0.1-0.2 ms."""
    if op != "generate":
        return {}
    hooks = {"should_stop": conn.poll}
    if rank == 0 and streams:
        hooks["on_token"] = lambda b, t: conn.send(("token", req, b, t))
    return hooks
