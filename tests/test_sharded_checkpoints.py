"""Saving from N ranks, re-sharding (plain and rank-aligned), and what a rank opens when it loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import moe.checkpoint.distributed_save as distributed_save
import moe.checkpoint.reshard as reshard_module
import moe.checkpoint.writer as writer_module
from moe import MoEModel
from moe.checkpoint.files import HF_INDEX, CheckpointError
from moe.checkpoint.reshard import reshard
from moe.parallel.placement import Placement
from tests.checkpoints import ROOT, hf_model, tiny_config, write_checkpoint

CFG = tiny_config(n_layers=3, n_experts=6, top_k=2)
IDS = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("src") / "hf", CFG, seed=5)
    return path, MoEModel.from_pretrained(path)(IDS)


def tensor_names(path) -> dict[str, set[str]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            out[f.name] = set(g.keys())
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_save_on_four_ranks_loads_on_one_and_three(source, tmp_path):
    path, want = source
    out = tmp_path / "saved"
    with MoEModel.from_pretrained(path, gpus=4) as model:
        written = model.save_pretrained(out, max_shard_size="30KB")
        held = model.info.bytes_read
    index = json.loads((out / HF_INDEX).read_text())
    files = tensor_names(out)
    assert set(index["weight_map"].values()) == set(files) and len(files) > 4
    assert sorted(f for r in written for f in r["files"]) == sorted(files)  # each file written by one rank
    for rank, r in enumerate(written):
        assert r["files"], f"rank {rank} wrote nothing"
        assert r["bytes"] <= held[rank]  # a rank writes only tensors it holds: nothing was gathered
    assert torch.equal(MoEModel.from_pretrained(out)(IDS), want)
    with MoEModel.from_pretrained(out, gpus=3) as three:
        assert (three(IDS) - want).abs().max().item() < 1e-5
    hf = pytest.importorskip("transformers").MixtralForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (hf(IDS).logits - want).abs().max().item() < 1e-4


def test_one_rank_save_loads_in_transformers(source, tmp_path):
    path, want = source
    hf = hf_model()  # skips without transformers
    MoEModel.from_pretrained(path).save_pretrained(tmp_path / "saved", max_shard_size="50KB")
    loaded = type(hf).from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        got = loaded(IDS).logits
    assert (got - want).abs().max().item() < 1e-4


def test_save_refuses_a_non_empty_directory(source, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(Exception, match="exists and is not empty"):
        MoEModel.from_pretrained(source[0]).save_pretrained(tmp_path / "taken")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rank_aligned_shards_are_opened_only_by_their_rank(source, tmp_path):
    path, want = source
    result = reshard(path, tmp_path / "aligned", 20_000, Placement.default(CFG.n_layers, CFG.n_experts, 4))
    readers = result["files"]
    assert all(len(ranks) == 1 for ranks in readers.values())  # no replicas, no tied weights: nothing shared
    with MoEModel.from_pretrained(tmp_path / "aligned", gpus=4) as model:
        assert (model(IDS) - want).abs().max().item() < 1e-5
        for rank, opened in enumerate(model.info.files_read):
            assert opened and all(readers[f] == [rank] for f in opened)


def test_shard_script_aligns_files_to_ranks(source, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "shard.py"), "--ckpt", str(source[0]), "--out",
                           str(tmp_path / "out"), "--max-shard-size", "60KB", "--gpus", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "read by rank 0" in proc.stdout and "read by rank 1" in proc.stdout
    assert torch.equal(MoEModel.from_pretrained(tmp_path / "out")(IDS), source[1])
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "shard.py"), "--ckpt", str(source[0]), "--out",
                            str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr and "Traceback" not in again.stderr


def test_shared_tensors_get_files_of_their_own(tmp_path):
    cfg = tiny_config(n_layers=2, n_experts=4, tie_embeddings=True)
    path = write_checkpoint(tmp_path / "tied", cfg)
    plan = Placement.default(cfg.n_layers, cfg.n_experts, 2)
    plan = Placement(2, 0, plan.block_ranks, 1, ((((0, 1),) + plan.expert_ranks[0][1:]), plan.expert_ranks[1]))
    readers = reshard(path, tmp_path / "aligned", None, plan)["files"]
    shared = [f for f, ranks in readers.items() if ranks == [0, 1]]
    assert len(shared) == 1  # the tied embedding (embed rank 0, head rank 1) and expert 0 of block 0 (replicated)
    names = tensor_names(tmp_path / "aligned")[shared[0]]
    assert names == {"model.embed_tokens.weight", "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                     "model.layers.0.block_sparse_moe.experts.0.w2.weight",
                     "model.layers.0.block_sparse_moe.experts.0.w3.weight"}


def test_reshard_round_trip_from_consolidated_is_exact(source, tmp_path):
    from moe.checkpoint.convert import convert_checkpoint

    path, want = source
    convert_checkpoint(path, tmp_path / "mistral", "mistral")
    reshard(tmp_path / "mistral", tmp_path / "hf", 40_000)
    reshard(tmp_path / "hf", tmp_path / "one", None)
    assert len(tensor_names(tmp_path / "hf")) > 1 and list(tensor_names(tmp_path / "one")) == ["model.safetensors"]
    assert torch.equal(MoEModel.from_pretrained(tmp_path / "hf")(IDS), want)
    assert torch.equal(MoEModel.from_pretrained(tmp_path / "one")(IDS), want)


@pytest.mark.parametrize("module", [distributed_save, reshard_module])
def test_interrupted_save_leaves_nothing_that_looks_valid(source, tmp_path, monkeypatch, module):
    calls = []

    def failing_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(tensors, filename, metadata=metadata)

    real = writer_module.save_file  # every writer writes its files through moe.checkpoint.writer.write_file
    monkeypatch.setattr(writer_module, "save_file", failing_save_file)
    with pytest.raises((OSError, CheckpointError), match="simulated"):  # a save tells every rank, as a user error
        if module is reshard_module:
            reshard(source[0], tmp_path / "out", 20_000)
        else:
            MoEModel.from_pretrained(source[0]).save_pretrained(tmp_path / "out", max_shard_size="20KB")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []  # no target, no partial directory left behind


def test_a_killed_saves_partial_directory_is_removed_by_the_next_save(source, tmp_path):
    """A save killed with SIGKILL runs no cleanup; the next save to the same place removes what it left."""
    import subprocess
    import sys

    code = ("import os, signal, moe.checkpoint.writer as w\n"
            "real = w.save_file\n"
            "def kill(*a, **k): os.kill(os.getpid(), signal.SIGKILL)\n"
            "w.save_file = kill\n"
            "from moe import MoEModel\n"
            f"MoEModel.from_pretrained({str(source[0])!r}).save_pretrained({str(tmp_path / 'out')!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9
    assert [p.name.startswith(".out.partial-") for p in tmp_path.iterdir()] == [True]  # left behind
    MoEModel.from_pretrained(source[0]).save_pretrained(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
