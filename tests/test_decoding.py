"""KV-cache decoding against full forward passes, and batches of different lengths against single prompts."""

from __future__ import annotations

import pytest
import torch

from models.kernels import native
from moe import MoEModel
from tests.checkpoints import tiny_config, write_checkpoint


@pytest.fixture(scope="module", params=[None, 4], ids=["full-attention", "window4"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m"
    write_checkpoint(path, tiny_config(sliding_window=request.param))
    return MoEModel.from_pretrained(path)


def test_incremental_decode_equals_full_forward(model):
    net = model.engine.model
    tokens = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    caches = net.make_caches(2, 12)
    with torch.inference_mode():
        steps = [net(tokens[:, :5], 0, caches)]
        steps += [net(tokens[:, i:i + 1], i, caches) for i in range(5, 12)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


def test_static_shape_decode_step_equals_the_growing_one(model):
    """`decode_step` (slot as a tensor, the whole cache read under a mask) gives the logits of the forward pass with
    the slot as an int, for left-padded prompts, past the sliding window, over a cache longer than needed."""
    from models.attention import Padding
    from moe.generation import left_pad

    net = model.engine.model
    tokens, pad = left_pad([[1, 4, 5, 6, 7, 8, 9], [1, 20, 21]])
    padding = Padding.of(pad, "cpu")
    growing, static = net.make_caches(2, 32), net.make_caches(2, 40)
    for c in static.values():  # slots past the current one hold an earlier request's keys: they must not count
        c.k.normal_()
        c.v.normal_()
    nxt = torch.tensor([[11], [12]])
    with torch.inference_mode():
        net(tokens, 0, growing, padding)
        net(tokens, 0, static, padding)
        for slot in range(7, 14):
            want = net(nxt, slot, growing, padding, last_only=True)[:, -1]
            got = net.decode_step(nxt, torch.tensor([slot]), static, padding.device_B)
            assert (got - want).abs().max().item() < 1e-5, slot
            nxt = want.argmax(-1, keepdim=True)


def test_batch_of_different_lengths_equals_each_alone(model):
    prompts = [[1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 100]]
    batched = model.generate(prompts, max_new_tokens=10, temperature=0)
    alone = [model.generate([p], max_new_tokens=10, temperature=0)[0] for p in prompts]
    assert batched == alone
    assert all(len(t) > 0 for t in batched)


def test_padded_batch_logits_equal_single_prompt_logits(model):
    engine = model.engine
    long, short = [1, 4, 5, 6, 7, 8, 9], [1, 20, 21]
    from moe.generation import left_pad
    tokens, pad = left_pad([long, short])
    engine.start(2, tokens.shape[1], pad)
    batched = engine.forward_last(tokens, 0)
    engine.start(1, len(short), torch.zeros(1, dtype=torch.long))
    alone = engine.forward_last(torch.tensor([short]), 0)
    assert (batched[1] - alone[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_padded_prompt_gets_the_bits_it_gets_alone(tmp_path, dtype):
    """Each prompt of a left-padded batch attends its own tokens by the path it takes alone, so its logits are its
    own to the bit whatever it is batched with (through the batch's masked SDPA, bf16 and int8 prompts got other
    bits than the native kernel gives them alone, and greedy tokens parted after a few)."""
    from moe.generation import left_pad

    write_checkpoint(tmp_path / "m", tiny_config(dim=128, n_heads=4, n_kv_heads=2, head_dim=32))
    model = MoEModel.from_pretrained(tmp_path / "m", dtype=dtype)
    prompts = [[1, 4, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30]]
    tokens, pad = left_pad(prompts)
    model.engine.start(3, tokens.shape[1], pad)
    batched = model.engine.forward_last(tokens, 0)
    for i, prompt in enumerate(prompts):
        model.engine.start(1, len(prompt), torch.zeros(1, dtype=torch.long))
        assert torch.equal(model.engine.forward_last(torch.tensor([prompt]), 0)[0], batched[i]), i
    alone = [model.generate([p], max_new_tokens=12, temperature=0, ignore_eos=True)[0] for p in prompts]
    assert model.generate(prompts, max_new_tokens=12, temperature=0, ignore_eos=True) == alone


@pytest.mark.skipif(not native.prompt_attention_runs(), reason="the prompt attention kernel needs AVX-512 (elsewhere "
                    "SDPA, whose rows under a mask are only close to its causal ones)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_prompt_in_chunks_gets_the_bits_of_one_call(tmp_path, dtype):
    """A prompt prefilled a chunk at a time (the server's long prompts), each chunk's queries over the keys cached
    before it, gives the logits of the prompt in one call, to the bit: the prompt kernel's rows depend on their
    position alone (before, a later chunk took the masked SDPA). With cpu_kernels="native", also in bf16 on a CPU
    with bf16 instructions, where oneDNN's products of dim 512 give a row other bits at other row counts."""
    write_checkpoint(tmp_path / "m", tiny_config(dim=512, hidden_dim=192, n_heads=8, n_kv_heads=2, head_dim=64))
    model = MoEModel.from_pretrained(tmp_path / "m", dtype=dtype, cpu_kernels="native")
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def logits(cuts: tuple[int, ...]) -> torch.Tensor:
        model.engine.start(1, 40, torch.zeros(1, dtype=torch.long))
        for a, b in zip(cuts, cuts[1:], strict=False):
            out = model.engine.forward_last(prompt[:, a:b], a)
        return out

    whole = logits((0, 40))
    for cuts in [(0, 20, 40), (0, 16, 33, 40), (0, 2, 4, 37, 40)]:
        assert torch.equal(logits(cuts), whole), cuts


def test_generation_stops_at_eos_and_at_the_token_limit(model):
    prompt = [1, 5, 9, 33]
    free = model.generate([prompt], max_new_tokens=8, temperature=0)[0]
    assert len(free) == 8
    # Make the third greedy token the EOS id: generation must stop before it.
    model_eos = model.config.eos_id
    try:
        object.__setattr__(model.config, "eos_id", free[2])
        assert model.generate([prompt], max_new_tokens=8, temperature=0)[0] == free[:free.index(free[2])]
    finally:
        object.__setattr__(model.config, "eos_id", model_eos)


def test_sampling_is_reproducible_by_seed(model):
    a = model.generate([[1, 5, 9]], max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    b = model.generate([[1, 5, 9]], max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    c = model.generate([[1, 5, 9]], max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=8)
    assert a == b and a != c


class Broadcasting:
    """A one-rank engine that shares its decisions as N ranks do (packed with the stop flag, read back)."""

    alone = False

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("stop_at", [None, 3])
def test_one_rank_decides_as_a_broadcast_would(model, stop_at):
    """Alone, a step's tokens and stop flag skip the packing N ranks broadcast: the same tokens, logprobs and
    cancellation either way."""
    from moe.generation import SamplingParams, generate_tokens

    params = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5,
                                                               logprobs=2)]
    prompts = [[1, 4, 5, 6], [1, 20, 21]]
    results = []
    for engine in (model.engine, Broadcasting(model.engine)):
        asked = []
        should_stop = None if stop_at is None else (lambda asked=asked: asked.append(1) or len(asked) > stop_at)
        results.append(generate_tokens(engine, prompts, params, (), 64, should_stop=should_stop))
    alone, shared = results
    assert model.engine.alone and alone.tokens == shared.tokens
    assert [r.logprobs for r in alone.rows] == [r.logprobs for r in shared.rows]
    assert alone.cancelled == shared.cancelled == (stop_at is not None)
    assert alone.new_tokens == (2 * stop_at if stop_at else 16)
