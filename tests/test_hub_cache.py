"""A Hugging Face hub cache snapshot (`snapshots/<rev>/` of symlinks into `../../blobs/`) loads like a plain
directory; a symlink leaving the cache repository is still refused."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from moe import MoEModel
from moe.checkpoint.files import CheckpointError
from tests.checkpoints import ROOT, TRAINED

IDS = torch.tensor([[1, 415, 1077, 300]])


def hub_layout(src, root):
    """Lay `src` out as huggingface_hub does: blobs named by content hash, a snapshot of relative symlinks."""
    repo = root / "models--austen--tiny-moe"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for f in sorted(src.iterdir()):
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blobs / digest)
            (snapshot / f.name).symlink_to(os.path.join("..", "..", "blobs", digest))
    return snapshot


def test_snapshot_of_symlinks_loads_like_the_directory(tmp_path):
    snapshot = hub_layout(TRAINED, tmp_path)
    assert (snapshot / "model.safetensors.index.json").is_symlink()
    with MoEModel.from_pretrained(TRAINED) as plain, MoEModel.from_pretrained(snapshot) as cached:
        assert torch.equal(cached(IDS), plain(IDS))
        assert cached.generate(["And God said"], max_new_tokens=8) == plain.generate(["And God said"], max_new_tokens=8)


@pytest.mark.multiprocess
def test_snapshot_loads_on_two_ranks(tmp_path):
    snapshot = hub_layout(TRAINED, tmp_path)
    with MoEModel.from_pretrained(TRAINED) as plain, MoEModel.from_pretrained(snapshot, gpus=2) as cached:
        assert torch.equal(cached(IDS), plain(IDS))


def test_symlink_out_of_the_cache_repository_is_refused(tmp_path):
    snapshot = hub_layout(TRAINED, tmp_path / "cache")
    outside = tmp_path / "elsewhere.safetensors"
    shard = snapshot / "model-00001-of-00002.safetensors"
    shutil.copyfile(shard.resolve(), outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory .*outside its hub cache"):
        MoEModel.from_pretrained(snapshot)


def test_symlink_out_of_a_plain_directory_is_refused(tmp_path):
    plain = tmp_path / "ckpt"
    shutil.copytree(TRAINED, plain)
    moved = tmp_path / "moved.safetensors"
    (plain / "model-00002-of-00002.safetensors").rename(moved)
    (plain / "model-00002-of-00002.safetensors").symlink_to(moved)
    with pytest.raises(CheckpointError, match="'model-00002-of-00002.safetensors' points outside the checkpoint"):
        MoEModel.from_pretrained(plain)


def test_a_repository_id_is_read_from_the_local_cache_as_transformers_reads_it(tmp_path, monkeypatch):
    """`org/name` where no such directory is: the cache's `main` snapshot, the one transformers (offline) loads,
    by the API and the commands; the server names it as vLLM does. Absent from the cache: one line, no download."""
    transformers = pytest.importorskip("transformers")
    import huggingface_hub

    from moe.checkpoint.files import checkpoint_name

    snapshot = hub_layout(TRAINED, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    theirs = transformers.AutoModelForCausalLM.from_pretrained("austen/tiny-moe", cache_dir=tmp_path,
                                                              local_files_only=True)
    with MoEModel.from_pretrained("austen/tiny-moe") as ours:
        assert ours.checkpoint_dir.resolve() == snapshot.resolve()
        assert torch.allclose(ours(IDS), theirs(IDS).logits, atol=1e-4)
    assert checkpoint_name(snapshot) == "austen/tiny-moe" and checkpoint_name(TRAINED) == TRAINED.name
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", "austen/tiny-moe",
                           "--prompt", "And God said", "--max-new-tokens", "4"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "And God said" in done.stdout, done.stderr
    with pytest.raises(CheckpointError, match="^austen/other: no such directory, and the Hugging Face cache .* holds "
                                              "no snapshot of that repository; nothing is downloaded here"):
        MoEModel.from_pretrained("austen/other")


@pytest.mark.parametrize("name, says", [("model.gguf", "a GGUF file (llama.cpp's), not a checkpoint directory"),
                                        ("config.json", "a file, not a checkpoint directory")])
def test_a_file_given_for_the_directory_is_named_so(tmp_path, name, says):
    (tmp_path / name).write_text("{}")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / name}: {re.escape(says)}; give the directory"):
        MoEModel.from_pretrained(tmp_path / name)
