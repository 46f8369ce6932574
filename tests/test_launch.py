"""Rank processes are fresh interpreters (on Linux forked from a server that imported torch once): a model with N
ranks starts from any kind of user code (a script without a main guard, `python -c`, a script on standard input, an
interactive session), and leaves nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe import MoEModel
from moe.errors import RankFailure
from moe.workers import forkserver, spawn
from moe.workers.group import run_ranks
from tests.checkpoints import TRAINED
from tests.waiting import wait_gone

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


def _report_where_it_runs(rank, world_size, port, out_dir):  # a batch job: what a rank sees of its start
    os.makedirs(out_dir, exist_ok=True)
    seen = [os.getcwd(), os.environ.get("MOE_TEST_MARK"), os.environ.get("PYTEST_CURRENT_TEST"),
            open("/proc/self/comm").read().strip()]
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("|".join(map(str, seen)))
    print(f"rank {rank} says hello", flush=True)


@pytest.mark.skipif(not forkserver.available(), reason="the fork server is Linux's")
def test_forked_ranks_see_the_callers_directory_environment_and_output(tmp_path, monkeypatch, capfd):
    """A forked rank starts where a fresh one would: the caller's working directory, environment and stdout now, not
    the ones the fork server started with. A variable read at import gets a server of its own; pytest's name of the
    running test does not."""
    servers = []
    for mark, test_name in [("one", "a"), ("two", "a"), ("two", "b")]:
        monkeypatch.setenv("MOE_TEST_MARK", mark)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test_name)
        here = tmp_path / f"{mark}-{test_name}"
        here.mkdir()
        monkeypatch.chdir(here)
        run_ranks(_report_where_it_runs, 2, str(here / "out"))
        seen = sorted((here / "out").iterdir())
        assert [p.read_text() for p in seen] == [f"{here}|{mark}|{test_name}|moe-rank{r}" for r in range(2)]
        out = capfd.readouterr().out
        assert "rank 0 says hello" in out and "rank 1 says hello" in out
        servers.append(next(reversed(forkserver._servers.values())).proc.pid)
    assert servers[0] != servers[1] == servers[2]


def test_forked_and_fresh_ranks_give_the_same_tokens(monkeypatch):
    texts = {}
    for fork in (True, False):
        monkeypatch.setattr(spawn, "FORK", fork)
        with MoEModel.from_pretrained(TRAINED, gpus=2) as model:
            texts[fork] = model.generate(["And God said"], max_new_tokens=8)
            names = [open(f"/proc/{p}/comm").read().strip() for p in model.info.pids]
            assert names == ["moe-rank0", "moe-rank1"]
    assert texts[True] == texts[False]


@pytest.mark.skipif(not forkserver.available(), reason="the fork server is Linux's")
def test_a_killed_fork_server_takes_its_ranks_along_and_the_next_load_starts_another():
    model = MoEModel.from_pretrained(TRAINED, gpus=2)
    pids = model.info.pids
    parents = {int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) for p in pids}
    servers = [s.proc for s in forkserver._servers.values() if s.proc.pid in parents]
    assert len(servers) == 1  # forked by one of our servers, not started by us
    servers[0].kill()  # only this model's: another module's model may be open still
    servers[0].wait()
    wait_gone(pids)  # the ranks die with their server
    with pytest.raises(RankFailure, match="killed by signal 9"):
        model.generate(["And God said"], max_new_tokens=4)
    with MoEModel.from_pretrained(TRAINED, gpus=2) as again:
        assert again.generate(["And God said"], max_new_tokens=4)


FORKED_USER = f"""
import os, sys
from moe import MoEModel
from moe.errors import RankFailure

def server_of(model):
    return {{int(open(f"/proc/{{p}}/stat").read().rsplit(")", 1)[1].split()[1]) for p in model.info.pids}}

m = MoEModel.from_pretrained({str(TRAINED)!r}, gpus=2)
want = m.generate(["And God said"], max_new_tokens=6)
pid = os.fork()
if pid == 0:
    try:
        m.generate(["And God said"], max_new_tokens=6)
        sys.exit("the forked copy of the model ran")
    except RankFailure as e:
        assert "forked" in str(e), e
    with MoEModel.from_pretrained({str(TRAINED)!r}, gpus=2) as mine:
        assert mine.generate(["And God said"], max_new_tokens=6) == want
        assert server_of(mine).isdisjoint(server_of(m)), "the parent's fork server forked the child's ranks"
    sys.exit(0)  # a normal exit: the inherited model's close at exit must leave the parent's ranks alone
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert m.generate(["And God said"], max_new_tokens=6) == want
print("ok")
"""


def test_a_process_forked_from_a_callers_loads_its_own_model_and_leaves_the_parents_alone(tmp_path):
    """`os.fork` after a load: the child's copy of the model refuses (its requests would mix with the parent's on the
    same pipes), its exit leaves the parent's ranks running, and a model it loads has ranks of its own."""
    proc = subprocess.run([sys.executable, "-c", FORKED_USER], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
