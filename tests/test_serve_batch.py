"""The server's engine loop without HTTP: sequences that join at different steps, wait for a slot, outgrow the
cache's end (every row moves left) or arrive with prompts longer than a step's budget (prefilled in chunks while
the others decode) get the tokens `generate` gives each alone, also where the RoPE angles depend on each
sequence's length. The latency histograms of /metrics count as Prometheus's do; SIGTERM's handler, which runs on the
engine loop's thread between any two of its lines, never waits for a lock that thread holds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from models.kernels import native, onednn
from moe import MoEModel
from moe.generation import SamplingParams
from moe.serve.engine_loop import EngineLoop
from moe.serve.metrics import Metrics
from moe.serve.scheduler import QueueFull, Request, Scheduler
from tests.checkpoints import TRAINED

PROMPTS = ["It is a truth universally acknowledged, that", "And God said", "Emma Woodhouse, handsome, clever, and rich",
           "The", "In the beginning God created the heaven and the earth. And the earth was"]


class Arrivals(Scheduler):
    """Request i arrives before step `at[i]`; once all have ended, the loop is told to stop."""

    def __init__(self, model, requests: list[Request], at: list[int], slots: int) -> None:
        super().__init__(slots, 16, 512, model.eos_ids, model.tokenizer, Metrics())
        self.pending, self.at, self.steps = list(requests), list(at), 0

    def plan(self, idle_wait: float = 1.0):
        while self.pending and self.at[0] <= self.steps:
            self.submit(self.pending.pop(0))
            self.at.pop(0)
        if not self.pending and not self.running and not self.waiting:
            self.drain(0)
        self.steps += 1
        return super().plan(idle_wait=0)


@pytest.fixture(scope="module")
def model():
    with MoEModel.from_pretrained(TRAINED) as m:
        yield m


@pytest.mark.parametrize("slots, length, chunk", [(4, 256, 2048), (2, 256, 2048), (4, 40, 2048), (4, 256, 3),
                                                  (2, 40, 4)], ids=["plain", "two-slots", "left-moves",
                                                                    "chunked", "all"])
def test_joined_sequences_get_their_solo_tokens(model, slots, length, chunk):
    assert_solo_tokens(model, slots, length, chunk)


@pytest.mark.skipif(not native.available(), reason=f"the project's kernels did not build: {native.why_unavailable()}")
@pytest.mark.parametrize("chunk", [2048, pytest.param(4, marks=pytest.mark.skipif(
    not native.prompt_attention_runs(), reason="a later chunk's bits: the prompt attention kernel (AVX-512)"))],
    ids=["joins", "chunked"])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_joined_sequences_get_their_solo_tokens_in_bf16_and_int8(dtype, chunk):
    """Joining prompts are prefilled as one padded batch ending at the running rows' clock, and long ones a chunk a
    step: each attends its own tokens as alone (`Attention.attend_alone`; a later chunk over its cached keys, with
    the bits of the prompt in one call), so a sampled one draws its solo tokens in bf16 and int8 too (before, the
    masked SDPA of a join's prefill or of a later chunk gave other bits than the native kernel alone). "native": a
    bf16 row's bits are its own whatever its product's row count, on CPUs with bf16 instructions too."""
    with MoEModel.from_pretrained(TRAINED, dtype=dtype, cpu_kernels="native") as model:
        assert_solo_tokens(model, slots=4, length=256, chunk=chunk)


@pytest.mark.skipif(not native.available(), reason=f"the project's kernels did not build: {native.why_unavailable()}")
@pytest.mark.skipif(not onednn.native_bf16(), reason="oneDNN runs bf16 products only on a CPU with bf16 instructions")
def test_where_prompts_run_a_product_whose_bits_follow_its_row_count_joining_prompts_are_prefilled_apart(monkeypatch):
    """bf16 prompts on a CPU with AMX or AMD's bf16 instructions run oneDNN, whose bits for a row change with the
    product's row count; here its products are made so (a row's result scaled by its product's row count), and the
    two prompts that join together at the first step still draw their solo tokens: each is prefilled in a call of
    its own. Before, they were one padded batch, with other row counts than either has alone."""
    real = onednn.linear

    def by_row_count(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = real(x, weight)
        return out * (1 + 2**-4 * ((x.numel() // x.shape[-1]) % 3))

    monkeypatch.setattr(onednn, "fast_bf16", lambda: True)
    monkeypatch.setattr(onednn, "linear", by_row_count)
    with MoEModel.from_pretrained(TRAINED, dtype="bfloat16", compile=False) as model:
        assert model.engine.model.kernel_choice.prompts_apart
        assert_solo_tokens(model, slots=4, length=256, chunk=2048)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 2048])
def test_a_long_prompt_never_runs_one_token_alone(budget):
    """A one-token call takes a decode step's attention, whose bits are not the prompt kernel's row: the chunks
    cover the prompt, none of one token, none longer than the budget (at least 2) and the one token that avoids it."""
    from moe.serve.batch import chunk_size

    for length in range(2, 30):
        sizes, left = [], length
        while left:
            sizes.append(chunk_size(budget, left))
            left -= sizes[-1]
        assert sum(sizes) == length and min(sizes) >= 2, (length, sizes)
        assert max(sizes) <= max(budget, 2) + 1, (length, sizes)


LENGTH_DEPENDENT = {"dynamic": dict(rope_type="dynamic", factor=4.0),
                    "longrope": dict(rope_type="longrope", original_max_position_embeddings=16,
                                     short_factor=[1.0 + 0.05 * i for i in range(16)],
                                     long_factor=[1.0 + 0.5 * i for i in range(16)])}


@pytest.mark.parametrize("kind", LENGTH_DEPENDENT)
def test_rope_angles_that_depend_on_length_follow_each_sequence(kind, tmp_path):
    """Dynamic NTK and longrope turn a sequence's keys by its own length: the shipped model with the scaling past a
    16-token original context, sequences joining, moving left and arriving longer than a step's budget."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TRAINED, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config |= dict(rope_parameters=LENGTH_DEPENDENT[kind] | {"rope_theta": 1e4},
                   max_position_embeddings=16 if kind == "dynamic" else 64)
    (ckpt / "config.json").write_text(json.dumps(config))
    with MoEModel.from_pretrained(ckpt) as model:
        assert_solo_tokens(model, slots=2, length=40, chunk=4)


def assert_solo_tokens(model, slots: int, length: int, chunk: int) -> None:
    params = [SamplingParams(16 + 2 * i, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(len(PROMPTS))]
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    want = [model.generate([p], **vars_of(q))[0] for p, q in zip(ids, params, strict=True)]
    events: dict[int, list] = {i: [] for i in range(len(ids))}
    requests = [Request(p, q, events[i].append) for i, (p, q) in enumerate(zip(ids, params, strict=True))]
    scheduler = Arrivals(model, requests, at=[0, 0, 3, 5, 9], slots=slots)
    EngineLoop(model.engine, None, length, slots, scheduler, chunk).run()
    for i, w in enumerate(want):
        end = events[i][-1]
        assert end[0] == "end" and end[1].tokens == w.token_ids, i
        assert "".join(e[2] for e in events[i] if e[0] == "token") == w.text
    assert scheduler.steps > 1 and not scheduler.running


def vars_of(params: SamplingParams) -> dict:
    return dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed,
                ignore_eos=False)


def test_latency_buckets_count_every_value_at_or_under_their_edge():
    """Prometheus's histogram buckets are cumulative: `le="x"` counts the values <= x, `+Inf` all of them."""
    from moe.serve.metrics import Histogram

    h = Histogram((0.01, 0.1, 1.0))
    for value in (0.001, 0.01, 0.05, 0.1, 0.5, 7.0):
        h.observe(value)
    lines = h.lines("t", "test")
    assert [line for line in lines if line.startswith("t_bucket")] == [
        't_bucket{le="0.01"} 2', 't_bucket{le="0.1"} 4', 't_bucket{le="1.0"} 5', 't_bucket{le="+Inf"} 6']
    assert "t_count 6" in lines


class RefusingLock:
    """A lock that fails where another would wait: waited for on the thread that holds it, a lock never opens."""

    def __init__(self) -> None:
        self.inner = threading.Lock()

    def __enter__(self) -> None:
        if not self.inner.acquire(blocking=False):
            raise AssertionError("waited for a lock that is held (by this very thread, under a signal's handler)")

    def __exit__(self, *exc) -> None:
        self.inner.release()


def test_sigterm_while_the_plan_holds_the_lock_drains_at_the_next_plan():
    """A server told to stop just as a request ended (the engine loop in `plan`, its lock held) would wait forever:
    the handler waited for that lock on the thread that held it (the likely cause of a 2-rank server that once did
    not stop in a full test run)."""
    scheduler = Scheduler(2, 4, 512, (), None, Metrics())
    scheduler.lock = RefusingLock()
    before = signal.signal(signal.SIGTERM, lambda *_: scheduler.drain(5.0))  # as `moe.serve.launch` does
    try:
        with scheduler.lock:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, on this thread, before the next line
            assert scheduler.drain_asks == [5.0]
    finally:
        signal.signal(signal.SIGTERM, before)
    with pytest.raises(QueueFull, match="shutting down"):
        scheduler.submit(Request([1, 2], SamplingParams(4), lambda event: None))
    scheduler.drain(600.0)  # a second signal never lengthens the drain
    assert scheduler.plan(idle_wait=60).stop  # nothing running: it stops at once, without the idle wait
    assert scheduler.draining_until - time.monotonic() < 5.0 and not scheduler.drain_asks


def test_metrics_give_no_expert_series_for_a_dense_block():
    """A block with no experts (Qwen3-MoE's `mlp_only_layers`) has no `moe_expert_tokens_total` series."""
    metrics = Metrics()
    metrics.expert_load, metrics.dense = [[3, 1], [0, 0], [2, 2]], (1,)
    series = [line for line in metrics.text().splitlines() if line.startswith("moe_expert_tokens_total{")]
    assert series == [f'moe_expert_tokens_total{{block="{b}",expert="{e}"}} {n}'
                      for b, e, n in [(0, 0, 3), (0, 1, 1), (2, 0, 2), (2, 1, 2)]]


def test_joins_and_leaves_keep_the_running_rows_in_place(model):
    """Each block's cache rows stay in the same memory across joins and leaves: a leave moves up only the rows after
    the one that left, a join copies its rows in after the running ones. Concatenating at every join and selecting
    at every leave copied every running row's whole cache into fresh memory (130 ms a join beyond its prefill at 8
    sequences of 4096 positions, `small` bf16)."""
    import torch

    from moe.serve.batch import Row, RunningBatch

    rows = RunningBatch(model.engine, 64, seqs=3)
    params = SamplingParams(max_new_tokens=4)
    try:
        with torch.inference_mode():
            joined = [Row(i, [1, 5 + i, 9, 11 + i][: 2 + i], params) for i in range(3)]
            logits = rows.join(joined)
            rows.record(logits.argmax(-1).tolist(), rows.rows, logits.argmax(-1))
            rows.step()
            before = {name: (c.k.data_ptr(), c.k[:, :, :rows.clock].clone()) for name, c in
                      model.engine.caches.items()}
            rows.leave({0})
            assert [r.request for r in rows.rows] == [1, 2]
            for name, c in model.engine.caches.items():
                at, old = before[name]
                assert c.k.data_ptr() == at and c.k.shape[0] == 2
                assert torch.equal(c.k[:, :, :rows.clock], old[1:])
            rows.join([Row(3, [1, 5], params)])
            assert all(c.k.data_ptr() == before[name][0] and c.k.shape[0] == 3
                       for name, c in model.engine.caches.items())
    finally:
        model.engine.caches, model.engine.padding, model.engine.exact_caches = None, None, False
