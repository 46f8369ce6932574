"""A real server process for tests: `scripts/serve.py` on a free port, up once /health says 200."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx

from moe.host import process_tree
from moe.parallel.distributed import free_port
from tests.checkpoints import ROOT
from tests.waiting import wait_until


class Server:
    def __init__(self, ckpt, *args: str, compiled: bool = False) -> None:
        """`compiled`: the server's default, compiled decode steps built at start-up (tests/test_serve_compiled.py);
        otherwise `--no-compile`, so that each server does not first build a step for every batch size."""
        port = free_port()
        self.start([str(ROOT / "scripts" / "serve.py"), "--ckpt", str(ckpt), "--port", str(port), *args,
                    *([] if compiled else ["--no-compile"])], port)

    @classmethod
    def of_command(cls, argv: list[str], port: int, cwd=None) -> Server:
        """A server started by `python argv...` (a command as a page writes it), listening on `port`."""
        server = cls.__new__(cls)
        server.start(argv, port, cwd)
        return server

    def start(self, argv: list[str], port: int, cwd=None) -> None:
        self.port, self.said = port, ""
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        wait_until(self.healthy, 240, f"the server on port {self.port} to answer /health with 200")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120, **kw)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.stderr.closed:  # stopped before
            return self.proc.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in process_tree(self.proc.pid):  # each process's threads' stacks to stderr (`moe.host`)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)  # a failure's path only: the stacks written
            self.proc.kill()
            raise AssertionError(f"the server did not stop within {timeout:.0f} s of SIGTERM; it said: "
                                 f"{written(self.proc.stderr)[-6000:]}") from None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.said += written(self.proc.stderr)  # what it wrote to stderr, for the test to read
            self.proc.stdout.close()
            self.proc.stderr.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def written(pipe) -> str:
    """What a pipe holds now, without waiting for its end (rank processes left behind may hold it open)."""
    os.set_blocking(pipe.fileno(), False)
    chunks = []
    while True:
        try:
            chunk = os.read(pipe.fileno(), 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
