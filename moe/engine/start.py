"""Where a model runs: the engine and its `ModelInfo` for each of the three launches `MoEModel.from_pretrained`
picks from (one rank in this process, N rank processes started here, this process as one rank of torchrun)."""

from __future__ import annotations

import torch

from moe.engine.build import build_model
from moe.engine.local import LocalEngine
from moe.info import ModelInfo
from moe.memory import peak_memory_mib
from moe.parallel.placement import Placement, resolve_placement
from moe.progress import Progress
from moe.workers.rank import ShardSpec, load_report


def load_here(path, base: dict, device: str, progress: bool, compile) -> tuple[LocalEngine, ModelInfo]:
    """One rank, in this process."""
    baseline = peak_memory_mib(device)
    model, _, stats = build_model(path, base["dtype"], device, progress=Progress.for_loading(progress),
                                  kernels=base["cpu_kernels"])
    report = load_report(model, stats, baseline, torch.device(device), "none")
    engine = LocalEngine(model, compile)
    engine.checkpoint_dir = str(path)
    return engine, ModelInfo.from_reports(base, [report], launch="local", compiled=compile in (True, "torch"))


def start_ranks(spec: ShardSpec, base: dict, gpus: int, plan: Placement, master_port: int | None,
                threads: int | None):
    """N rank processes started here (fresh interpreters), driven from this one."""
    from moe.engine.remote import RemoteEngine
    from moe.workers.group import WorkerGroup

    group = WorkerGroup(gpus, spec, master_port, threads)
    try:
        info = ModelInfo.from_reports(base, group.ready, launch="processes", placement=plan, compiled=spec.compile)
    except BaseException as e:
        group.close(force=True, reason=f"loading failed: {e}")
        raise
    return RemoteEngine(group), info


def join_torchrun(path, cfg, base: dict, dist, created: bool, gpus: int, placement, blocks_per_rank,
                  progress: bool, compile: bool):
    """This process as one rank of torchrun's group; every rank makes the same calls."""
    from moe.workers.rank import load_shard

    if gpus not in (1, dist.world_size):
        raise ValueError(f"gpus={gpus}: under torchrun the ranks are torchrun's (WORLD_SIZE={dist.world_size}); "
                         "leave gpus out")
    plan = resolve_placement(placement, cfg, dist.world_size, blocks_per_rank, base["attention"], base["experts"])
    spec = ShardSpec(str(path), base["dtype"], plan.to_json(), progress, base["cpu_kernels"], dist.device.type,
                     exchange=base["exchange"], compile=compile)
    baseline = peak_memory_mib(dist.device)
    engine, stats = load_shard(spec, dist)
    engine.owns_group = created  # a group another model of this job made stays for that model
    reports = dist.all_gather_object(load_report(engine.model, stats, baseline, dist.device, dist.backend))
    return engine, ModelInfo.from_reports(base, reports, launch="torchrun", rank=dist.rank, placement=plan,
                                          compiled=compile)
