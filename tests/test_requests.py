"""Requests are transactions (invariant "requests are transactions"): a request that fails or is interrupted
is cancelled on every rank before the call returns, the next call gets its own answer, several threads share
one model, and a user's mistake leaves the model usable."""

from __future__ import annotations

import collections
import os
import stat
import threading

import pytest

from moe import MoEModel
from moe.checkpoint.files import CheckpointError
from tests.checkpoints import TRAINED

pytestmark = [pytest.mark.multiprocess]
PROMPTS = ["It is a truth universally acknowledged, that", "And God said"]


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def model(request):
    with MoEModel.from_pretrained(TRAINED, gpus=request.param) as m:
        yield m


@pytest.fixture(scope="module")
def expected(model):
    return {p: model.generate([p], max_new_tokens=12) for p in PROMPTS}


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("error", [Interrupt, KeyboardInterrupt])
def test_an_interrupted_request_does_not_poison_the_next(model, expected, error):
    def streamer(i, piece):
        raise error("stop")

    with pytest.raises(error):
        model.generate([PROMPTS[0]], max_new_tokens=500, streamer=streamer)
    assert model.generate([PROMPTS[1]], max_new_tokens=12) == expected[PROMPTS[1]]  # its own answer
    assert model.generate([PROMPTS[0]], max_new_tokens=12) == expected[PROMPTS[0]]


class CountingPipe:
    """A rank's pipe as the parent reads it, counting the kinds of message that arrive."""

    def __init__(self, conn) -> None:
        self.conn, self.kinds = conn, collections.Counter()

    def recv(self):
        msg = self.conn.recv()
        self.kinds[msg[0]] += 1
        return msg

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_ranks_send_tokens_one_by_one_only_to_a_streamer(model, expected):
    if model.info.launch == "local":
        pytest.skip("one rank runs in the user's process: no pipe")
    ranks = model.engine.group.ranks
    pipes = [CountingPipe(rp.conn) for rp in ranks]
    for rp, pipe in zip(ranks, pipes, strict=True):
        rp.conn = pipe
    try:
        assert model.generate([PROMPTS[0]], max_new_tokens=12) == expected[PROMPTS[0]]
        assert [p.kinds["token"] for p in pipes] == [0, 0]
        pieces = []
        assert model.generate([PROMPTS[0]], max_new_tokens=12, streamer=lambda i, s: pieces.append(s)) \
            == expected[PROMPTS[0]]
        assert "".join(pieces) == expected[PROMPTS[0]][0]
        assert pipes[0].kinds["token"] == len(model.last_result.tokens[0]) and pipes[1].kinds["token"] == 0
    finally:
        for rp, pipe in zip(ranks, pipes, strict=True):
            rp.conn = pipe.conn


def test_two_threads_each_get_their_own_answer(model, expected):
    results: dict[str, list] = {}

    def run(prompt: str) -> None:
        results[prompt] = [model.generate([prompt], max_new_tokens=12) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {p: r for p, r in results.items()} == {p: [expected[p]] * 3 for p in PROMPTS}


@pytest.mark.parametrize("bad", [dict(max_new_tokens=1.5), dict(temperature=float("nan")), dict(temperature=-1),
                                 dict(top_p=0), dict(top_k="3"), dict(seed=0.5)])
def test_bad_arguments_are_refused_here_and_the_model_lives_on(model, expected, bad):
    with pytest.raises(ValueError):
        model.generate([PROMPTS[1]], **({"max_new_tokens": 4} | bad))
    assert model.generate([PROMPTS[1]], max_new_tokens=12) == expected[PROMPTS[1]]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_a_save_that_cannot_write_is_an_error_and_the_model_lives_on(model, expected, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(CheckpointError, match="cannot"):
        model.save_pretrained(locked / "out")
    assert model.generate([PROMPTS[1]], max_new_tokens=12) == expected[PROMPTS[1]]


def test_a_save_that_cannot_start_is_an_error_and_the_model_lives_on(model, expected, tmp_path):
    """A target under a file: rank 0 cannot make the output directory and tells every rank."""
    with pytest.raises(CheckpointError, match="cannot create the output directory"):
        model.save_pretrained(_blocked_target(tmp_path))
    assert model.generate([PROMPTS[1]], max_new_tokens=12) == expected[PROMPTS[1]]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial directory left


def _blocked_target(tmp_path):
    """A target whose parent is a file: creating it fails with an OS error on the rank that makes it."""
    parent = tmp_path / "a-file"
    parent.write_text("not a directory")
    return parent / "out"
