"""Progress on long work: a bar on a terminal, plain milestone lines in a log, nothing with --quiet."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

from moe.progress import Progress
from tests.checkpoints import ROOT, TRAINED


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_with_notes_above_it():
    out = Terminal()
    with Progress("loading", unit="B", stream=out, prefix="rank 0: ") as shown:
        shown.start(2048)
        shown.update(1024)
        shown.note("loaded a.safetensors")
        shown.update(1024)
    text = out.getvalue()
    assert "loading" in text and "100%" in text and "2.00k/2.00k" in text
    assert "rank 0: loaded a.safetensors\n" in text


def test_lines_only_when_not_a_terminal_and_nothing_when_disabled():
    log = io.StringIO()
    with Progress("loading", stream=log) as shown:
        shown.start(3)
        shown.update(3)
        shown.note("loaded a.safetensors")
    assert log.getvalue() == "loaded a.safetensors\n"
    quiet = io.StringIO()
    with Progress("loading", stream=quiet, enabled=False) as shown:
        shown.start(3)
        shown.update(3)
        shown.note("loaded a.safetensors")
    assert quiet.getvalue() == ""


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED),
                           "--prompt", "And God said", "--max-new-tokens", "2", *args],
                          capture_output=True, text=True, timeout=120)


def test_quiet_drops_the_load_lines_but_not_the_text():
    loud, quiet = generate(), generate("--quiet")
    assert "rank 0: loaded" in loud.stderr
    assert quiet.returncode == 0 and "loaded" not in quiet.stderr and "And God said" in quiet.stdout


def test_loading_bar_when_standard_error_is_a_terminal():
    """stderr on a pseudo-terminal: tqdm draws the byte counter of the checkpoint being read."""
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED),
                           "--prompt", "And God said", "--max-new-tokens", "2"],
                          stdout=subprocess.PIPE, stderr=child, text=True, timeout=120)
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(parent)
    assert proc.returncode == 0
    assert b"loading" in seen and b"100%" in seen and b"rank 0: loaded" in seen
