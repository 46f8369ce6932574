"""Every bad input gives a one-line error naming the cause."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from moe import CheckpointError, MoEModel
from tests.checkpoints import ROOT, TRAINED, tiny_config, write_checkpoint


@pytest.fixture()
def sharded(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", tiny_config(), max_shard_bytes=60_000)


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_sharded_checkpoint_loads(sharded):
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    MoEModel.from_pretrained(sharded)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(tmp_path / "nowhere")
    assert "does not exist" in one_line(e) and "nowhere" in one_line(e)


def test_missing_shard(sharded):
    sorted(sharded.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(sharded)
    assert "missing" in one_line(e) and ".safetensors" in one_line(e)


def test_truncated_file(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(sharded)
    assert "truncated" in one_line(e) and shard.name in one_line(e)


def test_index_entry_outside_the_directory(sharded):
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(sharded)
    assert "outside the checkpoint directory" in one_line(e)


def test_pickle_checkpoint_is_refused_with_a_conversion_hint(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config().to_hf()))
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(d)
    assert "pytorch_model.bin" in one_line(e) and "safetensors" in one_line(e) and "save_pretrained" in one_line(e)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_config())
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(path)
    assert "experts.0.w1.weight" in one_line(e) and "[96, 64]" in one_line(e) and "[100, 64]" in one_line(e)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file

    path = write_checkpoint(tmp_path / "ckpt", tiny_config())
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    tensors["model.layers.1.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(path)
    assert "model.layers.1.self_attn.k_proj.weight" in one_line(e)
    tensors.pop("model.layers.1.extra.weight")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.1.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        MoEModel.from_pretrained(path)
    assert "unexpected" in one_line(e) and "model.layers.1.extra.weight" in one_line(e)


def test_prompt_errors(tmp_path):
    model = MoEModel.from_pretrained(write_checkpoint(tmp_path / "ckpt", tiny_config(max_seq_len=16)))
    with pytest.raises(ValueError) as e:
        model.generate([list(range(3, 20))])
    assert "17 tokens" in one_line(e) and "context is 16" in one_line(e)
    with pytest.raises(ValueError) as e:
        model.generate([[1, 2], []])
    assert "prompt 1 is empty" in one_line(e)
    with pytest.raises(ValueError) as e:
        model.generate([[1, 500]])
    assert "500" in one_line(e)
    for prompts, got in ((["And", [1, 2]], "a list of list and str"), ([True, 2], "a list of bool and int"),
                         (None, "NoneType"), (torch.tensor([[1, 2]]), "Tensor (a tensor of ids: pass .tolist())")):
        with pytest.raises(TypeError) as e:
            model.generate(prompts)
        assert one_line(e).endswith(f"; got {got}")


def test_one_prompt_may_be_given_alone_as_vllm_takes_it():
    """A text or a list of ids is one prompt (vLLM's `LLM.generate`, OpenAI's `prompt`); the result is a list."""
    model = MoEModel.from_pretrained(TRAINED)
    assert model.generate("And God said", max_new_tokens=4) == model.generate(["And God said"], max_new_tokens=4)
    assert model.generate([1, 5, 9], max_new_tokens=4) == model.generate([[1, 5, 9]], max_new_tokens=4)
    assert model.generate((1, 5), max_new_tokens=4) == model.generate([[1, 5]], max_new_tokens=4)


def test_cli_reports_user_errors_in_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt", str(tmp_path / "none"),
                           "--prompt", "hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_empty_prompt(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "--ckpt",
                           str(ROOT / "weights" / "tiny-random-mixtral"), "--prompt", ""],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "prompt 0 is empty" in proc.stderr and "Traceback" not in proc.stderr


def test_sizes_are_bounded_before_anything_is_allocated(tmp_path, monkeypatch):
    import json as _json
    import shutil as _shutil

    from moe.parallel.devices import check_cpu_ranks

    with pytest.raises(ValueError, match=r"^--gpus 1000: this machine runs at most 8 CPU ranks \(2 cores"):
        check_cpu_ranks(1000, 2, 24 * 1024)
    with pytest.raises(ValueError, match="runs at most 4 CPU ranks"):
        check_cpu_ranks(6, 8, 1000)  # memory for 4 interpreters only
    huge = tmp_path / "huge"
    _shutil.copytree(TRAINED, huge)
    cfg = _json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(_json.dumps(cfg | {"num_hidden_layers": 1_000_000}))
    with pytest.raises(CheckpointError, match=r"config.json: describes [\d,]+ weights \(num_hidden_layers=1000000"):
        MoEModel.from_pretrained(huge)
    with MoEModel.from_pretrained(TRAINED) as model:
        monkeypatch.setattr("moe.memory.available_mib", lambda: 1.0)  # as if the machine had 1 MiB free
        with pytest.raises(ValueError, match=r"KV cache for 2 sequence\(s\) of 1024 positions needs .* GiB free"):
            model.generate(["And God said", "In the"], max_new_tokens=5000)
        monkeypatch.undo()
        assert model.generate(["And God said"], max_new_tokens=2)  # still usable


@pytest.mark.parametrize("options, words", [
    (dict(gpus=0), "gpus must be a positive integer, got 0"),
    (dict(threads=0), "threads must be a positive integer, got 0"),
    (dict(gpus=2, threads="2"), "threads must be a positive integer, got '2'"),
    (dict(gpus=2, attention="replicated", experts="layer"), "experts='layer' (each block's experts on its owner) "
                                                            "needs attention='layer', got 'replicated'"),
])
def test_model_options_are_refused_in_one_line_before_loading(sharded, options, words):
    with pytest.raises(ValueError) as e:
        MoEModel.from_pretrained(sharded, **options)
    assert one_line(e) == words


def test_threads_on_one_rank_are_this_process_threads(sharded):
    before = torch.get_num_threads()
    try:
        MoEModel.from_pretrained(sharded, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
