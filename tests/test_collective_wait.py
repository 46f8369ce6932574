"""Waiting for a collective by polling (`DistContext.poll`, rank processes with cores of their own): the same
answers as sleeping in it, the same error at the group's timeout (never a hang), and only where the cores are the
rank's alone; there gloo's I/O threads run at the lowest priority."""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe.parallel.distributed import init_process_group
from moe.workers.group import run_ranks
from moe.workers.rank import gloo_io_threads, lower_gloo_io_threads
from tests.waiting import wait_until

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 3.0


def _rank_values(rank: int, world_size: int, port: int, out: str) -> None:
    """Every collective the engines use, polled and sleeping, with the answers written down; then rank 1 stays away
    from a collective for longer than the timeout, and rank 0 says how long its polled wait took to fail."""
    faulthandler.dump_traceback_later(TIMEOUT_S + 30, exit=True)  # a wait that never ends fails the test
    sleeping = init_process_group(rank, world_size, "127.0.0.1", port, timeout_s=TIMEOUT_S)
    answers = {}
    for dist in (sleeping, dataclasses.replace(sleeping, poll=True)):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
        splits = [1, 2] if rank == 0 else [2, 1]  # rows to (and from) rank 0, rank 1
        got = {"all_gather": dist.all_gather(x), "reduce_scatter": dist.reduce_scatter(x),
               "all_reduce": dist.all_reduce(x.clone()), "broadcast": dist.broadcast(x.clone(), 1),
               "all_to_all": dist.all_to_all(torch.empty(3, 3), torch.cat([x, x[:1]]), splits, splits),
               "gather": dist.gather(x, 0)}
        answers["polled" if dist.poll else "sleeping"] = {
            k: None if v is None else [t.tolist() for t in v] if isinstance(v, list) else v.tolist()
            for k, v in got.items()}
    if rank == 1:  # away from the next collective until rank 0's wait has failed (it must not spin on)
        wait_until(lambda: (Path(out) / "rank0.json").exists(), TIMEOUT_S + 25, "rank 0's wait to end")
    else:
        start = time.perf_counter()
        try:
            dataclasses.replace(sleeping, poll=True).all_gather(torch.zeros(1, 3))
            answers["timeout"] = "returned"
        except Exception as e:  # gloo's timeout error
            answers["timeout"] = [type(e).__name__, time.perf_counter() - start]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(answers))
    os._exit(0)  # the group is broken past the timeout: no teardown to wait on


def test_polled_collectives_give_the_sleeping_answers_and_fail_at_the_timeout(tmp_path):
    run_ranks(_rank_values, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["polled"] == r["sleeping"]
        assert r["sleeping"]["all_gather"] == ranks[0]["sleeping"]["all_gather"]
    assert ranks[0]["sleeping"]["all_reduce"] == [[10.0, 12.0, 14.0], [16.0, 18.0, 20.0]]
    assert ranks[0]["timeout"] != "returned"  # an all-gather without rank 1 cannot have an answer
    _, waited = ranks[0]["timeout"]
    assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 20, ranks[0]["timeout"]  # at the timeout, not never (a bound)


PROBE = """
import json, os, sys
from moe.workers.rank import keep_to_share
cores = sorted(os.sched_getaffinity(0))[:2]
result = []
for rank, world_size, threads in json.loads(sys.argv[1]):
    os.sched_setaffinity(0, cores)  # a 2-core machine
    polls = keep_to_share(rank, world_size, threads)
    result.append([polls, sorted(os.sched_getaffinity(0)) == [cores[rank % 2]]])
print(json.dumps(result))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_ranks_poll_only_on_cores_of_their_own():
    cases = [(0, 2, 1), (1, 2, 1), (0, 4, 1), (3, 4, 1), (0, 2, 2)]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [
        [True, True], [True, True],  # a core each: pinned, and polling
        [False, True], [False, True],  # 4 ranks on 2 cores: pinned, sharing a core, so sleeping in collectives
        [False, False],  # more threads than its share: neither
    ]


def _lowered(rank: int, world_size: int, port: int, out: str) -> None:
    dist = dataclasses.replace(init_process_group(rank, world_size, "127.0.0.1", port), poll=True)
    lowered = lower_gloo_io_threads()
    nice = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in gloo_io_threads()}
    summed = dist.sum_in_rank_order(torch.full((1, 4), float(rank + 1)))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "lowered": lowered, "nice": sorted(nice.values()), "mine": os.getpriority(os.PRIO_PROCESS, 0),
        "sum": summed.tolist()}))
    dist.destroy()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are found in /proc (Linux)")
def test_gloo_io_threads_run_at_the_lowest_priority_and_collectives_still_finish(tmp_path):
    run_ranks(_lowered, 2, str(tmp_path))
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["lowered"] >= 1 and got["nice"] == [19] * got["lowered"]
        assert got["mine"] == 0  # the rank's own thread keeps its priority
        assert got["sum"] == [[3.0] * 4]
