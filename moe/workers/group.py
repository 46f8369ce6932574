"""Start N ranks as local processes, talk to them over pipes, and stop them all if any fails.

Failure handling (invariant "no hangs"): the parent watches every rank's pipe; a rank's death closes it.
The first error report or unexpected exit stops the others at once (SIGTERM, then SIGKILL), and the parent
raises an error naming the rank and the cause. Ranks also die with the parent (`moe.workers.entry`).
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from moe.errors import USER_ERRORS, RankFailure
from moe.parallel.distributed import check_port_free, free_port
from moe.workers.spawn import RankProcess, start_rank

_USER_ERROR_TYPES = {c.__name__: c for c in USER_ERRORS}


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def _exit_cause(rp: RankProcess) -> str:
    try:
        code = rp.proc.wait(timeout=2)
    except Exception:  # still running (it closed its pipe without exiting): report as such
        code = None
    if code is not None and code < 0:
        return f"died (killed by signal {-code}, {signal.Signals(-code).name})"
    return f"exited unexpectedly (exit code {code})"


def _stop(ranks: list[RankProcess], grace: float = 5.0) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after `grace` seconds."""
    for rp in ranks:
        if rp.proc.poll() is None:
            rp.proc.terminate()
    deadline = time.monotonic() + grace
    for rp in ranks:
        try:
            rp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            rp.proc.kill()
            rp.proc.wait()
        rp.conn.close()


class WorkerGroup:
    """N rank processes serving requests (`moe.workers.rank.serve`); `call` sends one to all of them."""

    def __init__(self, world_size: int, spec, master_port: int | None = None, threads: int | None = None) -> None:
        if master_port is not None:
            check_port_free(master_port)
        port = master_port or free_port()
        threads = threads or cpu_threads_per_rank(world_size)
        self.closed = False
        self.ranks: list[RankProcess] = []
        atexit.register(self.close)
        try:
            for rank in range(world_size):
                args = (rank, world_size, port, threads, spec)
                self.ranks.append(start_rank(rank, "moe.workers.rank:worker_main", args, threads))
        except BaseException:
            self.close(force=True)
            raise
        self.ready = self._collect()  # each rank's load report

    @property
    def pids(self) -> list[int]:
        return [rp.pid for rp in self.ranks]

    def call(self, *request, on_token: Callable[[int, int], None] | None = None) -> list:
        """Send the same request to every rank; return each rank's reply."""
        if self.closed:
            raise RuntimeError("the worker processes were closed")
        for rp in self.ranks:
            rp.conn.send(request)
        return self._collect(on_token)

    def _collect(self, on_token=None) -> list:
        replies: dict[int, object] = {}
        by_conn = {id(rp.conn): rp for rp in self.ranks}
        while len(replies) < len(self.ranks):
            pending = [rp.conn for rp in self.ranks if rp.rank not in replies]
            for conn in wait(pending, timeout=5):
                rp = by_conn[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(*self._root_cause(rp.rank, _exit_cause(rp)))
                if msg[0] == "token":
                    if on_token is not None:
                        on_token(msg[1], msg[2])
                elif msg[0] == "ok":
                    replies[rp.rank] = msg[1]
                else:
                    _, kind, name, text, detail = msg
                    if kind == "user" and name in _USER_ERROR_TYPES:
                        self.close(force=True)
                        raise _USER_ERROR_TYPES[name](f"rank {rp.rank}: {text}")
                    self._fail(*self._root_cause(rp.rank, f"raised {name}: {text}"), detail)
        return [replies[r] for r in range(len(self.ranks))]

    def _root_cause(self, rank: int, cause: str) -> tuple[int, str]:
        """A rank whose peer was killed raises a transport error; blame the killed peer when there is one."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rp in self.ranks:
                code = rp.proc.poll()
                if rp.rank != rank and code is not None and code < 0:
                    return rp.rank, _exit_cause(rp)
            time.sleep(0.05)
        return rank, cause

    def _fail(self, rank: int, cause: str, detail: str = "") -> None:
        self.close(force=True)
        raise RankFailure(f"rank {rank} {cause}; stopped all {len(self.ranks)} ranks", detail)

    def close(self, force: bool = False) -> None:
        """Stop every rank: politely when healthy, by signal otherwise. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if not force:
            try:
                for rp in self.ranks:
                    rp.conn.send(("close",))
                deadline = time.monotonic() + 10
                for rp in self.ranks:
                    rp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        _stop(self.ranks)


def batch_rank(conn, target: str, rank: int, world_size: int, port: int, *args) -> None:
    """In a rank process: run a batch job's `target(rank, world_size, port, *args)`; exit 0 only if it returned."""
    from moe.workers.entry import resolve

    resolve(target)(rank, world_size, port, *args)


def run_ranks(target: Callable, world_size: int, *args, master_port: int | None = None) -> None:
    """Run target(rank, world_size, port, *args) in N processes until all return; if one fails, stop all.

    For batch jobs (training) that need no requests from the parent; each rank prints its own traceback.
    `target` must be importable by name (a module-level function of a module, not of `__main__`).
    """
    if target.__module__ == "__main__":
        raise ValueError(f"{target.__qualname__} is defined in __main__; rank processes import their target by "
                         "name, so define it in a module")
    if master_port is not None:
        check_port_free(master_port)
    port = master_port or free_port()
    name = f"{target.__module__}:{target.__qualname__}"
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            ranks.append(start_rank(rank, "moe.workers.group:batch_rank", (name, rank, world_size, port, *args)))
        running = {id(rp.conn): rp for rp in ranks}  # a rank's pipe closes when its process ends
        while running:
            for conn in wait([rp.conn for rp in running.values()]):
                rp = running.pop(id(conn))
                code = rp.proc.wait()
                if code != 0:
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    raise RankFailure(f"rank {rp.rank} failed ({how}); stopped all {world_size} ranks")
    finally:
        _stop(ranks)
