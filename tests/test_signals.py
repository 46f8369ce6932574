"""Ctrl-C ends a command within seconds with one line and status 130, leaving no process behind; the model
that a library user interrupted stays usable (tests/test_requests.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from models.kernels import native
from tests.checkpoints import ROOT, TRAINED
from tests.waiting import wait_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [g for k in kids for g in descendants(k)]


def blocked_on(pid: int) -> str:
    """The system call a process waits in (Linux: number, then arguments; a write's first is its fd) and where its
    fds 0-2 lead, to tell which pipe a stuck process writes to."""
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
        fds = {n: os.readlink(f"/proc/{pid}/fd/{n}") for n in range(3)}
    except OSError as exc:
        return f"{pid}: {exc}\n"
    return f"{pid}: syscall {call[:3]}, fds {fds}\n"


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_sigint_mid_generation_ends_with_one_line_and_status_130(gpus, tmp_path):
    native.available()  # built here if this is their first use: the command's stderr is then only its own
    prompts = tmp_path / "prompts.txt"  # a batch, so that generating takes a while
    prompts.write_text("\n".join(f"Chapter {i}. It is a truth universally acknowledged" for i in range(48)))
    # Ctrl-C reaches the command as from a terminal: a shell starts a background job (`.ci/run ... &`) with SIGINT
    # ignored, every process it starts inherits that, and Python then never turns SIGINT into KeyboardInterrupt (the
    # command ran to the end, and blocked writing its completions to an unread pipe).
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED),
                             "--gpus", gpus, "--prompt-file", str(prompts), "--max-new-tokens", "100000", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    errors: list[str] = []  # stderr read as it comes: a full pipe would block the command, not the test
    reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
    reader.start()
    while not proc.stdout.readline().startswith("settings:"):  # generation starts
        assert proc.poll() is None, "".join(errors)
    # stdout drained too, as a terminal drains it: a command blocked writing to a full pipe could not end.
    printed: list[str] = []
    threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True).start()
    ranks = descendants(proc.pid)
    assert proc.poll() is None and len(ranks) >= int(gpus) - 1  # generating, its ranks up (1 rank: in-process)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pids = ",".join(map(str, [proc.pid, *ranks]))
        stuck = subprocess.run(["ps", "-o", "pid,stat,wchan:20,etime,args", "-p", pids], capture_output=True,
                               text=True).stdout + "".join(blocked_on(p) for p in [proc.pid, *ranks])
        proc.kill()
        pytest.fail(f"no exit 30 s after Ctrl-C; stderr so far: {''.join(errors)[-2000:]!r}; processes:\n{stuck}")
    reader.join(timeout=10)
    err = "".join(errors)
    *said, last = err.splitlines()
    assert code == 130 and last == "interrupted", err
    assert all(line.startswith("cpu kernels: ") for line in said), err  # the kernels line at load, nothing else
    wait_gone(ranks)


def test_prompts_from_standard_input_and_a_non_utf8_prompt_file(tmp_path):
    run = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED), "--max-new-tokens", "2"]
    piped = subprocess.run([*run, "--prompt-file", "-"], input="And God said\n\nIn the beginning\n",
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "[1] In the beginning" in piped.stdout, piped.stderr
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Caf\xe9 au lait\n".encode("latin-1"))
    bad = subprocess.run([*run, "--prompt-file", str(latin)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr == f"error: --prompt-file {latin}: not UTF-8 text (byte 3); convert " \
                                                 "it, e.g. iconv -t UTF-8\n"


@pytest.mark.parametrize("flags,message", [
    (["--threads", "-1"], "--threads -1: must be between 1 and 4096"),
    (["--master-port", "70000", "--gpus", "2"], "--master-port 70000: must be between 1 and 65535"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be between 1 and 10000000"),
    (["--gpus", "1000"], "--gpus 1000: this machine runs at most"),
    (["--device", "cuda"], "device='cuda' but no CUDA device is visible; use --device cpu (device='cpu')"),
])
def test_bad_flags_are_one_line_with_status_2(flags, message):
    """Before the checkpoint is read: no load line, no table, no traceback."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED),
                           "--prompt", "x", *flags], capture_output=True, text=True, timeout=120)
    if flags[1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_config_value_of_the_wrong_type_is_one_line(tmp_path):
    import json
    import shutil

    shutil.copytree(TRAINED, tmp_path / "eps")
    cfg = json.loads((tmp_path / "eps" / "config.json").read_text())
    (tmp_path / "eps" / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": "abc"}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(tmp_path / "eps"),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {tmp_path / 'eps' / 'config.json'}: config field norm_eps must be a positive " \
                          "number, got 'abc'\n"
