"""N ranks against one rank ("sharding never changes the answer"), per-rank loading ("a rank reads only what it
holds"), lock-step batches ("lock-step collectives")."""

from __future__ import annotations

import pytest
import torch

from models.kernels import native
from moe import MoEModel
from moe.parallel.placement import Placement
from tests.checkpoints import tiny_config, write_checkpoint

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SHAPES = {
    # 8 experts over 3 ranks is uneven; 5 blocks over 2/3/4 ranks too.
    "5blocks-8experts": tiny_config(n_layers=5, n_experts=8, top_k=2),
    # Fewer blocks than ranks; tied embeddings (head rank reads the embedding); a sliding window.
    "2blocks-6experts-tied": tiny_config(n_layers=2, n_experts=6, top_k=3, tie_embeddings=True, sliding_window=6),
}
PROMPTS = [[1, 5, 9, 33, 7], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 100]]


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", SHAPES[request.param], seed=3)
    model = MoEModel.from_pretrained(path)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    return path, ids, model(ids), model.generate(PROMPTS, max_new_tokens=12, temperature=0)


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    """The same bits where our CPU kernels compute every product (they sum each row in one order, whatever the batch or
    the kernel: models/kernels/csrc/row_dot.h) and where no expert is split over ranks (a token's copies computed on
    several ranks are added in one rank's order, however many: moe/parallel/gather.py); within rounding otherwise."""
    if exact and native.prompts():
        assert torch.equal(got, want), (got - want).abs().max().item()
    else:
        assert (got - want).abs().max().item() < 1e-5


def check_same_as_one_rank(reference, **kwargs) -> MoEModel:
    path, ids, logits, tokens = reference
    model = MoEModel.from_pretrained(path, **kwargs)
    with model:
        assert_same_logits(model(ids), logits)
        assert model.generate(PROMPTS, max_new_tokens=12, temperature=0) == tokens
    return model


@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_n_ranks_give_the_one_rank_answer(reference, gpus):
    check_same_as_one_rank(reference, gpus=gpus)


@pytest.mark.parametrize("gpus", [2, 4])
def test_replicated_attention_gives_the_one_rank_answer(reference, gpus):
    # 3 prompts over 4 ranks: one rank has no sequence and still takes part in every exchange.
    model = check_same_as_one_rank(reference, gpus=gpus, attention="replicated")
    names = set(model.info.rank_params[gpus - 1])
    assert {"tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight"} <= names  # dense on every rank


@pytest.mark.parametrize(("gpus", "experts"), [(2, "expert"), (3, "expert"), (2, "tensor")])
def test_a_lone_sequence_run_on_every_rank_gives_the_one_rank_answer(reference, gpus, experts):
    # Fewer sequences than ranks with replicated attention: every rank runs every sequence (one collective per
    # block), and the answer is the one rank's.
    path = reference[0]
    ids = reference[1][:1]
    one = MoEModel.from_pretrained(path)
    want, want_tokens = one(ids), one.generate(PROMPTS[:1], max_new_tokens=12, temperature=0)
    with MoEModel.from_pretrained(path, gpus=gpus, attention="replicated", experts=experts) as model:
        # Split experts: each rank's partial sum over its slice, added across ranks.
        assert_same_logits(model(ids), want, exact=experts == "expert")
        assert model.generate(PROMPTS[:1], max_new_tokens=12, temperature=0) == want_tokens
        assert model.generate(PROMPTS[:gpus], max_new_tokens=12, temperature=0)[:1] == want_tokens  # split again


def test_non_default_placement_gives_the_one_rank_answer(reference, tmp_path):
    cfg = SHAPES["5blocks-8experts"] if "5blocks" in str(reference[0]) else SHAPES["2blocks-6experts-tied"]
    L, E = cfg.n_layers, cfg.n_experts
    # Embedding on rank 2, head on rank 0, blocks in reverse rank order, experts scattered and uneven.
    plan = Placement(3, 2, tuple((L - 1 - i) % 3 for i in range(L)), 0,
                     tuple(tuple(((e * 7 + i) % 3,) for e in range(E)) for i in range(L)))
    plan.save(tmp_path / "plan.json")
    check_same_as_one_rank(reference, gpus=3, placement=tmp_path / "plan.json")


@pytest.mark.parametrize("exchange", ["gather", "all-to-all"])
def test_both_exchanges_give_the_one_rank_answer_with_replicated_experts(reference, tmp_path, exchange):
    """Forced either way for prefill and decode alike; every expert on two of three ranks, so the replica a copy
    goes to is chosen by the rank that routed it and must be computed exactly once."""
    cfg = SHAPES["5blocks-8experts"] if "5blocks" in str(reference[0]) else SHAPES["2blocks-6experts-tied"]
    L, E = cfg.n_layers, cfg.n_experts
    plan = Placement(3, 0, tuple(i % 3 for i in range(L)), 1,
                     tuple(tuple(tuple(sorted({(e + i) % 3, (e + i + 1) % 3})) for e in range(E)) for i in range(L)))
    plan.save(tmp_path / "plan.json")
    model = check_same_as_one_rank(reference, gpus=3, placement=tmp_path / "plan.json", exchange=exchange)
    assert model.info.exchange == exchange


def test_gathered_decode_with_replicated_attention_and_an_idle_rank(reference):
    # 3 prompts over 4 ranks: rank 3 has no sequence; it still brings its (empty) rows to every gather.
    check_same_as_one_rank(reference, gpus=4, attention="replicated", exchange="gather")


def test_each_rank_holds_only_its_tensors(reference):
    path = reference[0]
    cfg = MoEModel.from_pretrained(path).config
    plan = Placement.default(cfg.n_layers, cfg.n_experts, 3)
    with MoEModel.from_pretrained(path, gpus=3) as model:
        rank_params = model.info.rank_params
        bytes_read = model.info.bytes_read
    for rank, names in enumerate(rank_params):
        expected = set()
        if rank == plan.embed_rank:
            expected.add("tok_embeddings.weight")
        if rank == plan.head_rank:
            expected |= {"norm.weight", "output.weight"}
        for i in range(cfg.n_layers):
            expected |= {f"layers.{i}.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")}
            if plan.block_ranks[i] == rank:
                expected |= {f"layers.{i}.{n}.weight" for n in ("attention_norm", "ffn_norm", "attention.wq",
                                                                 "attention.wk", "attention.wv", "attention.wo",
                                                                 "feed_forward.gate")}
        assert set(names) == expected, f"rank {rank}"
    # Every stored tensor is read by exactly one rank (a tied embedding by the embedding's and the head's).
    full = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    tied = cfg.vocab_size * cfg.dim * 4 if cfg.tie_embeddings and plan.embed_rank != plan.head_rank else 0
    assert abs(sum(bytes_read) - tied - full) < 64 * 1024  # headers are the only difference


def test_bf16_ranks_that_run_their_experts_one_by_one_give_the_one_rank_answer(tmp_path):
    """A gathered step brings every rank's rows to every rank, so past the grouped call's rows (32) a rank runs its
    experts one by one while 1 rank, with half the rows, runs them grouped. Where bf16 prompts do not run the prompt
    kernel (a CPU with bf16 instructions), an expert with more than 8 rows then ran oneDNN: other bits than 1
    rank's streaming kernel. One prompt of 16 tokens, 2 experts a token of 2: 32 copies on 1 rank, 64 gathered on
    2, 16 rows an expert; products wide enough that fp32 sums in another order round to other bf16 values."""
    cfg = tiny_config(n_layers=2, n_experts=2, top_k=2, dim=512, hidden_dim=1792, head_dim=64)
    path = write_checkpoint(tmp_path / "ckpt", cfg, seed=5)
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with MoEModel.from_pretrained(path, dtype="bfloat16") as one:
        want = one(ids)
    with MoEModel.from_pretrained(path, dtype="bfloat16", gpus=2, exchange="gather") as model:
        assert_same_logits(model(ids), want)


def test_bf16_copies_computed_on_several_ranks_give_the_one_rank_bits(tmp_path):
    """3 experts a token, in bf16: where a token's copies ran on several ranks, each rank summed its own and the
    partial sums were added over ranks, another order of roundings than one rank's (logits 0.03 apart). Prompt rows
    (all-to-all), decode-sized rows (gathered), one sequence on every rank (replicated attention), and experts placed
    out of their ids' order, whose copies come back in slot order."""
    cfg = SHAPES["2blocks-6experts-tied"]
    path = write_checkpoint(tmp_path / "ckpt", cfg, seed=3)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with MoEModel.from_pretrained(path, dtype="bfloat16") as one:
        want = [one(ids), one(ids[:, :4]), one(ids[:1, :4])]
        scores = [o.logprobs for o in one.generate(PROMPTS, max_new_tokens=6, temperature=0, logprobs=0)]
    interleaved = Placement(2, 0, (0, 1), 1, (tuple((e % 2,) for e in range(cfg.n_experts)),) * cfg.n_layers)
    for layout in [dict(gpus=3), dict(gpus=2, attention="replicated"), dict(gpus=2, placement=interleaved)]:
        with MoEModel.from_pretrained(path, dtype="bfloat16", **layout) as model:
            for got, expected in zip([model(ids), model(ids[:, :4]), model(ids[:1, :4])], want, strict=True):
                assert_same_logits(got, expected)
            # prompts of several lengths, left-padded (replicated attention: each rank its own, padded again)
            outs = model.generate(PROMPTS, max_new_tokens=6, temperature=0, logprobs=0)
            assert [o.logprobs for o in outs] == scores, layout

