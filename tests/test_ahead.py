"""Decode steps compiled ahead of time (`moe.engine.ahead`): a package gives the eager tokens and loads, and the
expert loads, and is found by a key that changes with everything that changes its code; a corrupt or foreign
package is never run."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from moe import MoEModel
from moe.engine import ahead
from tests.checkpoints import SHIPPED, TRAINED

PROMPTS = [[1, 45, 312, 9, 77], [1, 8, 8]]  # batch 2 with left padding
SAMPLED = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)


def tokens(model: MoEModel, prompts=PROMPTS) -> list:
    return model.generate(prompts, max_new_tokens=20, ignore_eos=True)


@pytest.mark.slow  # two builds of about 15 s each
def test_a_package_gives_the_eager_tokens_loads_in_a_later_model_and_is_never_run_when_broken(capfd):
    eager = MoEModel.from_pretrained(TRAINED, compile=False)
    want, sampled = tokens(eager), eager.generate(["And God said", "It is"], **SAMPLED)
    assert not list(ahead.cache_dir().glob("*.pt2"))

    built = MoEModel.from_pretrained(TRAINED, compile=True)  # builds the batch-2 package at the first request
    assert tokens(built) == want
    assert "compiling the decode step ahead of time for batch 2 and 256 cache slots" in capfd.readouterr().err
    (package,) = ahead.cache_dir().glob("*.pt2")

    later = MoEModel.from_pretrained(TRAINED)  # the default: the package is loaded, nothing is compiled
    later.reset_expert_load(), eager.reset_expert_load()
    assert tokens(later) == tokens(eager) == want
    assert later.engine.ahead_ran and "compiling" not in capfd.readouterr().err
    assert torch.equal(later.expert_load().counts, eager.expert_load().counts)  # the package counts as eager does
    assert later.generate(["And God said", "It is"], **SAMPLED) == sampled
    with_logprobs = later.generate(["And God said", "It is"], **SAMPLED, logprobs=2)  # tokens: a column of wider rows
    assert [o.token_ids for o in with_logprobs] == [o.token_ids for o in sampled] and later.engine.ahead_ran
    assert tokens(MoEModel.from_pretrained(TRAINED, compile=False)) == want  # and compile=False never loads it
    for debug in (True, False):  # a mode no package is built with: eager steps, then the package again
        later.set_debug_routing(debug), eager.set_debug_routing(debug)
        later.reset_expert_load(), eager.reset_expert_load()
        assert tokens(later) == tokens(eager) and later.engine.ahead_ran is not debug
        assert torch.equal(later.expert_load().counts, eager.expert_load().counts)

    foreign = ahead.cache_dir() / f"{ahead.step_key(later.engine.model, 3, 256)}.pt2"
    foreign.write_bytes(package.read_bytes())  # the batch-2 package under the batch-3 name
    three = [[1, 45, 312], [1, 8, 8], [1, 9, 9]]
    assert tokens(later, three) == tokens(eager, three)
    assert not later.engine.ahead_ran and "cannot be used (the package's key is not its name)" in \
        capfd.readouterr().err

    package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])  # truncated
    assert tokens(MoEModel.from_pretrained(TRAINED)) == want
    err = capfd.readouterr().err
    assert "cannot be used" in err and "running eager steps" in err
    rebuilt = MoEModel.from_pretrained(TRAINED, compile=True)
    assert tokens(rebuilt) == want and rebuilt.engine.ahead_ran
    err = capfd.readouterr().err
    assert "rebuilding it" in err and "compiled in" in err
    assert not [p for p in os.listdir(ahead.cache_dir()) if p.startswith(".partial")]


def test_the_key_changes_with_everything_that_changes_the_code(monkeypatch):
    model = MoEModel.from_pretrained(TRAINED, compile=False).engine.model
    key = ahead.step_key(model, 1, 256)
    assert ahead.step_key(model, 1, 256) == key
    others = {
        "batch": ahead.step_key(model, 2, 256),
        "cache length": ahead.step_key(model, 1, 512),
        "dtype": ahead.step_key(MoEModel.from_pretrained(TRAINED, dtype="bfloat16").engine.model, 1, 256),
        "int8": ahead.step_key(MoEModel.from_pretrained(TRAINED, dtype="int8").engine.model, 1, 256),
        "shape": ahead.step_key(MoEModel.from_pretrained(SHIPPED).engine.model, 1, 256),
    }
    choice = model.kernel_choice
    monkeypatch.setattr(model, "kernel_choice", dataclasses.replace(choice, flavour="avx2"))
    others["kernels"] = ahead.step_key(model, 1, 256)
    monkeypatch.setattr(model, "kernel_choice", choice)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    others["torch"] = ahead.step_key(model, 1, 256)
    monkeypatch.undo()
    monkeypatch.setattr(ahead, "code_digest", lambda: "another source")
    others["code"] = ahead.step_key(model, 1, 256)
    assert all(k != key for k in others.values()), others
    assert len(set(others.values())) == len(others)


def test_the_code_digest_covers_the_models_source_and_the_kernels():
    digest = ahead.code_digest()
    files = [p for root in ahead.CODE for p in (root.rglob("*") if root.is_dir() else [root])]
    assert any(p.name == "attention.py" for p in files) and any(p.suffix == ".cpp" for p in files)
    assert Path(ahead.__file__).resolve() in files and ahead.code_digest() == digest
