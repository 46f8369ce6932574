"""`compile="torch"` (what `compile=True` runs where a package compiled ahead of time cannot: N ranks,
tests/test_compiled_ranks.py; CUDA): decode steps through torch.compile with static shapes give the eager tokens,
reuse their graph and cache from one request to the next, and are refused where they do not run (oneDNN-packed
weights). The packages: tests/test_ahead.py."""

from __future__ import annotations

import pytest
import torch

from moe import MoEModel
from tests.checkpoints import SHIPPED, TRAINED

pytestmark = pytest.mark.slow  # the first step compiles (tens of seconds on a CPU)
PROMPTS = [[1, 45, 312, 9, 77], [1, 8, 8]]  # different lengths: left padding in the compiled step


def load(path, compile: bool = False) -> MoEModel:
    return MoEModel.from_pretrained(path, compile="torch" if compile else False)


def test_compiled_decode_gives_the_eager_tokens_and_compiles_once():
    from torch._dynamo.utils import counters

    eager = load(TRAINED)
    compiled = load(TRAINED, compile=True)
    assert compiled.info.compiled and not eager.info.compiled
    want = eager.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    assert compiled.generate(PROMPTS, max_new_tokens=24, ignore_eos=True) == want
    assert compiled.engine.compiled.direct.keys() == compiled.engine.compiled.seen  # its steps ran without dynamo
    graphs = counters["stats"]["unique_graphs"]
    other = [[1, 700, 12, 13], [1, 99]]  # another request of the same batch size: same cache, same graph
    assert compiled.generate(other, max_new_tokens=30, ignore_eos=True) == eager.generate(other, max_new_tokens=30,
                                                                                            ignore_eos=True)
    assert counters["stats"]["unique_graphs"] == graphs
    sampled = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    assert compiled.generate(["And God said"], **sampled) == eager.generate(["And God said"], **sampled)
    # The compiled step counts its copies per expert by comparisons, eager by a scatter: the same loads.
    assert torch.equal(compiled.expert_load().counts, eager.expert_load().counts)


def test_steps_that_skip_the_guards_still_run_their_own_graph():
    """After its first call a signature runs with only the guards that tell graphs apart (moe.engine.compiled):
    batch sizes, padding, a routing mode and a model of other shapes, taken in turns, each give the eager
    tokens."""
    eager, compiled = load(TRAINED), load(TRAINED, compile=True)
    other_eager, other = load(SHIPPED), load(SHIPPED, compile=True)
    one = [[1, 45, 312, 9]]  # batch 1, no padding

    def same(model, reference, prompts):
        return model.generate(prompts, max_new_tokens=8, ignore_eos=True) == \
            reference.generate(prompts, max_new_tokens=8, ignore_eos=True)

    for prompts in (PROMPTS, one, PROMPTS, one):
        assert same(compiled, eager, prompts) and same(other, other_eager, one)
    for round_robin in (True, False, True):  # a routing mode is a graph of its own
        for model in (eager, compiled):
            model.set_debug_routing(round_robin)
        assert same(compiled, eager, one), round_robin
    assert len(compiled.engine.compiled.seen) == 3  # 2 batch shapes, 1 of them in both routing modes
    assert compiled.engine.compiled.direct.keys() == compiled.engine.compiled.seen


def test_a_direct_call_gives_dynamos_logits_and_cache_writes():
    """Later steps of a signature call its compiled graph without dynamo (moe.engine.compiled): the same logits
    and the same keys and values written as the call through dynamo."""
    model = load(TRAINED, compile=True)
    model.generate([[1, 45, 312, 9]], max_new_tokens=4, ignore_eos=True)
    step = model.engine.compiled
    (key,) = step.direct
    before = {name: (c.k.clone(), c.v.clone()) for name, c in step.caches.items()}
    with torch.inference_mode():
        direct = step(torch.tensor([[7]]), 6, None).clone()
        written = {name: (c.k.clone(), c.v.clone()) for name, c in step.caches.items()}
        for name, c in step.caches.items():
            c.k.copy_(before[name][0]), c.v.copy_(before[name][1])
        del step.direct[key]  # the signature stays in `seen`: the call goes through dynamo, guards skipped
        through_dynamo = step(torch.tensor([[7]]), 6, None)
    assert torch.equal(direct, through_dynamo)
    for name, c in step.caches.items():
        assert torch.equal(c.k, written[name][0]) and torch.equal(c.v, written[name][1]), name
        assert not torch.equal(c.k, before[name][0]), name  # slot 6 was written


def test_cache_lengths_in_turns_each_run_their_own_graph():
    """A long request needs a longer cache (another graph); a short one after it gets a new short cache and the
    short graph again, which must take that cache as an input (a step that had frozen its first cache into its
    graph recompiled here and failed under the skipped guards)."""
    eager, compiled = load(TRAINED), load(TRAINED, compile=True)
    one = [[1, 45, 312, 9]]
    for new in (8, 300, 8, 300):  # caches of 256, 512, 256, 512 slots
        assert compiled.generate(one, max_new_tokens=new, ignore_eos=True) == \
            eager.generate(one, max_new_tokens=new, ignore_eos=True), new
        assert next(iter(compiled.engine.compiled.caches.values())).k.shape[2] == (256 if new == 8 else 512)


def test_requests_under_inference_mode_or_no_grad_reuse_the_graph():
    """A notebook wraps calls in `torch.inference_mode()` or `torch.no_grad()`, or not: the step's inputs are its
    own tensors whatever the caller's mode, so each request takes the graph the first one compiled (a caller's
    inference tensor used to need another graph, which the skipped guards refused with a RuntimeError)."""
    from torch._dynamo.utils import counters

    eager, compiled = load(TRAINED), load(TRAINED, compile=True)
    want = eager.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert compiled.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want
    graphs = counters["stats"]["unique_graphs"]
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            assert compiled.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want, mode
    assert compiled.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="cannot trace oneDNN-packed weights"):
        MoEModel.from_pretrained(TRAINED, compile=True, cpu_kernels="onednn")
    with pytest.raises(ValueError, match="compile must be None, True, False or 'torch'"):
        MoEModel.from_pretrained(TRAINED, compile="yes")
