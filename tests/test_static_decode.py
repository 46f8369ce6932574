"""The decode step with static shapes: experts grouped with offsets on the device (no host read per block), the
whole 1-rank step compiled with `fullgraph=True`, and the same path on 2 ranks behind the gathering exchange."""

from __future__ import annotations

import json

import pytest
import torch

from models.kernels.choice import choose
from models.mixture import GroupedExperts
from moe import MoEModel
from moe.bench.syncs import HostSyncCounter
from moe.generation import SamplingParams, generate_tokens
from moe.parallel.distributed import init_process_group
from moe.parallel.placement import Placement
from moe.workers.group import run_ranks
from moe.workers.rank import ShardSpec, load_shard
from tests.checkpoints import SHIPPED

PROMPTS = [[1, 15, 27, 99, 7], [1, 300, 41, 8, 8]]


def offsets_on_device(model: torch.nn.Module) -> None:
    """What a bf16 model on CUDA does by itself; forced here to run the same path on the CPU."""
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            assert m.stacks is not None  # dense kernels keep the stacked weights
            m.offsets_on_device = True


@torch.inference_mode()
def test_grouped_experts_match_the_per_expert_loop():
    torch.manual_seed(0)
    experts = GroupedExperts(32, 48, [0, 1, 2, 3])
    for p in experts.parameters():
        p.data.normal_(0, 0.2)
    experts.prepare_weights(choose("torch", "cpu", torch.float32))
    x = torch.randn(9, 32)
    counts = torch.tensor([3, 0, 4, 1])  # 8 rows for these experts; the 9th is for none of them
    experts.offsets_on_device = True
    got = experts(x, counts)
    experts.offsets_on_device = False
    want = experts(x[:8], counts.tolist())
    assert torch.allclose(got[:8], want, atol=1e-5) and got[8].eq(0).all()


def test_one_rank_decode_step_reads_nothing_on_the_host_per_block():
    with MoEModel.from_pretrained(SHIPPED, cpu_kernels="torch") as model:
        engine = model.engine
        want = model.generate(PROMPTS, max_new_tokens=10)
        offsets_on_device(engine.model)
        assert model.generate(PROMPTS, max_new_tokens=10) == want
        engine.start(2, 16, torch.zeros(2, dtype=torch.long))
        engine.forward_last(torch.tensor(PROMPTS), 0)
        with HostSyncCounter() as syncs:
            engine.forward_last(torch.tensor([[5], [6]]), 5)
        assert syncs.total == 0, syncs.by_call


def test_one_rank_decode_step_compiles_as_one_graph():
    with MoEModel.from_pretrained(SHIPPED, dtype="bfloat16", cpu_kernels="torch") as model:
        transformer = model.engine.model
        offsets_on_device(transformer)
        caches = transformer.make_caches(2, 16)
        prompt = torch.tensor(PROMPTS)
        with torch.inference_mode():
            transformer(prompt, 0, caches)
            token = torch.tensor([[5], [6]])
            eager = transformer(token, 5, caches, last_only=True)
            step = torch.compile(lambda t: transformer(t, 5, caches, last_only=True), fullgraph=True, dynamic=False)
            compiled = step(token)  # writes the same keys and values at slot 5 again
        assert (compiled.float() - eager.float()).abs().max().item() < 0.05  # bf16: fused kernels round differently
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def _decode_on_rank(rank: int, world_size: int, port: int, out: str) -> None:
    dist = init_process_group(rank, world_size, "127.0.0.1", port)
    cfg = MoEModel.from_pretrained(SHIPPED).config
    plan = Placement.default(cfg.n_layers, cfg.n_experts, world_size)
    engine, _ = load_shard(ShardSpec(str(SHIPPED), "float32", plan.to_json(), cpu_kernels="torch",
                                     exchange="gather"), dist)
    offsets_on_device(engine.model)
    runs = []
    for n in (4, 12):
        with HostSyncCounter() as syncs:
            result = generate_tokens(engine, PROMPTS, SamplingParams(n, 0.0, 1.0, 0, 0), (), 10**6)
        runs.append(syncs.total)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"syncs_per_step": (runs[1] - runs[0]) / 8, "tokens": result.tokens}, f)
    dist.destroy()


@pytest.mark.multiprocess
def test_two_rank_gathered_decode_with_device_offsets_reads_only_the_tokens(tmp_path):
    want = MoEModel.from_pretrained(SHIPPED).generate(PROMPTS, max_new_tokens=12)
    run_ranks(_decode_on_rank, 2, str(tmp_path))
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["syncs_per_step"] == 1, (rank, got)  # the shared tokens; nothing per block
        assert got["tokens"] == want
