"""The README's first command, on the shipped checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from models.kernels import native
from tests.checkpoints import ROOT, SHIPPED, TRAINED


def run_generate(*args: str, ckpt=SHIPPED) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(ckpt), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess
def test_readme_first_command_on_four_ranks():
    proc = run_generate("--gpus", "4", "--prompt", "It is a truth universally acknowledged, that",
                        "--max-new-tokens", "24", "--seed", "0", ckpt=TRAINED)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: loaded model-00001-of-00002.safetensors" in proc.stderr  # load progress, on stderr
    text = proc.stdout.split("It is a truth universally acknowledged, that", 1)[1].split("\nload ")[0]
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 10  # the trained model writes words, not byte soup


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


def test_cpu_kernels_flag_gives_the_same_greedy_text():
    """--cpu-kernels auto (the default: the native kernels where they built), native (those for every product),
    onednn and torch (plain F.linear) write the same greedy text."""
    args = ("--prompt", "It is a truth universally acknowledged, that", "--max-new-tokens", "24", "--seed", "0")
    texts = []
    for kernels in ("auto", "native", "onednn", "torch") if native.available() else ("auto", "onednn", "torch"):
        proc = run_generate(*args, "--cpu-kernels", kernels, ckpt=TRAINED)
        assert proc.returncode == 0, proc.stderr
        texts.append(proc.stdout.split("acknowledged, that", 1)[1].split("\nload ")[0])
    assert len(set(texts)) == 1 and len(texts[0]) > 40


def test_logit_bias_and_min_tokens_flags_give_the_apis_text():
    """llama.cpp's `--logit-bias ID(+/-)BIAS` and vLLM's `--min-tokens`, as `generate`'s keywords; a malformed
    bias is one line naming the flag."""
    from moe import MoEModel

    prompt = "It is a truth universally acknowledged, that"
    with MoEModel.from_pretrained(TRAINED) as model:
        first = model.generate(prompt, max_new_tokens=1, temperature=0)[0].token_ids[0]
        want = str(model.generate(prompt, max_new_tokens=12, temperature=0, logit_bias={first: -100}, min_tokens=12)[0])
    proc = run_generate("--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0", "--logit-bias",
                        f"{first}-100", "--min-tokens", "12", ckpt=TRAINED)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(prompt, 1)[1].startswith(want)
    bad = run_generate("--prompt", prompt, "--logit-bias", "5x", ckpt=TRAINED)
    assert bad.returncode == 2 and "--logit-bias" in bad.stderr and "Traceback" not in bad.stderr
