"""Under torchrun every entry point goes through `MoEModel`, which joins torchrun's group: same answers as one
process, a printed seed that reproduces the sampled text, rank 0 alone prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.checkpoints import ROOT, TRAINED

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROMPT = "It is a truth universally acknowledged, that"


def script(name: str, *args: str, ranks: int = 0) -> subprocess.CompletedProcess:
    """Run scripts/NAME.py on one process, or under torchrun with `ranks` processes."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = [*(launcher if ranks else [sys.executable]), str(ROOT / "scripts" / f"{name}.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def continuation(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(PROMPT)]
    assert len(lines) == 1, stdout  # printed once: by rank 0 only
    return lines[0]


def test_printed_seed_reproduces_the_sampled_text(tmp_path):
    args = ("--ckpt", str(TRAINED), "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0.9")
    run = script("generate", *args, "--expert-load", str(tmp_path / "load"), ranks=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "load" / "expert_load.json").is_file()  # --expert-load is honoured under torchrun
    seed = re.search(r"seed=(\d+)", run.stdout).group(1)
    again = script("generate", *args, "--seed", seed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert continuation(run.stdout) == continuation(again.stdout)


def test_evaluate_gives_the_one_process_figures(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife.\n\nIn the beginning God made the heaven and the earth.\n")
    args = ("--ckpt", str(TRAINED), "--text", str(text), "--seq-len", "16", "--batch-size", "2")
    one, two = script("evaluate", *args), script("evaluate", *args, ranks=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    figures = [re.search(r"([\d.]+) nats/token \| ([\d.]+) bits/byte", p.stdout).groups() for p in (one, two)]
    assert figures[0] == figures[1]
    assert two.stdout.count("bits/byte") == 1


def test_expert_load_report_under_torchrun(tmp_path):
    run = script("expert_load", "--ckpt", str(TRAINED), "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--out", str(tmp_path / "load"), ranks=2)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "load" / "expert_load.json").read_text())
    assert report["placement"]["world_size"] == 2
    assert sum(map(sum, report["rank_load"])) > 0


def test_gpus_flag_is_refused_under_torchrun():
    run = script("generate", "--ckpt", str(TRAINED), "--prompt", PROMPT, "--gpus", "2", ranks=2)
    assert run.returncode != 0  # torchrun itself then reports the failed processes, with its own traceback
    assert run.stderr.count("error: --gpus does not apply under torchrun") == 1
    assert "/moe/" not in run.stderr  # no traceback through our code


def test_tensor_parallel_generate_under_torchrun_gives_the_one_process_text():
    """Process subgroups made through torchrun's store; the strategy table printed once, by rank 0."""
    args = ("--ckpt", str(TRAINED), "--prompt", PROMPT, "--max-new-tokens", "16")
    one = script("generate", *args)
    two = script("generate", *args, "--attention", "tensor", "--experts", "tensor", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert continuation(two.stdout) == continuation(one.stdout)
    assert two.stdout.count("tensor[0,1] / tensor[0,1]") == 1


@pytest.mark.parametrize("layout, ranks", [
    (("--attention", "replicated"), 2),
    (("--experts", "layer"), 3),  # a pipeline: its pairs' groups made through torchrun's store, a middle rank
])
def test_compiled_steps_give_the_one_process_tokens(layout, ranks):
    args = ("--ckpt", str(TRAINED), "--prompt", PROMPT, "--max-new-tokens", "16")
    run = script("generate", *args, *layout, "--compile", ranks=ranks)
    one = script("generate", *args)
    assert run.returncode == 0 and one.returncode == 0, (run.stderr + one.stderr)[-3000:]
    assert continuation(run.stdout) == continuation(one.stdout)
