"""Start one rank as a fresh Python interpreter running `moe.workers.entry`, joined to us by a socket pair.

Why not `multiprocessing`'s spawn: it re-imports the user's `__main__`, so a plain script, `python -c` or a
notebook without an `if __name__ == "__main__":` guard would run again in every rank. A fresh interpreter
running the project's own entry point (as torchrun and vLLM start their workers) imports only the package; on
Linux that interpreter is the fork server's copy, forked with torch already imported.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from moe.workers import forkserver
from moe.workers.forkserver import ForkedRank

FORK = True  # ranks forked from a server that imported torch once, where the system allows (`moe.workers.forkserver`)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `moe/` and `models/`


class Channel:
    """One end of the pipe to or from a rank: whole messages, pickled by value.

    Plain pickle, not `Connection.send`: multiprocessing's pickler hands tensors over as shared-memory file
    descriptors, which needs a common authentication key (a separate interpreter has its own) and leaves
    `/tmp/pymp-*` directories behind.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # a rank's heartbeat thread sends beside its main thread

    def send(self, obj: object) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self) -> object:
        return pickle.loads(self.conn.recv_bytes())

    def fileno(self) -> int:  # for multiprocessing.connection.wait
        return self.conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen | ForkedRank
    conn: Channel  # our end; EOF on it means the rank's process is gone

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_rank(rank: int, target: str, args: tuple, threads: int | None = None) -> RankProcess:
    """Run `target` ("package.module:function") as `function(conn, *args)` in a new interpreter."""
    ours, theirs = Pipe(duplex=True)
    env = dict(os.environ)
    # The child imports the very code this process runs, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # before torch is imported there, so no pool is oversized
    try:
        if FORK and forkserver.available():
            proc = forkserver.fork_rank(f"rank{rank}", theirs.fileno(), env)
        else:
            cmd = [sys.executable, "-m", "moe.workers.entry", str(theirs.fileno()), str(os.getpid()), f"rank{rank}"]
            proc = subprocess.Popen(cmd, env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    finally:
        theirs.close()  # only the child holds its end now, so its death closes the pipe
    channel = Channel(ours)
    channel.send((target, args))
    return RankProcess(rank, proc, channel)
