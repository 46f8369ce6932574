"""Layout and dtype conversion round trips."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe import MoEModel
from moe.checkpoint.convert import convert_checkpoint, parse_size
from tests.checkpoints import ROOT, TRAINED, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("conv") / "hf", tiny_config(n_heads=8, n_kv_heads=2, head_dim=8))


def logits(path, **kw):
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    return MoEModel.from_pretrained(path, **kw)(ids)


def test_hf_to_consolidated_to_hf_is_exact(source, tmp_path):
    convert_checkpoint(source, tmp_path / "mistral", "mistral")
    assert (tmp_path / "mistral" / "consolidated.safetensors").exists()
    convert_checkpoint(tmp_path / "mistral", tmp_path / "back", "hf", max_shard_bytes=50_000)
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    want = logits(source)
    assert torch.equal(logits(tmp_path / "mistral"), want) and torch.equal(logits(tmp_path / "back"), want)


def test_bf16_conversion_within_bf16_tolerance(source, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), "--ckpt", str(source), "--out",
                           str(tmp_path / "bf16"), "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for spelling in (None, "auto"):  # the checkpoint's own, as transformers' and vLLM's "auto"
        assert MoEModel.from_pretrained(tmp_path / "bf16", dtype=spelling).info.dtype == "bfloat16"
    for spelling, name in (("half", "float16"), ("float", "float32"), ("bf16", "bfloat16")):  # vLLM's names
        assert MoEModel.from_pretrained(tmp_path / "bf16", dtype=spelling).info.dtype == name
    with pytest.raises(ValueError, match="^unsupported dtype 'fp8'; choose one of float32, bfloat16, float16, int8$"):
        MoEModel.from_pretrained(tmp_path / "bf16", dtype="fp8")
    full = logits(source)
    half = logits(tmp_path / "bf16", dtype="float32").float()  # bf16-rounded weights, fp32 compute
    assert (half - full).abs().max().item() < 0.05 * full.abs().max().item()


def test_parse_size():
    assert parse_size("200MB") == 200_000_000 and parse_size("1.5GiB") == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="not like"):
        parse_size("lots")


def test_convert_refuses_a_non_empty_output(source, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), "--ckpt", str(source), "--out",
                           str(tmp_path / "taken")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not empty" in proc.stderr and "Traceback" not in proc.stderr


def test_interrupted_save_leaves_no_checkpoint(source, tmp_path, monkeypatch):
    import moe.checkpoint.writer as writer

    real, calls = writer.save_file, []

    def fail_on_second_shard(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", fail_on_second_shard)
    with pytest.raises(OSError, match="simulated"):
        convert_checkpoint(source, tmp_path / "out", "hf", max_shard_bytes=50_000)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too


def test_a_family_mistrals_layout_cannot_hold_is_refused_in_one_line_before_writing(tmp_path):
    from tests.test_families import hf_family

    hf_family("qwen3_moe").save_pretrained(tmp_path / "qwen3")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), "--ckpt", str(tmp_path / "qwen3"),
                           "--out", str(tmp_path / "out"), "--format", "mistral"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "qwen3_moe has no Mistral consolidated layout" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3"]  # nothing written, not even a partial directory


def test_a_consolidated_checkpoint_with_mistrals_versioned_tokenizer_reads_text(tmp_path):
    """mistral-inference downloads `tokenizer.model.v3` (SentencePiece) beside consolidated.safetensors: text
    prompts read through it give the Hugging Face directory's text, and a conversion carries it."""
    convert_checkpoint(TRAINED, tmp_path / "mistral", "mistral")
    (tmp_path / "mistral" / "tokenizer.model").rename(tmp_path / "mistral" / "tokenizer.model.v3")
    want = MoEModel.from_pretrained(TRAINED).generate(["And God said"], max_new_tokens=8, temperature=0)
    assert MoEModel.from_pretrained(tmp_path / "mistral").generate(["And God said"], max_new_tokens=8,
                                                                    temperature=0) == want
    convert_checkpoint(tmp_path / "mistral", tmp_path / "back", "hf")
    assert (tmp_path / "back" / "tokenizer.model.v3").read_bytes() == (TRAINED / "tokenizer.model").read_bytes()
    assert MoEModel.from_pretrained(tmp_path / "back").generate(["And God said"], max_new_tokens=8,
                                                                temperature=0) == want
