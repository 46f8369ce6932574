"""Re-shard a checkpoint into Hugging Face files, optionally *rank-aligned*: every rank's tensors in files
of its own, so that under that placement a rank opens only its files.

Streaming: an output file's tensors are read (positioned reads) just before it is written, so memory stays
within about one output file whatever the checkpoint's size. Either layout is accepted as the source.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from models.transformer import Transformer
from moe.checkpoint.encodings import Derived, catalog
from moe.checkpoint.files import beside_weights, index_tensors
from moe.checkpoint.formats import (
    HF,
    dense_layer,
    detect,
    external_name,
    is_stacked_expert,
    needs_rope_permute,
    to_half_split,
)
from moe.checkpoint.loader import SAFETENSORS_DTYPES, TensorReader, needed_sources
from moe.checkpoint.writer import (
    finish_checkpoint,
    make_partial_dir,
    plan_shards,
    shard_file_name,
    write_file,
    write_index,
)
from moe.parallel.placement import Placement
from moe.parallel.sharding import apply_placement
from moe.progress import Progress


@dataclass(frozen=True)
class Move:
    dst: str  # Hugging Face name written
    src: str  # name in the source checkpoint
    rope_heads: int | None  # permute interleaved q/k rows to half-split with this many heads (Mistral source)


def plan_moves(fmt: str, cfg) -> list[Move]:
    """Every tensor of the model, in our parameter order, as (HF name, source name)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    moves = []
    for name in model.state_dict():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        if is_stacked_expert(name):
            if dense_layer(cfg, name):
                continue  # a dense layer among MoE ones holds no routed experts
            moves += [Move(external_name(HF, cfg, name, e), external_name(fmt, cfg, name, e), None)
                      for e in range(cfg.n_experts)]
            continue
        kind = needs_rope_permute(fmt, name)
        heads = None if kind is None else (cfg.n_heads if kind == "wq" else cfg.n_kv_heads)
        moves.append(Move(external_name(HF, cfg, name), external_name(fmt, cfg, name), heads))
    return moves


def ranks_needing(cfg, placement: Placement) -> dict[str, set[int]]:
    """HF tensor name -> the ranks that read it under `placement`."""
    need: dict[str, set[int]] = {}
    for rank in range(placement.world_size):
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_placement(model, placement, rank)
        for names in needed_sources(model, HF, cfg).values():
            for n in names:
                need.setdefault(n, set()).add(rank)
    return need


def group_by_rank(moves: list[Move], need: dict[str, set[int]], world_size: int) -> list[list[Move]]:
    """Rank 0's tensors, rank 1's, ..., then those several ranks read (replicated experts, tied weights)."""
    groups: list[list[Move]] = [[] for _ in range(world_size + 1)]
    for m in moves:
        ranks = need.get(m.dst, set())
        groups[next(iter(ranks)) if len(ranks) == 1 else world_size].append(m)
    return [g for g in groups if g]


def reshard(src: str | Path, out: str | Path, max_shard_bytes: int | None,
            placement: Placement | None = None, progress: Progress | None = None) -> dict:
    """Write `src` to `out` as HF safetensors; returns {"files": {file: [ranks that read it]}}."""
    src, out = Path(src), Path(out)
    ckpt = detect(src)
    cfg = ckpt.config
    tensors = catalog(index_tensors(src, ckpt.weight_files), ckpt.fmt, cfg, fp8_block=ckpt.fp8_block)
    moves = plan_moves(ckpt.fmt, cfg)
    if any("#" in m.dst for m in moves):
        raise ValueError(f"{src}: {cfg.family} keeps each block's experts in one tensor; re-sharding it by expert is "
                         "not supported")
    if any(isinstance(tensors.get(m.src), Derived) for m in moves):
        raise ValueError(f"{src}: its weights are stored quantized (FP8 with block scales), which re-sharding does "
                         "not rewrite; load it and save_pretrained instead (the weights then in the loaded dtype)")
    missing = [m.src for m in moves if m.src not in tensors]
    if missing:
        raise ValueError(f"{src}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    if placement is not None:
        need = ranks_needing(cfg, placement)
        groups = group_by_rank(moves, need, placement.world_size)
    else:
        need, groups = {}, [moves]
    sizes = {m.dst: tensors[m.src].nbytes for m in moves}
    shards: list[list[Move]] = []
    for group in groups:  # a file never mixes two groups
        by_name = {m.dst: m for m in group}
        shards += [[by_name[n] for n in names] for names in plan_shards({m.dst: sizes[m.dst] for m in group},
                                                                        max_shard_bytes)]
    tmp = make_partial_dir(out)
    files: dict[str, list[int]] = {}
    try:
        weight_map, total = {}, 0
        with ExitStack() as stack:
            reader = TensorReader(tensors, stack)
            if progress is not None:
                stack.enter_context(progress.start(sum(sizes.values())))
            for i, shard in enumerate(shards, 1):
                fname = shard_file_name(i, len(shards))
                data = {}
                for m in shard:
                    t = reader.read(m.src)
                    data[m.dst] = to_half_split(t, m.rope_heads) if m.rope_heads else t
                    total += sizes[m.dst]
                write_file(data, tmp / fname, progress, metadata={"format": "pt"})
                del data
                weight_map.update(dict.fromkeys((m.dst for m in shard), fname))
                files[fname] = sorted(set().union(*(need.get(m.dst, set()) for m in shard)))
        write_index(tmp, weight_map, total)
        dtype = str(SAFETENSORS_DTYPES[tensors[moves[0].src].dtype]).removeprefix("torch.")
        finish_checkpoint(tmp, out, cfg, dtype, beside_weights(src))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"files": files}

