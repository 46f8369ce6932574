"""Write a model's tensors as a Hugging Face or Mistral consolidated directory.

Names go through the same map as loading (`formats.external_name`), so what we write we can read.
The directory appears atomically: files go to a temporary sibling that is renamed at the end, so an
interrupted save never leaves a directory that looks like a valid checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.config import ModelConfig
from moe.checkpoint.encodings import restack
from moe.checkpoint.files import HF_INDEX, CheckpointError
from moe.checkpoint.formats import (
    HF,
    MISTRAL,
    external_name,
    is_stacked_expert,
    latent_rope_rows,
    needs_rope_permute,
    rope_rows,
    to_interleaved,
)
from moe.host import process_alive
from moe.progress import Progress


def to_external(state: dict[str, torch.Tensor], cfg: ModelConfig, fmt: str,
                expert_ids: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Our names and stacked experts -> the format's names, one tensor per expert."""
    out = {}
    for name, t in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if is_stacked_expert(name):
            ids = (expert_ids or {}).get(name, range(t.shape[0]))
            for row, e in enumerate(ids):
                out[external_name(fmt, cfg, name, e)] = t[row].contiguous()
            continue
        kind = needs_rope_permute(fmt, name)
        if kind is not None:
            t = to_interleaved(t, cfg.n_heads if kind == "wq" else cfg.n_kv_heads)
        rows = latent_rope_rows(fmt, cfg, name)
        if rows is not None:
            t = rope_rows(t, rows, half_split=False)
        out[external_name(fmt, cfg, name)] = t.contiguous()
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def plan_shards(sizes: dict[str, int], max_bytes: int | None) -> list[list[str]]:
    """Group tensor names, in order, into files of at most `max_bytes` (a larger tensor gets a file alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_file_name(number: int, total: int) -> str:
    """Hugging Face's names: one file is model.safetensors, else model-0000i-of-0000n.safetensors (i from 1)."""
    return "model.safetensors" if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json, needed only when there are several files."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_file(tensors: dict[str, torch.Tensor], path: Path, progress: Progress | None = None,
               metadata: dict[str, str] | None = None) -> None:
    """One safetensors file; `progress` counts its bytes once it is written."""
    save_file(tensors, path, metadata=metadata)
    if progress is not None:
        progress.update(sum(nbytes(tensors).values()))


def write_hf_shards(tensors: dict[str, torch.Tensor], directory: Path, max_bytes: int | None,
                    progress: Progress | None = None) -> None:
    shards = plan_shards(nbytes(tensors), max_bytes)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        fname = shard_file_name(i, len(shards))
        write_file({n: tensors[n] for n in names}, directory / fname, progress, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    write_index(directory, weight_map, sum(nbytes(tensors).values()))


def save_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, fmt: str = HF,
                    beside: Sequence[str | Path] = (), max_shard_bytes: int | None = None,
                    progress: Progress | None = None) -> Path:
    """Write safetensors plus config (and the files `beside` the weights: tokenizer, generation defaults) to
    `out_dir`, atomically."""
    out_dir = Path(out_dir)
    params = cfg.to_mistral() if fmt == MISTRAL else None  # a config the layout cannot hold: refused before writing
    tmp = make_partial_dir(out_dir)
    try:
        tensors = restack(to_external({k: v.detach().cpu() for k, v in state.items()}, cfg, fmt))
        if progress is not None:
            progress.start(sum(nbytes(tensors).values()))
        if fmt == MISTRAL:
            write_file(tensors, tmp / "consolidated.safetensors", progress)
            (tmp / "params.json").write_text(json.dumps(params, indent=2) + "\n")
            finish_checkpoint(tmp, out_dir, None, None, beside)
        else:
            write_hf_shards(tensors, tmp, max_shard_bytes, progress)
            finish_checkpoint(tmp, out_dir, cfg, dtype_name(tensors), beside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if progress is not None:
            progress.close()
    return out_dir


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else "float32"


def refuse_non_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir}: output directory exists and is not empty")


def make_partial_dir(out_dir: Path) -> Path:
    """A hidden temporary sibling of `out_dir`; the checkpoint becomes visible only when it is renamed. Its
    name carries this process's id, so partial directories left by a killed save are recognised and removed."""
    refuse_non_empty(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    return tmp


def remove_stale_partials(out_dir: Path) -> list[Path]:
    """Remove the partial directories of saves to `out_dir` whose process no longer runs (killed mid-save)."""
    removed = []
    for partial in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        pid = partial.name.removeprefix(f".{out_dir.name}.partial-").split("-")[0]
        if partial.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


def finish_checkpoint(tmp: Path, out_dir: Path, cfg: ModelConfig | None, dtype: str | None,
                      beside: Sequence[str | Path] = ()) -> None:
    """Write config.json (HF) and copy the files `beside` the weights (each by its own name), then rename the
    finished directory into place."""
    if cfg is not None:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf() | {"dtype": dtype}, indent=2) + "\n")
    for f in map(Path, beside):
        shutil.copyfile(f, tmp / f.name)
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes owner-only files; a checkpoint is meant to be shared
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)
