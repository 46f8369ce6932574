"""The safetensors files of a checkpoint directory: which tensor lies in which file, with its dtype and shape.

Only headers are read here (a few KB per file); tensor data stays on disk until a rank asks for it.
Every check that can fail on bad input raises `CheckpointError` with a one-line message naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
HF_INDEX = "model.safetensors.index.json"
CONVERT_HINT = ("convert it to safetensors first, e.g. with transformers: "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) (writes safetensors by default)")


class CheckpointError(ValueError):
    """A checkpoint cannot be read; the message names the file or tensor and the cause."""


# What a checkpoint keeps beside its weights and a save or a conversion carries over as it is: the tokenizer of
# either kind with its settings and chat template (transformers reads vocab.json and merges.txt when tokenizer.json
# is missing), and the generation defaults.
BESIDE_WEIGHTS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                  "generation_config.json")


def beside_weights(directory: str | Path | None) -> list[Path]:
    """The files of `BESIDE_WEIGHTS` that `directory` holds, and Mistral's versioned `tokenizer.model.vN`."""
    if directory is None:
        return []
    d = Path(directory)
    return [d / name for name in BESIDE_WEIGHTS if (d / name).is_file()] + mistral_tokenizers(d)


def mistral_tokenizers(directory: Path) -> list[Path]:
    """`tokenizer.model.v1`, `.v3`, ... in `directory` (SentencePiece, as mistral-inference downloads them), oldest
    first."""
    found = [f for f in directory.glob("tokenizer.model.v*") if f.name.rpartition(".v")[2].isdigit() and f.is_file()]
    return sorted(found, key=lambda f: int(f.name.rpartition(".v")[2]))


# Bytes per element of each safetensors dtype code (the library's own list).
ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors code: F32, BF16, F16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that the file holds all the bytes it promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: file is truncated (shorter than a safetensors header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > 100_000_000:
                raise CheckpointError(f"{path}: file is truncated or not safetensors (header of {header_len} bytes)")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos = {name: tensor_info(path, name, entry, 8 + header_len) for name, entry in header.items()}
    check_layout(path, infos, 8 + header_len, size)
    return infos


def tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    """One header entry, checked as the safetensors library checks it: a known dtype, a shape of
    non-negative integers, offsets 0 <= begin <= end whose span is exactly dtype size x elements."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: tensor {name}: malformed header entry {json.dumps(entry)[:120]}")
    if dtype not in ITEM_SIZES:
        raise CheckpointError(f"{path}: tensor {name} has unknown dtype {dtype!r}")
    need = ITEM_SIZES[dtype]
    for d in shape:
        need *= d
    if end < begin or end - begin != need:
        raise CheckpointError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                              f"its dtype {dtype} and shape {list(shape)} need {need}")
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, end - begin)


def check_layout(path: Path, infos: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """Tensors tile the data section in order from its start, without gaps or overlaps, to the end of the file
    (what the safetensors library requires too)."""
    position = data_start
    for name, info in sorted(infos.items(), key=lambda item: (item[1].offset, item[1].nbytes)):
        if info.offset != position:
            what = "overlaps the tensor before it" if info.offset < position else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {what} (corrupt header)")
        position = info.offset + info.nbytes
    if position > size:
        raise CheckpointError(f"{path}: file is truncated ({size} bytes, its header needs {position})")
    if position < size:
        raise CheckpointError(f"{path}: {size - position} bytes after the last tensor (corrupt header)")


def hub_repository(directory: Path) -> Path | None:
    """The Hugging Face hub cache repository folder (`models--org--name`, holding `snapshots/` and `blobs/`)
    when `directory` is one of its snapshots, else None."""
    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" and (resolved.parent.parent / "blobs").is_dir():
        return resolved.parent.parent
    return None


def resolve_checkpoint(path: str | Path) -> str | Path:
    """`path` where it exists; else a Hub repository id ("org/name") read from the local Hugging Face cache
    (HF_HUB_CACHE, HF_HOME), its `main` snapshot, as transformers and vLLM resolve one offline. Nothing is
    downloaded here."""
    given = str(path)
    if Path(given).exists() or not _repo_id(given):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        found = snapshot_download(given, local_files_only=True)
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{given}: no such directory, and the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                              f"holds no snapshot of that repository; nothing is downloaded here: `hf download "
                              f"{given}` first") from None
    return found if isinstance(path, str) else Path(found)


def _repo_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1  # "org/name": a bare word is more likely a directory that is not there


def checkpoint_name(path: str | Path) -> str:
    """A checkpoint's name: a Hub snapshot's repository id ("org/name", as vLLM serves it), else the directory's."""
    repo = hub_repository(Path(path))
    if repo is not None and repo.name.startswith("models--"):
        return repo.name.removeprefix("models--").replace("--", "/", 1)
    return os.path.basename(os.path.abspath(path))


def inside(directory: Path, name: str, listed_in: str = HF_INDEX) -> Path:
    """Resolve a weight file's name, refusing anything that leaves the checkpoint directory. A symlink is
    followed only to a regular file of the same hub cache repository (`snapshots/<rev>/f -> ../../blobs/<hash>`,
    the way huggingface_hub lays out a download)."""
    root = directory.resolve()
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise CheckpointError(f"{directory / listed_in}: entry {name!r} points outside the checkpoint directory")
    target = (root / name).resolve()
    if target.is_relative_to(root):
        return target
    repo = hub_repository(directory)
    if repo is not None and target.is_relative_to(repo) and (target.is_file() or not target.exists()):
        return target
    raise CheckpointError(f"{directory / listed_in}: entry {name!r} points outside the checkpoint directory"
                          + (f" (to {target}, outside its hub cache repository {repo})" if repo else ""))


def refuse_pickles(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{directory}: found only pickle weights ({', '.join(pickles[:3])}); "
                              f"this project reads safetensors only: {CONVERT_HINT}")
    raise CheckpointError(f"{directory}: no safetensors weights found")


def index_tensors(directory: Path, weight_files: list[str]) -> dict[str, TensorInfo]:
    """Tensor name -> where it lives, from the HF index if present, else from the given files' headers."""
    index_path = directory / HF_INDEX
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path}: not a valid index (no 'weight_map' object)") from None
        files = {name: inside(directory, name) for name in sorted(set(weight_map.values()))}
    else:
        files = {name: inside(directory, name, name) for name in weight_files if (directory / name).exists()}
        if not files:
            refuse_pickles(directory)
    headers: dict[Path, dict[str, TensorInfo]] = {}
    for path in files.values():
        if not path.exists():
            raise CheckpointError(f"{path}: shard listed in {HF_INDEX} is missing")
        headers[path] = read_header(path)
    if not index_path.exists():
        return {k: v for h in headers.values() for k, v in h.items()}
    tensors = {}
    for tensor, name in weight_map.items():
        info = headers[files[name]].get(tensor)
        if info is None:
            raise CheckpointError(f"{files[name]}: tensor {tensor!r} listed in {HF_INDEX} is not in this file")
        tensors[tensor] = info
    return tensors
