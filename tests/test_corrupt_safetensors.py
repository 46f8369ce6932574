"""Safetensors headers are checked as the safetensors library checks them: each bad one is a one-line
CheckpointError naming the file and the tensor, never weights read from the wrong bytes."""

from __future__ import annotations

import json
import struct

import pytest

from moe.checkpoint.files import CheckpointError, read_header


def write(path, header: object, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]}}


def test_a_good_header_reads(tmp_path):
    write(tmp_path / "x.safetensors", GOOD, bytes(16))
    infos = read_header(tmp_path / "x.safetensors")
    assert [(n, i.nbytes) for n, i in sorted(infos.items())] == [("a", 8), ("b", 8)]


@pytest.mark.parametrize("change,data,message", [
    ({"b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [4, 12]}}, 16, "tensor b: data_offsets overlaps"),
    ({"b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [12, 20]}}, 20, "tensor b: data_offsets leaves a gap"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, 16, "tensor a: malformed header entry"),
    ({"b": {"dtype": "F16", "shape": [2, 2], "data_offsets": [8, 16]}}, 12, "file is truncated"),
    ({"b": {"dtype": "F16", "shape": [1000000000, 4], "data_offsets": [8, 16]}}, 16,
     r"tensor b: data_offsets \[8, 16\] hold 8 bytes, its dtype F16 and shape \[1000000000, 4\] need 8000000000"),
    ({"b": {"dtype": "Q4", "shape": [2, 2], "data_offsets": [8, 16]}}, 16, "tensor b has unknown dtype 'Q4'"),
    ({"b": {"dtype": "F16", "shape": "2x2", "data_offsets": [8, 16]}}, 16, "tensor b: malformed header entry"),
    ({}, 20, "4 bytes after the last tensor"),
])
def test_corrupt_headers_are_refused_with_the_tensor_named(tmp_path, change, data, message):
    path = tmp_path / "x.safetensors"
    write(path, GOOD | change, bytes(data))
    with pytest.raises(CheckpointError, match=message) as e:
        read_header(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_a_header_that_is_not_an_object(tmp_path):
    write(tmp_path / "x.safetensors", [1, 2], b"")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_header(tmp_path / "x.safetensors")


def test_a_malformed_index_and_a_malformed_header_in_a_checkpoint(tmp_path):
    import shutil

    from moe import MoEModel
    from tests.checkpoints import TRAINED

    index = tmp_path / "index"
    shutil.copytree(TRAINED, index)
    (index / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not a valid index \(no 'weight_map'"):
        MoEModel.from_pretrained(index)
    header = tmp_path / "header"
    shutil.copytree(TRAINED, header)
    (header / "model-00001-of-00002.safetensors").write_bytes(struct.pack("<Q", 16) + b"{not json at all")
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: corrupt safetensors header"):
        MoEModel.from_pretrained(header)
