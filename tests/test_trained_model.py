"""The trained checkpoint in weights/: it has learned English, and evaluate.py measures it."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.checkpoints import ROOT, TRAINED

# The opening of Emma, chapter 12: a chapter held out from training (every 20th chapter is).
HELD_OUT = (
    "Mr. Elton must now be left to himself. It was no longer in Emma's power to superintend his happiness or "
    "quicken his measures. The coming of her sister's family was so very near at hand, that first in anticipation, "
    "and then in reality, it became henceforth her prime object of interest; and during the ten days of their stay "
    "at Hartfield it was not to be expected--she did not herself expect--that any thing beyond occasional, "
    "fortuitous assistance could be afforded by her to the lovers.\n"
)


def evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_trained_model_predicts_held_out_english(tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(HELD_OUT)
    proc = evaluate("--ckpt", str(TRAINED), "--text", str(text))
    assert proc.returncode == 0, proc.stderr
    bpb = float(re.search(r"([\d.]+) bits/byte", proc.stdout).group(1))
    nats = float(re.search(r"([\d.]+) nats/token", proc.stdout).group(1))
    # Uniform guessing over 4096 pieces is 8.3 nats/token (about 3 bits/byte here); the trained model is far below.
    assert bpb < 2.0 and nats < 5.5, proc.stdout


def test_evaluate_reports_a_missing_file_in_one_line(tmp_path):
    proc = evaluate("--ckpt", str(TRAINED), "--text", str(tmp_path / "nope.txt"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope.txt" in proc.stderr
