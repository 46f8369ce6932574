"""Rank processes are fresh interpreters: a model with N ranks starts from any kind of user code (a script
without a main guard, `python -c`, a script on standard input, an interactive session), and leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe.workers.group import run_ranks
from tests.checkpoints import TRAINED

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

USER_CODE = (f"from moe import MoEModel\n"
             f"m = MoEModel.from_pretrained({str(TRAINED)!r}, gpus=2)\n"
             f"print(m.generate(['And God said'], max_new_tokens=6))\n"
             f"print('pids', *m.info.pids)\n"
             f"m.close()\n")


def no_tmp_leftovers() -> set[str]:
    return {p for p in os.listdir("/tmp") if p.startswith("pymp-")}


def check_output(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bootstrapping phase" not in proc.stderr
    text_line = next(line for line in proc.stdout.splitlines() if line.startswith("["))
    assert len(text_line) > 6  # ['...'] with generated text
    pids = [int(p) for p in next(line for line in proc.stdout.splitlines() if line.startswith("pids")).split()[1:]]
    assert len(pids) == 2 and not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_plain_script_without_main_guard(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(USER_CODE)
    before = no_tmp_leftovers()
    check_output(subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300))
    assert no_tmp_leftovers() <= before  # nothing left in /tmp by the exchange of tensors with the ranks


def test_python_dash_c(tmp_path):
    check_output(subprocess.run([sys.executable, "-c", USER_CODE], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300))


def test_script_on_standard_input(tmp_path):
    """`python -` has a __main__ with no file, as a notebook kernel has."""
    check_output(subprocess.run([sys.executable, "-"], input=USER_CODE, cwd=tmp_path, capture_output=True,
                                text=True, timeout=300))


def test_interactive_session(tmp_path):
    proc = subprocess.run([sys.executable, "-i", "-q"], input=USER_CODE, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    check_output(proc)


def _target_in_main(rank, world_size, port):  # stands in for a function a user defined in __main__
    pass


def test_batch_ranks_refuse_a_target_they_could_not_import(monkeypatch):
    monkeypatch.setattr(_target_in_main, "__module__", "__main__")
    with pytest.raises(ValueError, match="defined in __main__"):
        run_ranks(_target_in_main, 2)
