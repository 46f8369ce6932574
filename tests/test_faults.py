"""No hangs (invariant "no hangs"): a rank that dies or raises stops every rank, with a message naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moe import MoEModel
from moe.host import process_tree
from moe.workers.group import RankFailure
from tests.checkpoints import ROOT, SHIPPED
from tests.waiting import alive, wait_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_kill_9_of_one_rank_mid_generation_stops_all():
    model = MoEModel.from_pretrained(SHIPPED, gpus=3)
    pids = model.info.pids
    victim = pids[1]
    killed_at = []

    def kill_on_first_token(b, piece):
        if not killed_at:
            os.kill(victim, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(RankFailure) as e:
        model.generate(["And God said"], max_new_tokens=2000, streamer=kill_on_first_token)
    assert time.monotonic() - killed_at[0] < 30
    assert "rank 1" in str(e.value) and "signal 9" in str(e.value)
    assert not any(alive(p) for p in pids)


def test_a_rank_that_raises_stops_all():
    model = MoEModel.from_pretrained(SHIPPED, gpus=3)
    pids = model.info.pids
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        model.engine.group.call("fail", 2)  # rank 2 raises while ranks 0 and 1 wait in a barrier
    assert time.monotonic() - t0 < 30
    assert "rank 2 raised RuntimeError: injected failure on rank 2" in str(e.value)
    assert not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        model.generate(["x"])


def test_busy_port_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # Found before any rank starts: the call neither waits for the group's timeout nor leaves a process.
        before = set(process_tree(os.getpid()))
        with pytest.raises(ValueError, match=f"{port} is already in use"):
            MoEModel.from_pretrained(SHIPPED, gpus=2, master_port=port, timeout_s=60)
        assert set(process_tree(os.getpid())) <= before


def test_workers_stop_on_close_and_at_interpreter_exit():
    with MoEModel.from_pretrained(SHIPPED, gpus=2) as model:
        pids = model.info.pids
        assert all(alive(p) for p in pids)
    assert not any(alive(p) for p in pids)
    code = (f"from moe import MoEModel; m = MoEModel.from_pretrained({str(SHIPPED)!r}, gpus=2); "
            "print(*m.info.pids); print(m.generate(['In the'], max_new_tokens=3))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.splitlines()[0].split()]
    wait_gone(pids)


def test_cli_four_ranks_prints_the_one_rank_text():
    def run(gpus: str) -> str:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(SHIPPED),
                               "--gpus", gpus, "--prompt", "And God said", "--max-new-tokens", "12"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    four, one = run("4"), run("1")
    assert "CPU processes over gloo" in four and "peak RSS per rank" in four
    text = [line for line in four.splitlines() if line.startswith("And God said")]
    assert text and text == [line for line in one.splitlines() if line.startswith("And God said")]


def test_cli_exits_non_zero_naming_the_killed_rank():
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(SHIPPED),
                             "--gpus", "3", "--prompt", "And God said", "--max-new-tokens", "1500"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait for generation to start (the prompt is echoed once the ranks are up), then kill one rank.
    while "And God said" not in proc.stdout.readline():
        assert proc.poll() is None, proc.stderr.read()
    ranks = [c for c in process_tree(proc.pid) if open(f"/proc/{c}/comm").read().startswith("moe-rank")]
    assert len(ranks) == 3
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "error: rank" in err and "killed by signal 9" in err and "Traceback" not in err
    assert not any(alive(p) for p in ranks)


def test_torchrun_joins_the_given_group_and_prints_the_one_rank_text():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(ROOT / "scripts" / "generate.py"), "--ckpt", str(SHIPPED),
                           "--prompt", "And God said", "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(SHIPPED),
                          "--prompt", "And God said", "--max-new-tokens", "12"], capture_output=True, text=True,
                         timeout=300)
    text = [line for line in proc.stdout.splitlines() if line.startswith("And God said")]
    assert len(text) == 1 and text == [line for line in one.stdout.splitlines() if line.startswith("And God said")]
    assert "peak RSS per rank" in proc.stdout


def test_a_frozen_rank_is_named_within_30_seconds():
    """SIGSTOP: the rank is alive but silent; the others wait in a collective and keep beating."""
    model = MoEModel.from_pretrained(SHIPPED, gpus=3)
    pids = model.info.pids
    stopped_at = []

    def freeze_rank_2(b, piece):
        if not stopped_at:
            os.kill(pids[2], signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    try:
        with pytest.raises(RankFailure) as e:
            model.generate(["And God said"], max_new_tokens=2000, ignore_eos=True, streamer=freeze_rank_2)
        assert time.monotonic() - stopped_at[0] < 30
        assert str(e.value).startswith("rank 2 stopped responding"), str(e.value)
        wait_gone(pids)
        with pytest.raises(RankFailure, match="were closed .*rank 2 stopped responding"):
            model.generate(["x"])
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
