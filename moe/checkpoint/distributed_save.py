"""Save a model held by N ranks as one Hugging Face directory: each rank writes the tensors it holds.

Nothing is gathered onto one rank. A tensor held by several ranks (replicated dense weights in training,
replicated experts in a placement) is written once, by the lowest of them. The ranks agree on a global
file numbering (`model-00003-of-00007.safetensors`); rank 0 writes the index, config and tokenizer last
and renames the directory into place, so an interrupted save leaves no valid-looking checkpoint.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.config import ModelConfig
from moe.checkpoint.encodings import restack
from moe.checkpoint.files import CheckpointError
from moe.checkpoint.formats import EXPERT_PARAMS, HF, is_stacked_expert
from moe.checkpoint.slices import reassemble
from moe.checkpoint.writer import (
    dtype_name,
    finish_checkpoint,
    make_partial_dir,
    nbytes,
    plan_shards,
    shard_file_name,
    to_external,
    write_file,
    write_index,
)
from moe.parallel.agreement import agreed
from moe.parallel.distributed import DistContext
from moe.progress import Progress


def stacked_expert_ids(model: torch.nn.Module) -> dict[str, list[int]]:
    """Global expert id of each row of every stacked expert tensor this rank holds."""
    ids = {}
    for name, module in model.named_modules():
        if hasattr(module, "expert_ids"):
            for w in EXPERT_PARAMS:
                ids[f"{name}.{w}"] = list(module.expert_ids)
    return ids


def state_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What state_dict() holds, without unpacking anything: a packed weight appears as its meta placeholder
    (right name, shape and dtype, no memory). `dense_tensor` gives any one of them for real."""
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[prefix + name] = p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = b
    return out


def dense_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    """One state tensor, dense and on the CPU."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    t = module.dense(attr) if hasattr(module, "dense") else getattr(module, attr).detach()
    return t.cpu()


def dense_external(model: torch.nn.Module, cfg: ModelConfig, names: list[str],
                   plan: SavePlan) -> dict[str, torch.Tensor]:
    """The external tensors `names`, dense: each of our tensors they come from is made dense once (or taken whole
    from the reassembled slices)."""
    wanted, out = set(names), {n: plan.received[n] for n in names if n in plan.received}
    for ours in dict.fromkeys(plan.source[n] for n in names if n not in plan.received):
        t = plan.whole[ours] if ours in plan.whole else dense_tensor(model, ours)
        external = to_external({ours: t}, cfg, HF, plan.expert_ids)
        out.update((n, t) for n, t in external.items() if n in wanted)
    return {n: out[n] for n in names}


@dataclass
class SavePlan:
    """This rank's share of a save: the external tensors it writes (views or placeholders, for planning),
    where each comes from, and the expert ids of our stacked tensors."""

    mine: dict[str, torch.Tensor]
    source: dict[str, str]  # external name -> our name
    expert_ids: dict[str, list[int]]
    dtype: str | None  # of our tensors (None when this rank holds none)
    whole: dict[str, torch.Tensor]  # split parameters this rank reassembled and writes (moe.checkpoint.slices)
    received: dict[str, torch.Tensor]  # other ranks' experts of a 3-D expert tensor this rank writes


def plan_save(model: torch.nn.Module, cfg: ModelConfig, ctx: DistContext) -> SavePlan:
    """Collective. A tensor several ranks hold (a replicated expert, tied embeddings) is written by the lowest; a
    tensor split over ranks by the rank that reassembled it."""
    whole = reassemble(model, ctx, dense_tensor)
    split = getattr(model, "slices", {})
    layout = {name: whole.get(name, t) for name, t in state_layout(model).items() if name not in split or name in whole}
    expert_ids = {k: v for k, v in stacked_expert_ids(model).items() if k in layout and is_stacked_expert(k)}
    tensors, source = {}, {}
    with torch.no_grad():
        for name, t in layout.items():
            for ext, view in to_external({name: t}, cfg, HF, expert_ids).items():
                tensors[ext], source[ext] = view, name
    first_holder: dict[str, int] = {}
    for rank, names in enumerate(ctx.all_gather_object(sorted(tensors))):
        for n in names:
            first_holder.setdefault(n, rank)
    writer = _stacked_writers(first_holder)
    mine = {n: t for n, t in tensors.items() if writer.get(n, first_holder[n]) == ctx.rank}
    plan = SavePlan(mine, source, expert_ids, dtype_name(tensors) if tensors else None, whole, {})
    _gather_stacked(model, cfg, ctx, plan, tensors, first_holder, writer)
    return plan


def _stacked_writers(first_holder: dict[str, int]) -> dict[str, int]:
    """The rank writing each external piece of a 3-D expert tensor (`name#e:...`) whose experts several ranks hold:
    one of its holders, round-robin over such tensors so that no rank gathers much more than its share."""
    holders: dict[str, set[int]] = {}
    for n, rank in first_holder.items():
        if "#" in n:
            holders.setdefault(n.partition("#")[0], set()).add(rank)
    spread = sorted(base for base, ranks in holders.items() if len(ranks) > 1)
    chosen = {base: sorted(holders[base])[i % len(holders[base])] for i, base in enumerate(spread)}
    return {n: chosen[n.partition("#")[0]] for n in first_holder if n.partition("#")[0] in chosen}


def _gather_stacked(model: torch.nn.Module, cfg: ModelConfig, ctx: DistContext, plan: SavePlan,
                    tensors: dict[str, torch.Tensor], first_holder: dict[str, int], writer: dict[str, int]) -> None:
    """Collective: each expert piece of a spread 3-D tensor is sent, dense, from its holder to the tensor's writer,
    every rank walking the pieces in one order (by holder, then our tensor they come from, which each holder makes
    dense once). The writer holds what it received until it writes it: about its share of those tensors again."""
    moving = [n for n, w in writer.items() if first_holder[n] != w]
    mine = {n: (tuple(tensors[n].shape), tensors[n].dtype, plan.source[n]) for n in moving
            if first_holder[n] == ctx.rank}
    meta = {n: m for theirs in ctx.all_gather_object(mine) for n, m in theirs.items()}
    order = sorted(meta, key=lambda n: (first_holder[n], meta[n][2], n))
    with torch.no_grad():
        for _, group in itertools.groupby(order, key=lambda n: (first_holder[n], meta[n][2])):
            names = list(group)
            if first_holder[names[0]] == ctx.rank:
                dense = dense_external(model, cfg, names, plan)
                for n in names:
                    ctx.send(dense[n].to(meta[n][1]).contiguous().to(ctx.device), writer[n])
                continue
            for n in names:
                if writer[n] == ctx.rank:
                    shape, dtype, _ = meta[n]
                    plan.received[n] = ctx.recv(shape, dtype, first_holder[n]).cpu()
                    plan.mine[n] = torch.empty(shape, dtype=dtype, device="meta")


def shared_partial_dir(out_dir: Path, ctx: DistContext) -> Path:
    """Collective: rank 0 makes the hidden partial directory and tells the others (or why it could not)."""
    made: object = None
    if ctx.rank == 0:
        try:
            made = str(make_partial_dir(out_dir))
        except CheckpointError as e:
            made = e
        except OSError as e:
            made = CheckpointError(f"{out_dir}: cannot create the output directory ({e.strerror or e})")
    made = ctx.broadcast_object(made, src=0)
    if isinstance(made, Exception):
        raise agreed(made)
    return Path(made)


def save_distributed(model: torch.nn.Module, cfg: ModelConfig, out_dir: str | Path, ctx: DistContext,
                     max_shard_bytes: int | None = None, beside: Sequence[str | Path] = (),
                     progress: Progress | None = None) -> dict:
    """Collective: every rank calls it. Returns {"files": [this rank's files], "bytes": bytes written here}.

    Files are planned from names and shapes alone; each file's tensors are made dense (unpacked, copied off
    the GPU) just before it is written, so saving needs little memory beyond the model."""
    out_dir = Path(out_dir)
    plan = plan_save(model, cfg, ctx)
    tmp = shared_partial_dir(out_dir, ctx)
    members: dict[str, list[str]] = {}  # each tensor written, and the external tensors it is made of
    for name in plan.mine:
        members.setdefault(name.partition("#")[0], []).append(name)  # a 3-D expert tensor: its rows (`restack`)
    each = nbytes(plan.mine)
    sizes = {unit: sum(each[n] for n in names) for unit, names in members.items()}
    try:
        shards = plan_shards(sizes, max_shard_bytes) if plan.mine else []
        if progress is not None:
            progress.start(sum(sizes.values()))
        counts = ctx.all_gather_object(len(shards))
        total_files, first = sum(counts), sum(counts[:ctx.rank])
        weight_map, files, failure = {}, [], None
        try:
            for i, names in enumerate(shards):
                fname = shard_file_name(first + i + 1, total_files)
                parts = [n for unit in names for n in members[unit]]
                write_file(restack(dense_external(model, cfg, parts, plan)), tmp / fname, progress,
                           metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, fname))
                files.append(fname)
        except OSError as e:  # told to every rank below, so all of them stop at the same point
            failure = f"rank {ctx.rank}: cannot write {tmp / fname} ({e.strerror or e})"
        # Gathering is also the barrier: every rank's files are complete before the index names them.
        maps = ctx.all_gather_object((weight_map, sum(sizes.values()), plan.dtype, failure))
        failures = [f for *_, f in maps if f]
        if failures:
            raise agreed(CheckpointError(failures[0]))
        if ctx.rank == 0:
            try:
                write_index(tmp, {k: v for m, *_ in maps for k, v in m.items()}, sum(m[1] for m in maps))
                finish_checkpoint(tmp, out_dir, cfg, next(m[2] for m in maps if m[2] is not None), beside)
            except OSError as e:
                failure = f"{out_dir}: cannot finish the checkpoint ({e.strerror or e})"
        failure = ctx.broadcast_object(failure, 0)
        if failure:
            raise agreed(CheckpointError(failure))
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if progress is not None:
            progress.close()
    return {"files": files, "bytes": sum(sizes.values())}
