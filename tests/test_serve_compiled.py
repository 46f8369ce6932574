"""The server as it starts by default, with compiled decode steps (`moe.engine.ahead`): a package for each size of
the running batch is built before /health turns 200, concurrent greedy answers equal `MoEModel.generate`'s eager
ones, and a later server loads the packages instead of building them. A pipeline on 2 ranks compiles its steps too."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe import MoEModel
from moe.engine import ahead
from tests.checkpoints import TRAINED
from tests.servers import Server

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROMPTS = ["It is a truth universally acknowledged, that", "And God said", "Emma Woodhouse", "In the beginning"]


def answers(server: Server) -> list[str]:
    client = server.client()

    def ask(i: int) -> str:  # some with log-probabilities: the step's tokens are then a column of wider rows
        return client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=10 + i, temperature=0,
                                         logprobs=2 if i % 2 else None).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


def test_compiled_server_steps_give_the_eager_answers_and_are_built_once():
    with MoEModel.from_pretrained(TRAINED, compile=False) as local:
        want = [str(local.generate([p], max_new_tokens=10 + i, temperature=0)[0]) for i, p in enumerate(PROMPTS)]
    flags = ["--max-num-seqs", "2", "--max-model-len", "200", "--served-model-name", "m"]
    first = Server(TRAINED, *flags, compiled=True)
    assert answers(first) == want
    assert stderr(first).count("compiled in") == 2  # batch 1 and 2, at the server's 200 slots
    assert len(list(ahead.cache_dir().glob("*.pt2"))) == 2
    later = Server(TRAINED, *flags, compiled=True)  # finds them: nothing to build
    assert answers(later) == want
    assert "compiling" not in stderr(later)


def stderr(server: Server) -> str:
    """What the server wrote on stderr, once it has stopped."""
    server.proc.send_signal(signal.SIGTERM)
    err = server.proc.communicate(timeout=60)[1]
    assert server.proc.returncode == 0
    return err


def test_a_pipeline_on_two_ranks_serves_compiled_steps_with_the_eager_answers():
    """`--experts layer` on 2 ranks: each rank compiles its blocks' part of a step for each batch size at start-up
    (`moe.engine.pipeline`), and sequences joining and leaving the compiled batch get `generate`'s eager tokens."""
    with MoEModel.from_pretrained(TRAINED, compile=False) as local:
        want = [str(local.generate([p], max_new_tokens=10 + i, temperature=0)[0]) for i, p in enumerate(PROMPTS)]
    server = Server(TRAINED, "--gpus", "2", "--experts", "layer", "--max-num-seqs", "2", "--max-model-len", "200",
                    "--served-model-name", "m", compiled=True)
    assert answers(server) == want
    assert "compiled the decode steps of 1 to 2 sequences" in stderr(server)
