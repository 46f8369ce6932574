"""Start rank processes by forking a server that imported torch once (Linux).

Why: a fresh interpreter spends about 2 s of CPU importing torch before it can be a rank; N ranks pay it N times,
and on a machine with fewer cores than ranks they pay it one after another, at every model load. The fork server
is a clean interpreter (no user code, no CUDA, no OpenMP pool, one Python thread) that imports what a rank
imports, then forks one child per rank on request: the child starts in milliseconds, modules loaded. This is
Python's `forkserver` start method and Android's zygote; not `multiprocessing`'s own, which preloads the user's
`__main__` (see `moe.workers.spawn`).

A server serves one environment: imported modules read variables at import, so a rank started with another
environment gets a server of its own. Each request hands over the rank's pipe, this process's stdout and stderr,
its working directory and environment, so the child starts where a freshly started rank would. The server reaps
its children and writes each one's exit status to a pipe the child's `ForkedRank` reads, so it polls and waits as
a `Popen` does. The server ends with this process (its socket closes) once its ranks are gone.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import wait

MAX_SERVERS = 4  # one per environment seen; the oldest idle ones are closed beyond this
# Variables that change between loads of one process and that nothing reads at import: a server serves any value
# (the rank gets the caller's own). pytest names the running test in one.
READ_LATER = frozenset({"PYTEST_CURRENT_TEST"})


def available() -> bool:
    """Linux: `fork`, descriptors passed over a Unix socket, a child that dies with its parent, pidfds."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


class ForkedRank:
    """A rank forked by the server, seen as a `Popen`: `pid`, `returncode`, `poll`, `wait`, signals."""

    def __init__(self, pid: int, status_fd: int, pidfd: int | None) -> None:
        self.pid, self.returncode, self._status, self._pidfd = pid, None, status_fd, pidfd

    def poll(self) -> int | None:
        if self.returncode is None and wait([self._status], timeout=0):
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not wait([self._status], timeout=timeout):
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        data = os.read(self._status, 8)
        self._close()
        # Nothing written: the server died first, and its children with it (SIGKILL, `moe.workers.entry`).
        self.returncode = os.waitstatus_to_exitcode(int(data)) if data else -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        """Through the process's pidfd: the server reaps our rank, so its pid may already name another process
        (a kernel before Linux 5.3 has no pidfds: by pid there)."""
        if self.poll() is None:
            try:
                if self._pidfd is None:
                    os.kill(self.pid, sig)
                else:
                    signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close(self) -> None:
        for fd in (self._status, self._pidfd):
            if fd is not None:
                os.close(fd)
        self._status = self._pidfd = None

    def __del__(self) -> None:
        if self._status is not None:
            self._close()


class _Server:
    """Our end of one fork server: a Unix socket whose messages are fork requests and their pids."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-m", "moe.workers.forkserver", str(os.getpid()), str(theirs.fileno())]
        try:
            self.proc = subprocess.Popen(cmd, env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours

    def fork(self, name: str, conn_fd: int, env: dict[str, str]) -> ForkedRank:
        status_r, status_w = os.pipe()
        try:
            socket.send_fds(self.sock, [pickle.dumps((name, _cwd(), env))], [conn_fd, status_w, 1, 2])
            reply, pidfd, _, _ = socket.recv_fds(self.sock, 64, 1)
        except OSError:
            reply = b""
        finally:
            os.close(status_w)
        if not reply:
            os.close(status_r)
            code = self.proc.poll()
            raise ConnectionError("the rank fork server " + ("is gone" if code is None else f"exited ({code})"))
        return ForkedRank(int(reply), status_r, pidfd[0] if pidfd else None)

    def close(self, wait_s: float = 0.0) -> None:
        self.sock.close()  # the server leaves once its ranks have
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass  # ranks still running: it is reaped later, by `subprocess` or at our exit


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except FileNotFoundError:  # removed meanwhile: the child keeps the server's, as a `Popen` child would its own
        return None


_servers: dict[tuple, _Server] = {}
_lock = threading.Lock()  # groups may start from several threads


@atexit.register
def _close_all() -> None:
    """At exit (models closed by then: their handlers were registered later, so run first), let every server go."""
    while _servers:
        _servers.popitem()[1].close(wait_s=5.0)


def _forget_after_fork() -> None:
    """In a child forked from this process (`os.fork`, a `fork` start method): the servers are the parent's. Requests
    of two processes on one socket would mix with their replies, so the child closes its copies (the parent's exit
    still ends the servers) and starts servers of its own if it loads a model."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for server in _servers.values():
        server.sock.close()
    _servers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def fork_rank(name: str, conn_fd: int, env: dict[str, str]) -> ForkedRank:
    """A rank process named `name` running `moe.workers.entry` on the pipe `conn_fd`, environment `env`."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in READ_LATER))
    with _lock:
        try:
            return _server_for(key, env).fork(name, conn_fd, env)
        except ConnectionError:  # killed meanwhile: one fresh server, once
            _servers.pop(key).close()
            return _server_for(key, env).fork(name, conn_fd, env)


def _server_for(key: tuple, env: dict[str, str]) -> _Server:
    """The server of this environment, started if there is none; the newest used last, the oldest let go first."""
    server = _servers.pop(key, None) or _Server(env)
    _servers[key] = server
    while len(_servers) > MAX_SERVERS:
        _servers.pop(next(iter(_servers))).close()
    return server


# ---- in the server process ----

def _reap(status: dict[int, int]) -> None:
    """Collect every child that has ended and hand its wait status to its `ForkedRank`."""
    while status:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, str(code).encode())
            except OSError:  # nobody reads it any more (the caller let go of its `ForkedRank`)
                pass
            os.close(fd)


def _child(request: bytes, fds: list[int], servers_fds: list[int]) -> None:
    """In a forked child: take the parent's stdout, stderr and directory, then run as `moe.workers.entry` does."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in servers_fds:
        os.close(fd)
    conn_fd, status_w, out, err = fds
    os.close(status_w)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    name, cwd, env = pickle.loads(request)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    from moe.workers.entry import run

    run(conn_fd, os.getppid(), name)


def serve(parent_pid: int, sock: socket.socket) -> None:
    """Fork a rank per request until the parent closes its end (then stay until the ranks are gone) or dies."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD interrupts the wait below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, int] = {}  # a running child's pid -> the pipe its exit status goes to
    accepting = True
    while accepting or status:
        ready = wait([sock, wake_r] if accepting else [wake_r], timeout=1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(status)
        if os.getppid() != parent_pid:
            return  # the parent died: our children die with us
        if sock not in ready:
            continue
        try:
            request, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        except OSError:
            request, fds = b"", []
        if not request:
            accepting = False
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _child(request, fds, [sock.fileno(), wake_r, wake_w, *status.values()])
            finally:  # never back into this loop: the child of a server is a rank or nothing
                traceback.print_exc()
                os._exit(1)
        status[pid] = fds[1]
        for fd in (fds[0], fds[2], fds[3]):
            os.close(fd)
        try:
            pidfd = [os.pidfd_open(pid)]
        except OSError:  # before Linux 5.3
            pidfd = []
        try:
            socket.send_fds(sock, [str(pid).encode()], pidfd)
        except OSError:  # the parent is gone mid-request
            accepting = False
        for fd in pidfd:
            os.close(fd)


def main(argv: list[str]) -> None:
    """Not `die_with_parent`: the kernel's parent-death signal follows the thread that started us, and a server
    outlives the thread that asked for it first. `serve` sees the parent's death (EOF, then `getppid`) instead."""
    parent_pid, fd = int(argv[0]), int(argv[1])
    from moe.host import name_this_thread

    name_this_thread("moe-forkserver")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a rank: Ctrl-C is the parent's to act on
    import moe.workers.group  # noqa: F401  what every rank imports, once
    import moe.workers.rank  # noqa: F401

    serve(parent_pid, socket.socket(fileno=fd))
    os._exit(0)  # no interpreter teardown: nothing of ours is left to flush, and torch's would only take time


if __name__ == "__main__":
    main(sys.argv[1:])
