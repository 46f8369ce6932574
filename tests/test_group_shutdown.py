"""Leaving a process group ends gloo's threads before the interpreter exits: on `DistContext.destroy` (close(), a
rank process's end, torchrun's exit), after torch.compile's imports too. A gloo worker still alive during
interpreter exit aborts the process when it releases a finished collective's tensors (`moe.parallel.distributed`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe.parallel.distributed import init_process_group
from moe.workers.group import run_ranks
from moe.workers.rank import gloo_io_threads
from tests.checkpoints import TRAINED

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are found in /proc (Linux)")]


def _left(rank: int, world_size: int, port: int, out: str) -> None:
    dist = init_process_group(rank, world_size, "127.0.0.1", port)
    dist.make_groups([(0, 1)])  # a group of 2 among 3 ranks: its own gloo context and threads
    importlib.import_module("torch._dynamo")  # what torch.compile imports, here once the group exists

    summed = dist.all_reduce(torch.ones(2), ranks=(0, 1)) if rank < 2 else None
    during = len(gloo_io_threads())
    dist.destroy()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "during": during, "after": len(gloo_io_threads()), "sum": None if summed is None else summed.tolist()}))


def test_destroying_the_group_ends_gloo_threads_after_torch_compile_imports(tmp_path):
    run_ranks(_left, 3, str(tmp_path))
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["during"] >= 1 and got["after"] == 0, got
    assert json.loads((tmp_path / "rank0.json").read_text())["sum"] == [2.0, 2.0]


TORCHRUN_SCRIPT = f"""
import atexit, sys
from moe.workers.rank import gloo_io_threads
atexit.register(lambda: print(f"gloo threads at exit: {{len(gloo_io_threads())}}", flush=True))  # runs after ours
from moe import MoEModel
model = MoEModel.from_pretrained({str(TRAINED)!r}, attention="replicated", compile=True)
model.generate(["It is a truth"], max_new_tokens=4)
print(f"gloo threads while loaded: {{len(gloo_io_threads())}}", flush=True)
if sys.argv[1] == "close":
    model.close()
    print(f"gloo threads after close: {{len(gloo_io_threads())}}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["close", "exit"])
def test_a_compiled_torchrun_script_ends_gloo_threads_on_close_or_at_exit(tmp_path, end):
    path = tmp_path / "plain.py"  # a plain script: no main guard, and (for "exit") no close()
    path.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(TRAINED.parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(path), end], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("gloo threads while loaded: 1") == 2, run.stdout
    if end == "close":
        assert run.stdout.count("gloo threads after close: 0") == 2, run.stdout
    assert run.stdout.count("gloo threads at exit: 0") == 2, run.stdout
