"""Start N ranks as local processes, talk to them over pipes, and stop them all if any fails.

Failure handling (invariant "no hangs"): the parent watches every rank's pipe; a rank's death closes it.
The first error report or unexpected exit stops the others at once (SIGTERM, then SIGKILL), and the parent
raises an error naming the rank and the cause. Ranks also die with the parent (`moe.workers.entry`).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from moe.errors import USER_ERRORS, RankFailure, first_line
from moe.host import rank_processes_refusal, usable_cores
from moe.parallel.distributed import check_port_free, free_port
from moe.workers.spawn import RankProcess, start_rank

_USER_ERROR_TYPES = {c.__name__: c for c in USER_ERRORS}
READY = 0  # the id of the load reports every rank sends once it holds its share
FROZEN_AFTER_S = 10.0  # a rank busy with a request beats every 2 s (moe.workers.rank.Heartbeat)
CANCEL_WAIT_S = 60.0  # a cancelled request not wound down by then means a rank is stuck: stop them all


def cpu_threads_per_rank(world_size: int) -> int:
    return max(1, usable_cores() // world_size)


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
        refusal = rank_processes_refusal(world_size)
        if refusal is not None:
            raise ValueError(refusal)
        if master_port is not None:
            check_port_free(master_port)
        port = master_port or free_port()
        threads = threads or cpu_threads_per_rank(world_size)
        self.closed, self.closed_reason = False, ""
        self.owner = os.getpid()  # a process forked from this one inherits the pipes, not the ranks
        self.next_id = READY
        self.ranks: list[RankProcess] = []
        atexit.register(self.close)
        try:
            for rank in range(world_size):
                args = (rank, world_size, port, threads, spec)
                self.ranks.append(start_rank(rank, "moe.workers.rank:worker_main", args, threads))
        except BaseException:
            self.close(force=True)
            raise
        try:
            self.ready, _ = self._collect(READY)  # each rank's load report; any error here stops them all
        except BaseException as e:
            self.close(force=True, reason=f"loading failed: {e}")
            raise

    @property
    def pids(self) -> list[int]:
        return [rp.pid for rp in self.ranks]

    def call(self, *request, on_token: Callable[[int, int], None] | None = None) -> list:
        """Send the same request to every rank; return each rank's reply. The ranks send tokens as they come only
        when `on_token` is given (`moe.workers.rank._request_hooks` says why).

        A request is a transaction: replies carry its id (a late reply of an earlier request is dropped), and
        if the caller's side fails meanwhile (a streamer raises, Ctrl-C) the request is cancelled on every rank
        before the exception goes on, so the next call gets its own answer."""
        if os.getpid() != self.owner:  # its requests would mix with the owner's on the same pipes
            raise RankFailure(f"this model's ranks belong to process {self.owner}, which loaded it; this process was "
                              "forked from it: load the model again here")
        if self.closed:
            raise RankFailure(f"this model's ranks were closed ({self.closed_reason}); load it again")
        self.next_id += 1
        req = self.next_id
        for rp in self.ranks:
            try:
                rp.conn.send((req, on_token is not None, *request))
            except OSError:  # it died while idle: name it as a death mid-request is named
                self._fail(*self._root_cause(rp.rank, _exit_cause(rp)))
        try:
            replies, errors = self._collect(req, on_token)
        except BaseException:
            if not self.closed:
                self._cancel(req)
            raise
        if errors:  # every rank has answered: the model stays usable
            rank, (name, text) = min(errors.items())
            raise _USER_ERROR_TYPES.get(name, ValueError)(f"rank {rank}: {text}" if len(self.ranks) > 1 else text)
        return replies

    def _cancel(self, req: int) -> None:
        """Ask every rank to drop request `req` and wait until each has; if that fails too, stop them all."""
        try:
            for rp in self.ranks:
                rp.conn.send(("cancel", req))
            self._collect(req, None, give_up_after=CANCEL_WAIT_S)
        except BaseException:
            self.close(force=True, reason="an interrupted request could not be cancelled")

    def _collect(self, req: int, on_token=None,
                 give_up_after: float | None = None) -> tuple[list, dict[int, tuple[str, str]]]:
        """Every rank's final answer to `req`: (results, or None where cancelled; user errors by rank). A rank
        that does not follow another's user error within seconds fails the group, as does waiting past
        `give_up_after` seconds."""
        give_up = time.monotonic() + give_up_after if give_up_after is not None else None
        replies: dict[int, object] = {}
        errors: dict[int, tuple[str, str]] = {}
        by_conn = {id(rp.conn): rp for rp in self.ranks}
        deadline = None
        heard = {rp.rank: time.monotonic() for rp in self.ranks}  # last message from each rank
        while len(replies) + len(errors) < len(self.ranks):
            if give_up is not None and time.monotonic() > give_up:
                raise TimeoutError(f"request {req} was not cancelled within {give_up_after:g} s")
            if deadline is not None and time.monotonic() > deadline:
                rank, (name, text) = min(errors.items())
                self._fail(rank, f"raised {name}: {text}, and the other ranks did not follow")
            pending = [rp for rp in self.ranks if rp.rank not in replies and rp.rank not in errors]
            silent = [rp.rank for rp in pending if time.monotonic() - heard[rp.rank] > FROZEN_AFTER_S]
            if silent and req != READY:  # loading has no heartbeat yet; a dead loader closes its pipe
                self._fail(silent[0], f"stopped responding (no heartbeat for {FROZEN_AFTER_S:g} s: stopped or frozen)")
            for conn in wait([rp.conn for rp in self.ranks], timeout=1):
                rp = by_conn[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(*self._root_cause(rp.rank, _exit_cause(rp)))
                kind, msg_req, *rest = msg
                heard[rp.rank] = time.monotonic()
                if kind == "alive":
                    continue
                if kind == "error" and rest[0] != "user":  # a rank failed, whatever it was doing
                    _, name, text, detail = rest
                    self._fail(*self._root_cause(rp.rank, f"raised {name}: {text}"), detail)
                if msg_req != req:
                    continue  # a late reply to a request that was cancelled
                if kind == "token":
                    if on_token is not None:
                        on_token(*rest)
                elif kind in ("ok", "cancelled"):
                    replies[rp.rank] = rest[0] if kind == "ok" else None
                else:  # a user error
                    if req == READY:  # this rank could not load its share: nothing is left to keep
                        self.close(force=True, reason=f"rank {rp.rank}: {rest[2]}")
                        raise _USER_ERROR_TYPES.get(rest[1], ValueError)(f"rank {rp.rank}: {rest[2]}")
                    errors[rp.rank] = (rest[1], rest[2])
                    deadline = deadline or time.monotonic() + 10
        return [replies.get(r) for r in range(len(self.ranks))], errors

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
        message = f"rank {rank} {cause}; stopped all {len(self.ranks)} ranks"
        self.close(force=True, reason=message)
        raise RankFailure(message, detail)

    def close(self, force: bool = False, reason: str = "close() was called") -> None:
        """Stop every rank: politely when healthy, by signal otherwise. Safe to call twice."""
        if self.closed:
            return
        self.closed, self.closed_reason = True, reason
        atexit.unregister(self.close)
        if os.getpid() != self.owner:
            return  # a forked copy of the model going away (at its exit): the ranks are its parent's
        if not force:
            try:
                for rp in self.ranks:
                    rp.conn.send((0, False, "close"))
                deadline = time.monotonic() + 10
                for rp in self.ranks:
                    rp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        _stop(self.ranks)


def _last_word(conn) -> tuple | None:
    """What a batch rank sent before its pipe closed (a user error), if anything."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def batch_rank(conn, target: str, rank: int, world_size: int, port: int, *args) -> None:
    """In a rank process: run a batch job's `target(rank, world_size, port, *args)`; exit 0 only if it returned.
    A user error (bad input every rank finds alike) goes to the launcher as one line, for it to raise, not as a
    traceback on the rank's stderr."""
    from moe.workers.entry import resolve

    try:
        resolve(target)(rank, world_size, port, *args)
    except USER_ERRORS as e:
        conn.send(("error", type(e).__name__, first_line(e)))
        sys.stderr.flush()
        os._exit(2)


def run_ranks(target: Callable, world_size: int, *args, master_port: int | None = None, threads: int | None = None,
              stop_through_rank0: bool = False) -> None:
    """Run target(rank, world_size, port, *args) in N processes until all return; if one fails, stop all.

    For jobs that need no requests from the parent; each rank prints its own traceback. `target` must be importable
    by name (a module-level function of a module, not of `__main__`). `threads`: each rank's thread pool.
    `stop_through_rank0`: SIGTERM or Ctrl-C here is passed to rank 0 as SIGTERM, for jobs whose rank 0 stops the
    others in order (the server drains), instead of ending the wait here.
    """
    refusal = rank_processes_refusal(world_size)
    if refusal is not None:
        raise ValueError(refusal)
    if target.__module__ == "__main__":
        raise ValueError(f"{target.__qualname__} is defined in __main__; rank processes import their target by "
                         "name, so define it in a module")
    if master_port is not None:
        check_port_free(master_port)
    port = master_port or free_port()
    name = f"{target.__module__}:{target.__qualname__}"
    ranks: list[RankProcess] = []
    saved = {}
    try:
        for rank in range(world_size):
            ranks.append(start_rank(rank, "moe.workers.group:batch_rank", (name, rank, world_size, port, *args),
                                    threads))
        if stop_through_rank0:
            def to_rank0(*_) -> None:
                if ranks[0].proc.poll() is None:
                    ranks[0].proc.send_signal(signal.SIGTERM)

            saved = {sig: signal.signal(sig, to_rank0) for sig in (signal.SIGTERM, signal.SIGINT)}
        running = {id(rp.conn): rp for rp in ranks}  # a rank's pipe closes when its process ends
        while running:
            for conn in wait([rp.conn for rp in running.values()]):
                rp = running.pop(id(conn))
                said, code = _last_word(conn), rp.proc.wait()
                if said is not None and said[0] == "error":  # a user error: its own type and line
                    raise _USER_ERROR_TYPES.get(said[1], ValueError)(said[2])
                if code != 0:
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    raise RankFailure(f"rank {rp.rank} failed ({how}); stopped all {world_size} ranks")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        _stop(ranks)
