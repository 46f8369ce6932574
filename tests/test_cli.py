"""The README's first command, on the shipped checkpoint."""

from __future__ import annotations

import subprocess
import sys

from tests.checkpoints import ROOT, SHIPPED


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(SHIPPED), *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_settings_text_and_summary():
    proc = run_generate("--prompt", "And God said", "--max-new-tokens", "8", "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("settings:") and "seed=5" in line for line in lines)
    assert any("And God said" in line for line in lines)
    assert "tok/s" in lines[-1] and "peak RSS" in lines[-1]


def test_generate_batch_from_prompt_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("And God said\n\nIn the beginning\n")
    proc = run_generate("--prompt-file", str(prompts), "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "[0] And God said" in proc.stdout and "[1] In the beginning" in proc.stdout
