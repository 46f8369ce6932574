"""Ranks agree or refuse: ranks that loaded with other kernels or settings stop the load in one line naming the rank
and the setting; a user error's type raised after a call's first collective ends the model with the rank named
(the other ranks may be waiting in a collective); ranks that route the same tokens compare their routing."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from moe import MoEModel
from moe.errors import RankFailure
from moe.info import ModelInfo
from moe.parallel.agreement import RanksDisagree, check_reports_agree
from moe.parallel.distributed import single_process
from tests.checkpoints import ROOT, SHIPPED
from tests.waiting import wait_gone


def test_reports_that_differ_name_the_first_rank_and_setting():
    same = {"kernel_settings": {"native": True, "flavour": "avx2", "dtype": "float32"}}
    check_reports_agree([same, same, same])
    other = {"kernel_settings": {"native": True, "flavour": "avx512", "dtype": "float32"}}
    with pytest.raises(RanksDisagree, match="^rank 2 loaded with flavour='avx512' where rank 0 has 'avx2': every"):
        check_reports_agree([same, same, other])


RANKS_THAT_DIFFER = """
import os, sys
from moe import MoEModel
from moe.errors import USER_ERRORS
kernels = "torch" if os.environ["RANK"] == "1" else "auto"  # rank 1 asks for other kernels
try:
    MoEModel.from_pretrained(sys.argv[1], cpu_kernels=kernels)
except USER_ERRORS as e:
    print(f"rank {os.environ['RANK']}: {type(e).__name__}: {e}")
    sys.exit(2)
"""


@pytest.mark.multiprocess
def test_torchrun_ranks_with_other_kernels_refuse_to_load(tmp_path):
    """Under torchrun each process asks for its own kernels: a rank that asks for others stops every rank's load."""
    (tmp_path / "differ.py").write_text(RANKS_THAT_DIFFER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp_path / "differ.py"), str(SHIPPED)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: RanksDisagree: rank 1 loaded with asked='torch' where rank 0 has 'auto'" in run.stdout, \
            run.stdout + run.stderr[-2000:]


@pytest.mark.multiprocess
def test_a_value_error_after_a_collective_ends_the_model_naming_the_rank():
    model = MoEModel.from_pretrained(SHIPPED, gpus=3)
    pids = model.info.pids
    with pytest.raises(RankFailure, match="^rank 1 raised RuntimeError: ValueError after the call's first "
                                          "collective: injected after a collective on rank 1"):
        model.engine.group.call("fail", 1, "ValueError")
    wait_gone(pids)
    with pytest.raises(RankFailure, match="were closed"):
        model.generate([[1, 2, 3]], max_new_tokens=2)


class _Rank:
    """A torchrun rank's engine whose call enters a collective and then raises a ValueError."""

    def __init__(self, collective_first: bool) -> None:
        self.dist, self.collective_first = single_process(), collective_first

    def logits(self, ids):
        if self.collective_first:
            self.dist.entered[0] += 1
        raise ValueError("bad value")


@pytest.mark.parametrize("collective_first", [False, True])
def test_under_torchrun_a_value_error_after_a_collective_ends_the_model(collective_first):
    info = ModelInfo("hf", "float32", "auto", 2, "gloo", "torchrun", rank=1)
    config = SimpleNamespace(vocab_size=128, max_seq_len=64)
    model = MoEModel(_Rank(collective_first), config, None, info)
    ids = torch.tensor([[1, 2, 3]])
    if not collective_first:  # a user error before any collective: the model stays usable
        for _ in range(2):
            with pytest.raises(ValueError, match="bad value"):
                model(ids)
        return
    with pytest.raises(RankFailure, match="^rank 1 raised ValueError after the call's first collective: bad value"):
        model(ids)
    with pytest.raises(RankFailure, match="can no longer be used \\(rank 1 raised ValueError"):
        model(ids)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(attention="replicated"), dict(experts="tensor")],
                         ids=["replicated-lone-sequence", "expert-group"])
def test_ranks_that_route_the_same_tokens_otherwise_are_named(layout):
    """A lone sequence with replicated attention is run by every rank; a group that splits every expert routes on
    each of its ranks. A rank whose routers differ is found at the end of the request, not left to write text."""
    with MoEModel.from_pretrained(SHIPPED, gpus=2, **layout) as model:
        assert model.generate([[1, 5, 9]], max_new_tokens=6)  # the same routing: no error
        model.engine.group.call("skew_routers", 1)
        with pytest.raises(RankFailure, match="raised RoutingDiverged: ranks 0 and 1 routed the same tokens of block "
                                              "0 to different experts"):
            model.generate([[1, 5, 9]], max_new_tokens=6)
