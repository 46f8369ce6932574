"""gpt-oss's experts as shipped: MXFP4 blocks and scales, decoded as transformers decodes them, loaded into a model
that matches transformers' own load of the same directory, on 1 rank and on ranks that each read their share."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moe import MoEModel
from moe.bench.sizes import pack_experts_mxfp4
from moe.checkpoint.encodings import decode_mxfp4, encode_mxfp4
from tests.test_families import hf_family

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decoding_equals_transformers(dtype):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    E, R, G = 3, 85, 2  # every byte (so every pair of FP4 codes) and every finite E8M0 scale occurs
    blocks = torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (E, R, G), dtype=torch.uint8, generator=g)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, 32G, R]
    ours = decode_mxfp4(blocks.reshape(E * R, G * 16), scales.reshape(E * R, G)).to(dtype)
    assert torch.equal(ours.view(E, R, G * 32).transpose(1, 2), want)


def test_mxfp4_encoding_rounds_to_the_nearest_value():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = encode_mxfp4(w)
    back = decode_mxfp4(blocks.view(8, -1), scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)  # the group's unit
    assert ((back - w).abs() <= step).all()  # FP4 values lie at most 2 units apart (4 to 6)
    assert torch.equal(decode_mxfp4(*(t.view(8, -1) if t.dim() == 3 else t for t in encode_mxfp4(back))), back)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A gpt-oss directory laid out as gpt-oss ships: MXFP4 experts (width 96: three blocks of 32, so a tensor-
    parallel half starts inside a block), everything else in full precision, quantization_config in config.json."""
    hf = hf_family("gpt_oss", intermediate_size=96)
    path = tmp_path_factory.mktemp("gpt-oss") / "mxfp4"
    hf.save_pretrained(path)
    return pack_experts_mxfp4(path)


def test_a_shipped_mxfp4_directory_matches_transformers_load_of_it(shipped):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' MXFP4 loading needs it
    assert json.loads((shipped / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    from safetensors import safe_open
    with safe_open(shipped / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.down_proj_blocks").get_shape() == [6, 64, 3, 16]
    hf = transformers.AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval()  # dequantized
    model = MoEModel.from_pretrained(shipped)
    assert model.info.format == "hf-mxfp4"
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4
        out = hf.generate(ids[:1, :6], max_new_tokens=12, do_sample=False)[0, 6:].tolist()
    want = out[:out.index(2)] if 2 in out else out
    assert model.generate([ids[0, :6].tolist()], max_new_tokens=12)[0] == want
    # bf16: each expert's weights are transformers' bf16 decode, bit for bit
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.bfloat16)
    ours = MoEModel.from_pretrained(shipped, dtype="bfloat16", compile=False).engine.model
    for i in range(2):
        theirs, experts = hf16.model.layers[i].mlp.experts, ours.layers[str(i)].feed_forward.experts
        gate_up = theirs.gate_up_proj.transpose(1, 2)  # [E, 2F, D], gate and up rows interleaved
        assert torch.equal(experts.dense("w1"), gate_up[:, 0::2]) and torch.equal(experts.dense("w3"), gate_up[:, 1::2])
        assert torch.equal(experts.dense("w2"), theirs.down_proj.transpose(1, 2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [dict(gpus=2, experts="tensor"), dict(gpus=2, attention="tensor"),
                                    dict(gpus=3)])
def test_ranks_read_their_share_of_the_mxfp4_experts_and_give_the_one_rank_answer(shipped, layout):
    ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(4))
    prompts = [ids[0, :7].tolist()]
    with MoEModel.from_pretrained(shipped) as one:
        logits, tokens, whole = one(ids), one.generate(prompts, max_new_tokens=10), one.info.bytes_read[0]
    with MoEModel.from_pretrained(shipped, **layout) as model:
        assert (model(ids) - logits).abs().max().item() < 1e-5
        assert model.generate(prompts, max_new_tokens=10) == tokens
        read = model.info.bytes_read
    if layout.get("experts") == "tensor":
        # Each rank reads half of gate/up's rows and two of the three blocks of each down row (its columns start
        # inside the middle block); the rest of the file once, but for the routers and norms both ranks run.
        from safetensors import safe_open
        with safe_open(shipped / "model.safetensors", "pt") as f:
            experts = sum(f.get_slice(n)[:].nbytes for n in f.keys() if ".experts." in n)
        assert 0 < sum(read) - whole < 0.2 * experts, (read, whole, experts)


def test_a_quantization_not_run_is_refused_in_one_line(shipped, tmp_path):
    from moe.checkpoint.files import CheckpointError

    other = shutil.copytree(shipped, tmp_path / "gptq")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported; supported: mxfp4"):
        MoEModel.from_pretrained(other)


def test_blocks_and_scales_that_do_not_match_are_refused_in_one_line(shipped, tmp_path):
    from safetensors.torch import load_file, save_file

    other = shutil.copytree(shipped, tmp_path / "cut")
    tensors = load_file(other / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"  # [6, 64, 3]: one block short
    save_file(tensors | {name: tensors[name][..., :2].contiguous()}, other / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj_blocks is U8 \[6, 64, 3, 16\]; .*down_proj_scales \[6, 64, 2\] "
                                         r"need U8 \[6, 64, 2, 16\]"):
        MoEModel.from_pretrained(other)
