"""DeepSeek-V2/V3 beyond the family tests: both forms of latent attention, the latent cache's size, FP8 weights with
block scales as DeepSeek-V3 ships them (against transformers' own dequantizing load), ranks reading their share of
them, and multi-token-prediction blocks skipped."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe import MoEModel
from moe.bench.sizes import pack_linear_fp8
from tests.test_families import hf_family

pytestmark = pytest.mark.reference
IDS = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))


def saved(tmp_path, name="deepseek_v3", **overrides):
    hf = hf_family(name, **overrides)
    hf.save_pretrained(tmp_path / name)
    return hf, tmp_path / name


@pytest.mark.parametrize("name, overrides", [("deepseek_v3", {}), ("deepseek_v3", dict(rope_interleave=False)),
                                             ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1)),
                                             ("deepseek_v2", dict(topk_method="greedy", n_group=None))])
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_both_forms_of_latent_attention_match_transformers(tmp_path, name, overrides, form):
    hf, path = saved(tmp_path, name, **overrides)
    model = MoEModel.from_pretrained(path)
    for block in model.engine.model.layers.values():
        block.attention.form = form  # prompts too, where "auto" expands
    with torch.no_grad():
        assert (model(IDS) - hf(IDS).logits).abs().max().item() < 1e-4


def test_the_cache_holds_each_tokens_latent_and_rotary_key_only(tmp_path):
    _, path = saved(tmp_path)
    model = MoEModel.from_pretrained(path)
    cfg = model.config
    model.generate([IDS[0, :5].tolist()], max_new_tokens=3)
    caches = model.engine.caches.values()
    length = next(iter(caches)).k.shape[2]
    per_token = sum(c.k.nbytes + c.v.nbytes for c in caches) / length / cfg.n_layers
    assert per_token == (cfg.kv_lora_rank + cfg.head_dim) * 4  # fp32: 16 + 8 values, not 2 x 4 heads x 20
    assert per_token < 2 * cfg.n_heads * (cfg.qk_nope_dim + cfg.head_dim) * 4


def test_fp8_weights_with_block_scales_match_transformers_dequantizing_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, path = saved(tmp_path)
    pack_linear_fp8(path, block=8)  # divides every shape: transformers derives its block from the scale grid
    assert load_file(path / "model.safetensors")["model.layers.1.self_attn.kv_b_proj.weight"].dtype == \
        torch.float8_e4m3fn
    config = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)
    model = MoEModel.from_pretrained(path)
    with torch.no_grad():
        assert (model(IDS) - hf(IDS).logits).abs().max().item() < 1e-4
        out = hf.generate(IDS[:1, :6], max_new_tokens=10, do_sample=False)[0, 6:].tolist()
    assert model.generate([IDS[0, :6].tolist()], max_new_tokens=10)[0] == (out[:out.index(2)] if 2 in out else out)


def test_fp8_blocks_cut_by_a_tensors_edge_dequantize_as_transformers(tmp_path):
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "_dequantize_fp8_weight"):
        pytest.skip("this transformers has no block dequantization to compare with")
    _, path = saved(tmp_path)
    pack_linear_fp8(path, block=32)  # kv_b_proj [80, 16], o_proj [64, 48]: blocks cut by the edges
    stored = load_file(path / "model.safetensors")
    net = MoEModel.from_pretrained(path).engine.model
    for ours, theirs in ((net.layers["1"].attention.wkv_b, "kv_b_proj"), (net.layers["1"].attention.wo, "o_proj")):
        name = f"model.layers.1.self_attn.{theirs}.weight"
        want = fp8._dequantize_fp8_weight(stored[name], stored[name + "_scale_inv"], [32, 32], torch.float32)
        assert torch.equal(ours.dense("weight"), want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(gpus=2, attention="tensor"), dict(gpus=2, experts="tensor")])
def test_ranks_read_their_share_of_fp8_weights_and_give_the_one_rank_answer(tmp_path, layout):
    _, path = saved(tmp_path)
    pack_linear_fp8(path, block=32)  # a rank's heads (o_proj columns 24..48) and expert columns start mid-block
    with MoEModel.from_pretrained(path) as one:
        logits, tokens = one(IDS), one.generate([IDS[0, :6].tolist()], max_new_tokens=8)
    with MoEModel.from_pretrained(path, **layout) as model:
        assert (model(IDS) - logits).abs().max().item() < 1e-5
        assert model.generate([IDS[0, :6].tolist()], max_new_tokens=8) == tokens
        shapes = model.info.tensors_read
    sliced = "model.layers.1.self_attn.o_proj.weight" if "attention" in layout else \
        "model.layers.1.mlp.experts.0.down_proj.weight"
    assert [s for rank in shapes for s in rank.get(sliced, [])] == [[64, 24 if "attention" in layout else 16]] * 2


def test_multi_token_prediction_blocks_past_the_last_are_skipped(tmp_path):
    hf, path = saved(tmp_path)
    tensors = load_file(path / "model.safetensors")
    mtp = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    save_file(tensors | mtp | {"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, path / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    with torch.no_grad():
        assert (MoEModel.from_pretrained(path)(IDS) - hf(IDS).logits).abs().max().item() < 1e-4
    other = shutil.copytree(path, tmp_path / "no-mtp")
    (other / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="unexpected tensor"):  # not announced: refused, as any stray tensor
        MoEModel.from_pretrained(other)


def test_scales_that_do_not_fit_their_weight_are_refused_in_one_line(tmp_path):
    _, path = saved(tmp_path)
    pack_linear_fp8(path, block=32)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"  # [80, 16] in blocks of 32: [3, 1] scales
    save_file(tensors | {name: torch.ones(2, 1)}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor .*kv_b_proj.weight_scale_inv is F32 \[2, 1\]; .*kv_b_proj.weight "
                                         r"\[80, 16\] in blocks of 32 need F32 \[3, 1\]"):
        MoEModel.from_pretrained(path)


@pytest.mark.multiprocess
def test_the_shared_expert_splits_over_the_group_that_splits_the_experts(tmp_path):
    """With every expert split over the ranks that hold the tokens, the shared expert is split the same way and
    its parts join the routed experts' all-reduce: each rank reads half of it, and the answer stays 1 rank's."""
    _, path = saved(tmp_path)
    with MoEModel.from_pretrained(path) as one:
        logits = one(IDS)
    with MoEModel.from_pretrained(path, gpus=2, attention="tensor", experts="tensor") as two:
        assert (two(IDS) - logits).abs().max().item() < 1e-5
        shapes = two.info.tensors_read
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"  # [64, 32]: n_shared_experts 1 x width 32
    assert [s for rank in shapes for s in rank[name]] == [[64, 16], [64, 16]]


def test_re_sharding_an_fp8_checkpoint_is_refused_in_one_line(tmp_path):
    from moe.checkpoint.reshard import reshard

    _, path = saved(tmp_path)
    pack_linear_fp8(path, block=32)
    with pytest.raises(ValueError, match="stored quantized .FP8 with block scales., which re-sharding does not"):
        reshard(path, tmp_path / "out", 10_000)
    assert not (tmp_path / "out").exists()
