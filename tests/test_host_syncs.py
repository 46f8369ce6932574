"""Host syncs per decode step (invariant "one code path on every device"): at most one per MoE block on every
rank (the exchange's split sizes, reused for the local experts' counts) and at most two per step for the
sampled tokens. Counted by what each call is (`moe.bench.syncs`), so a CPU run checks what a GPU would pay:
`cpu_kernels="torch"` runs the experts one by one, as a GPU does; the CPU's streaming kernel (the default) reads
the counts inside the kernel, so its steps sync only for the tokens (and an all-to-all's split sizes)."""

from __future__ import annotations

import pytest
import torch

from models.kernels import native
from moe import MoEModel
from moe.bench.collectives import count_decode_step
from moe.bench.syncs import HostSyncCounter
from moe.generation import SamplingParams, generate_tokens
from tests.checkpoints import SHIPPED

PROMPTS = [[1, 15, 27, 99, 7], [1, 300, 41, 8, 8]]  # equal lengths: decode steps only, no padding rows


def syncs_per_decode_step(engine, steps=(4, 12)) -> float:
    """Syncs of a run of `steps[1]` new tokens minus one of `steps[0]`, per extra step: the decode step alone."""
    totals = []
    for n in steps:
        with HostSyncCounter() as counter:
            generate_tokens(engine, PROMPTS, SamplingParams(n, 0.0, 1.0, 0, 0), (), 10**6)
        totals.append(counter.total)
    return (totals[1] - totals[0]) / (steps[1] - steps[0])


def test_one_rank_decode_step_syncs_once_per_block_and_once_for_the_tokens():
    model = MoEModel.from_pretrained(SHIPPED, cpu_kernels="torch")
    per_step = syncs_per_decode_step(model.engine)
    blocks = model.config.n_layers
    assert per_step <= blocks + 2
    assert per_step == blocks + 1  # exactly: the experts' counts in each block, and the sampled tokens


@pytest.mark.skipif(not native.available(), reason="the streaming kernel could not be built")
def test_one_rank_streamed_decode_step_syncs_only_for_the_tokens():
    assert syncs_per_decode_step(MoEModel.from_pretrained(SHIPPED).engine) == 1


@pytest.mark.multiprocess
def test_two_rank_decode_step_syncs_once_per_block_on_every_rank():
    for rank, got in enumerate(count_decode_step(str(SHIPPED), 2, kernels="torch")):
        # Every rank enters every block's exchange (the experts' counts: one sync each), plus the shared tokens.
        assert got["syncs"] <= got["blocks"] + 2, (rank, got)
        assert got["syncs"] == got["blocks"] + 1, (rank, got)


def test_the_counter_sees_what_would_block_on_a_gpu():
    t = torch.arange(6)
    with HostSyncCounter() as c:
        t.tolist(), t[t > 2], torch.bincount(t), t.repeat_interleave(t), int(t[0])
        t.repeat_interleave(t, output_size=15), t[1:3], t + 1, t.to(torch.float32), t.cpu()  # none of these
    assert c.by_call == {"tolist": 1, "__getitem__": 1, "bincount": 1, "repeat_interleave": 1, "__int__": 1}


@pytest.mark.multiprocess
@pytest.mark.parametrize("exchange", ["auto", "all-to-all"])
def test_two_rank_decode_step_makes_two_collectives_per_block_when_gathering(exchange):
    for rank, got in enumerate(count_decode_step(str(SHIPPED), 2, exchange, kernels="torch")):
        calls, blocks = got["calls"], got["blocks"]
        if exchange == "auto":  # decode gathers: an all-gather and a reduce-scatter per block, nothing else
            assert calls["all_gather"] == calls["reduce_scatter"] == blocks, (rank, calls)
            assert calls.get("all_to_all", 0) == 0
        else:  # counts, rows out, rows back
            assert calls["all_to_all"] == 3 * blocks, (rank, calls)
        assert calls["broadcast"] == 1  # the sampled tokens
        assert got["collectives"] == (2 if exchange == "auto" else 3) * blocks + 1
        assert got["syncs"] == blocks + 1  # the local experts' counts, and the tokens


@pytest.mark.multiprocess
def test_a_lone_sequence_with_replicated_attention_makes_one_collective_per_block():
    """Every rank runs the sequence: no rows to move, the experts' partial sums summed by one all-gather."""
    dim = MoEModel.from_pretrained(SHIPPED).config.dim
    for rank, got in enumerate(count_decode_step(str(SHIPPED), 2, strategy="replicated/expert", kernels="torch",
                                                 sequences=1)):
        calls, blocks = got["calls"], got["blocks"]
        assert calls == {"all_gather": blocks, "broadcast": 1}, (rank, calls)  # no gather of the logits either
        assert got["syncs"] == blocks + 1  # the local experts' counts (torch kernels), and the token
        # each rank sends its [1, dim] fp32 partial sum per block; the head's rank also the token and stop flag
        assert got["bytes_per_token"] - blocks * dim * 4 == (16 if rank == 0 else 0), (rank, got)


@pytest.mark.multiprocess
def test_tensor_parallel_decode_step_makes_one_all_reduce_for_attention_and_one_for_experts():
    """vLLM's layout on 2 ranks: no exchange, no point-to-point move, every size fixed."""
    dim = MoEModel.from_pretrained(SHIPPED).config.dim
    for rank, got in enumerate(count_decode_step(str(SHIPPED), 2, strategy="tensor/tensor", kernels="torch")):
        calls, blocks = got["calls"], got["blocks"]
        # per block one for the heads, one for the experts; per step one for the embedding (each rank its half of
        # the vocabulary) and the sampled tokens' broadcast
        assert calls["all_reduce"] == 2 * blocks + 1 and calls.get("send", 0) == 0, (rank, calls)
        assert got["collectives"] == 2 * blocks + 2
        assert got["syncs"] == blocks + 1  # the local experts' counts (torch kernels), and the tokens
        # a ring all-reduce of 2 ranks sends half the tensor twice: [1 token, dim] fp32 per all-reduce and token;
        # the head's rank also broadcasts the step's tokens and stop flag (3 int64 for 2 tokens)
        assert got["bytes_per_token"] - (2 * blocks + 1) * dim * 4 == (12 if rank == 1 else 0), (rank, got)


@pytest.mark.multiprocess
def test_a_pipeline_decode_step_makes_no_collective_inside_a_block():
    """Whole blocks on their owners (experts `layer`): per step one hand-off of the hidden states where the owner
    changes (a broadcast within the pair) and the sampled tokens' broadcast; nothing per block."""
    dim = MoEModel.from_pretrained(SHIPPED).config.dim
    for rank, got in enumerate(count_decode_step(str(SHIPPED), 2, strategy="layer/layer", kernels="torch")):
        assert got["calls"] == {"broadcast": 2}, (rank, got)
        assert got["syncs"] == got["blocks"] // 2 + 1  # its own blocks' expert counts (torch kernels), the tokens
        # rank 0 hands on [2 tokens, dim] fp32 per step; rank 1 broadcasts the tokens and stop flag (3 int64)
        assert got["bytes_per_token"] == (dim * 4 if rank == 0 else 12), (rank, got)
