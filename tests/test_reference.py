"""One rank against Hugging Face transformers on the same random weights (invariant "the reference agrees")."""

from __future__ import annotations

import json

import pytest
import torch

from moe import MoEModel
from moe.checkpoint.formats import MISTRAL
from moe.checkpoint.writer import save_checkpoint
from tests.checkpoints import hf_model

pytestmark = pytest.mark.reference

SHAPES = {
    "gqa2-e4-k2": dict(),
    "mqa-headdim24-e3-k1": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24,
                                num_local_experts=3, num_experts_per_tok=1),
    "mha-window5-e8-k3": dict(num_key_value_heads=4, sliding_window=5, num_local_experts=8, num_experts_per_tok=3),
    "tied-e2-k2": dict(tie_word_embeddings=True, num_local_experts=2, num_experts_per_tok=2, num_hidden_layers=3),
}


def hf_greedy(hf, prompt: list[int], n: int, eos: int = 2) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(eos)] if eos in out else out


def compare(hf, ckpt_dir, tmp_path) -> None:
    model = MoEModel.from_pretrained(ckpt_dir)
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    got = model(ids)
    assert (got - want).abs().max().item() < 1e-4
    prompt = ids[0, :6].tolist()
    assert model.generate([prompt], max_new_tokens=12, temperature=0)[0] == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_mixtral_logits_and_greedy_match_transformers(shape, tmp_path):
    hf = hf_model("mixtral", **SHAPES[shape])
    hf.save_pretrained(tmp_path / "hf")
    compare(hf, tmp_path / "hf", tmp_path)


def test_dense_mistral_is_the_one_expert_case(tmp_path):
    hf = hf_model("mistral", sliding_window=None)
    hf.save_pretrained(tmp_path / "hf")
    compare(hf, tmp_path / "hf", tmp_path)


@pytest.mark.parametrize("kind", ["mixtral", "mistral"])
def test_consolidated_layout_matches_transformers(kind, tmp_path):
    """Convert the HF checkpoint to Mistral's consolidated layout (interleaved RoPE rows) and compare again."""
    hf = hf_model(kind, num_attention_heads=8, num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = MoEModel.from_pretrained(tmp_path / "hf")
    state = ours.engine.model.state_dict()
    save_checkpoint(state, ours.config, tmp_path / "consolidated", fmt=MISTRAL)
    assert (tmp_path / "consolidated" / "params.json").exists()
    compare(hf, tmp_path / "consolidated", tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_close_to_transformers(dtype, tmp_path):
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    model = MoEModel.from_pretrained(tmp_path / "hf", dtype=str(dtype).removeprefix("torch."))
    assert model.info.dtype == str(dtype).removeprefix("torch.")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.to(dtype)(ids).logits.float()
        reference32 = hf.float()(ids).logits
    got = model(ids)
    assert got.dtype == dtype
    # As close to transformers at this precision as transformers is to itself in fp32.
    assert (got.float() - want).abs().max().item() <= 2 * (want - reference32).abs().max().item() + 1e-3


PADDED_SHAPES = {
    "gqa": dict(),
    "mqa": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24, num_local_experts=3, num_experts_per_tok=1),
    "window4": dict(num_key_value_heads=4, sliding_window=4, num_experts_per_tok=3),  # shorter than every prompt
}
# Lengths 5, 31 and 12: the short prompt sits behind 26 pad slots.
PADDED_PROMPTS = [[1, 9, 33, 7, 5], [1, *range(40, 70)], [1, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.mark.parametrize("shape", PADDED_SHAPES, ids=list(PADDED_SHAPES))
def test_left_padded_batches_match_transformers_generate_with_an_attention_mask(shape, tmp_path):
    """A batch of prompts of very different lengths, left-padded, against transformers' `generate` given the
    attention mask: every step's logits (teacher-forced on transformers' tokens) and the greedy tokens."""
    from moe.generation import left_pad

    hf = hf_model("mixtral", **PADDED_SHAPES[shape])
    hf.save_pretrained(tmp_path / "hf")
    model = MoEModel.from_pretrained(tmp_path / "hf")
    tokens, pad = left_pad(PADDED_PROMPTS)
    mask = (torch.arange(tokens.shape[1])[None, :] >= pad[:, None]).long()
    steps = 10
    with torch.no_grad():  # min_new_tokens keeps EOS out of the chosen tokens; output_logits are the raw logits
        forced = hf.generate(tokens, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        greedy = hf.generate(tokens, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=2,
                             pad_token_id=0)[:, tokens.shape[1]:].tolist()
    engine, P = model.engine, tokens.shape[1]
    engine.start(len(PADDED_PROMPTS), P + steps, pad)
    logits = engine.forward_last(tokens, 0)
    for step in range(steps):
        assert (logits - forced.logits[step]).abs().max().item() < 1e-4, step
        logits = engine.forward_last(forced.sequences[:, P + step, None], P + step)
    want = [row[:row.index(2)] if 2 in row else row for row in greedy]
    assert model.generate(PADDED_PROMPTS, max_new_tokens=steps, temperature=0) == want


@pytest.mark.parametrize("experts", [4, 0], ids=["moe", "dense"])
def test_consolidated_layout_matches_an_independent_reference(experts, tmp_path):
    """A consolidated checkpoint written here tensor by tensor (not by our writer), against a forward pass written
    from Mistral's reference code that rotates the stored interleaved q/k rows as complex pairs."""
    from safetensors.torch import save_file

    from tests import mistral_reference

    D, L, H, G, Dh, F, V = 64, 2, 8, 2, 16, 96, 128
    g = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(*shape, generator=g) * 0.15  # noqa: E731
    w = {"tok_embeddings.weight": randn(V, D), "norm.weight": 1 + randn(D), "output.weight": randn(V, D)}
    for i in range(L):
        w |= {f"layers.{i}.attention_norm.weight": 1 + randn(D), f"layers.{i}.ffn_norm.weight": 1 + randn(D),
              f"layers.{i}.attention.wq.weight": randn(H * Dh, D), f"layers.{i}.attention.wk.weight": randn(G * Dh, D),
              f"layers.{i}.attention.wv.weight": randn(G * Dh, D), f"layers.{i}.attention.wo.weight": randn(D, H * Dh)}
        ffns = [f"layers.{i}.feed_forward.experts.{e}." for e in range(experts)] or [f"layers.{i}.feed_forward."]
        for f in ffns:
            w |= {f + "w1.weight": randn(F, D), f + "w2.weight": randn(D, F), f + "w3.weight": randn(F, D)}
        if experts:
            w[f"layers.{i}.feed_forward.gate.weight"] = randn(experts, D)
    params = dict(dim=D, n_layers=L, head_dim=Dh, hidden_dim=F, n_heads=H, n_kv_heads=G, norm_eps=1e-5,
                  vocab_size=V, rope_theta=10000.0)
    if experts:
        params["moe"] = {"num_experts": experts, "num_experts_per_tok": 2}
    ckpt = tmp_path / "consolidated"
    ckpt.mkdir()
    save_file(w, ckpt / "consolidated.safetensors")
    (ckpt / "params.json").write_text(json.dumps(params))
    ids = [1, 17, 33, 4, 90, 12, 5, 66, 8, 3, 21]
    want = mistral_reference.forward(ckpt, ids)
    with MoEModel.from_pretrained(ckpt) as model:
        assert model.info.format == "mistral"
        got = model(torch.tensor([ids]))[0]
    assert (got - want).abs().max().item() < 1e-4
