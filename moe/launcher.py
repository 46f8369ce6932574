"""Start N ranks as local processes, talk to them over pipes, and stop them all if any fails.

Failure handling (invariant 4): the parent watches every rank's pipe and process sentinel. The first
error report or unexpected exit stops the others at once (SIGTERM, then SIGKILL), and the parent
raises an error naming the rank and the cause. Workers also die with the parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from models.config import ConfigError
from moe.checkpoint.files import CheckpointError
from moe.distributed import check_port_free, free_port
from moe.placement import PlacementError
from moe.worker import ShardSpec, worker_main

_USER_ERROR_TYPES = {c.__name__: c for c in (CheckpointError, PlacementError, ConfigError, ValueError)}


class RankFailure(RuntimeError):
    """A rank died or raised; the message names the rank and the cause, `detail` holds its traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world_size)


class WorkerGroup:
    def __init__(self, world_size: int, spec: ShardSpec, master_port: int | None = None,
                 threads: int | None = None) -> None:
        if master_port is not None:
            check_port_free(master_port)
        port = master_port or free_port()
        threads = threads or cpu_threads_per_rank(world_size)
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.closed = [], [], False
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, world_size, port, threads, child, spec),
                               name=f"moe-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        atexit.register(self.close)
        self.ready = self._collect()  # each rank's load report

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, *request, on_token: Callable[[int, int], None] | None = None) -> list:
        """Send the same request to every rank; return each rank's reply."""
        if self.closed:
            raise RuntimeError("the worker processes were closed")
        for conn in self.conns:
            conn.send(request)
        return self._collect(on_token)

    def _collect(self, on_token=None) -> list:
        replies: dict[int, object] = {}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        conns = {id(c): r for r, c in enumerate(self.conns)}
        while len(replies) < len(self.procs):
            pending = [r for r in range(len(self.procs)) if r not in replies]
            watched = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            for ready in wait(watched, timeout=5):
                if ready in sentinels:
                    rank = sentinels[ready]
                    if rank not in replies and not self.conns[rank].poll():
                        self._fail(rank, self._exit_cause(rank))
                    continue
                rank = conns[id(ready)]
                try:
                    msg = ready.recv()
                except (EOFError, OSError):
                    self._fail(rank, self._exit_cause(rank))
                if msg[0] == "token":
                    if on_token is not None:
                        on_token(msg[1], msg[2])
                elif msg[0] == "ok":
                    replies[rank] = msg[1]
                else:
                    _, kind, name, text, detail = msg
                    if kind == "user" and name in _USER_ERROR_TYPES:
                        self.close(force=True)
                        raise _USER_ERROR_TYPES[name](f"rank {rank}: {text}")
                    self._fail(*self._root_cause(rank, f"raised {name}: {text}"), detail)
        return [replies[r] for r in range(len(self.procs))]

    def _exit_cause(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=2)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"died (killed by signal {-code}, {signal.Signals(-code).name})"
        return f"exited unexpectedly (exit code {code})"

    def _root_cause(self, rank: int, cause: str) -> tuple[int, str]:
        """A rank whose peer was killed raises a transport error; blame the killed peer when there is one."""
        others = [p for r, p in enumerate(self.procs) if r != rank]
        wait([p.sentinel for p in others], timeout=1.0)
        for r, p in enumerate(self.procs):
            if r != rank and p.exitcode is not None and p.exitcode < 0:
                return r, self._exit_cause(r)
        return rank, cause

    def _fail(self, rank: int, cause: str, detail: str = "") -> None:
        self.close(force=True)
        raise RankFailure(f"rank {rank} {cause}; stopped all {len(self.procs)} ranks", detail)

    def close(self, force: bool = False) -> None:
        """Stop every rank: politely when healthy, by signal otherwise. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if not force:
            try:
                for conn in self.conns:
                    conn.send(("close",))
                deadline = time.monotonic() + 10
                for p in self.procs:
                    p.join(timeout=max(0.1, deadline - time.monotonic()))
            except (OSError, EOFError):
                pass
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        atexit.unregister(self.close)


def run_ranks(target: Callable, world_size: int, *args, master_port: int | None = None) -> None:
    """Run target(rank, world_size, port, *args) in N processes until all return; if one fails, stop all.

    For batch jobs (training) that need no requests from the parent; each rank prints its own traceback.
    """
    if master_port is not None:
        check_port_free(master_port)
    port = master_port or free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, world_size, port, *args), name=f"moe-rank{rank}", daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        running = {p.sentinel: r for r, p in enumerate(procs)}
        while running:
            for sentinel in wait(list(running)):
                rank = running.pop(sentinel)
                procs[rank].join()
                code = procs[rank].exitcode
                if code != 0:
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    raise RankFailure(f"rank {rank} failed ({how}); stopped all {world_size} ranks")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
