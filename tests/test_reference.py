"""One rank against Hugging Face transformers on the same random weights (invariant "the reference agrees")."""

from __future__ import annotations

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
