"""The first code a rank process runs: `python -m moe.workers.entry FD PARENT_PID NAME`, or `run` in a child of
the fork server (`moe.workers.forkserver`).

It binds its life to the parent's, reads `(target, args)` from the pipe on FD, and calls the target.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from moe.host import name_this_thread
from moe.workers.spawn import Channel


def die_with_parent(parent_pid: int) -> None:
    """No rank outlives the process that started it. Linux: the kernel sends SIGKILL when the parent dies.
    Elsewhere a thread looks every second whether the parent is still this process's parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="orphan-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def resolve(target: str):
    module, _, name = target.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str]) -> None:
    run(int(argv[0]), int(argv[1]), argv[2])


def run(fd: int, parent_pid: int, name: str) -> None:
    """Be rank `name` (as `ps` shows it) for the parent on pipe `fd`, and exit when its work ends."""
    die_with_parent(parent_pid)
    name_this_thread(f"moe-{name}")
    # Ctrl-C in a terminal reaches the whole process group; the parent decides what stops, not each rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Channel(Connection(fd))
    target, args = conn.recv()
    try:
        resolve(target)(conn, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    else:
        code = 0
    # Leave without the interpreter's teardown: torch's and gloo's threads may still be winding down, and
    # tearing the runtime down under them can abort the process ("terminate called without an active
    # exception") after its work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
