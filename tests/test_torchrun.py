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


CONTROLS = """
import json, sys
from moe import MoEModel
model = MoEModel.from_pretrained(sys.argv[1])
out = model.generate([{prompt!r}, "And"], max_new_tokens=12, temperature=0.8, top_k=20, seed=[3, 4], stop=["ou", "zz"],
                     logprobs=2, repetition_penalty=1.2)
template = "{{% for m in messages %}}<{{{{ m.role }}}}> {{{{ m.content }}}}\\n{{% endfor %}}<assistant> "
reply = model.chat([{{"role": "user", "content": "Who is Emma?"}}], max_new_tokens=6, chat_template=template,
                   temperature=0)
if model.rank == 0:
    print(json.dumps([[o, o.token_ids, o.finish_reason, o.stop_reason, [e.logprob for e in o.logprobs]] for o in out]
                     + [[reply, reply.token_ids]]))
model.close()
"""


def test_sampling_controls_and_chat_under_torchrun_give_the_one_process_results(tmp_path):
    path = tmp_path / "controls.py"
    path.write_text(CONTROLS.format(prompt=PROMPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    runs = [subprocess.run([*launcher, str(path), str(TRAINED)], capture_output=True, text=True, timeout=300, env=env)
            for launcher in ([sys.executable],
                             [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert [row[:4] for row in one] == [row[:4] for row in two]
    for a, b in zip(one[:2], two[:2], strict=True):
        assert max(abs(x - y) for x, y in zip(a[4], b[4], strict=True)) < 1e-4
    assert [row[2:4] for row in one[:2]] == [["stop", "ou"], ["stop", "ou"]]  # the stop string was met
