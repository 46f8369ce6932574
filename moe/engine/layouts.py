"""Which engine runs a placement on N ranks, whether its decode steps may run compiled, and the checks of the
layout options `from_pretrained` takes."""

from __future__ import annotations

from models.kernels.choice import KERNELS
from moe.engine.pipeline import PipelineEngine, pipeline_refusal
from moe.engine.replicated import ReplicatedAttentionEngine
from moe.engine.sharded import ShardedEngine
from moe.parallel.gather import EXCHANGES
from moe.parallel.placement import Placement
from moe.parallel.strategies import ATTENTION_STRATEGIES, EXPERT_STRATEGIES


def engine_type(plan: Placement) -> type[ShardedEngine]:
    if plan.replicated:
        return ReplicatedAttentionEngine
    return PipelineEngine if plan.pipeline else ShardedEngine


def compilable_plan(plan: Placement, compile: bool, exchange: str) -> Placement:
    """`plan`, checked for `compile`. On N ranks a decode step compiles where every rank runs all of it
    (`moe.engine.replicated`: attention replicated in every block, the exchange left to choose, no expert with
    replicas), or where each rank runs one range of whole blocks (`moe.engine.pipeline`)."""
    if not compile:
        return plan
    if plan.pipeline:
        why = pipeline_refusal(plan)
        if why is not None:
            raise ValueError(f"compile=True with experts 'layer' needs {why}")
        return plan
    replicas = any(plan.strategy(b).experts == "expert" and any(len(ranks) > 1 for ranks in block)
                   for b, block in enumerate(plan.expert_ranks))
    why = ("replicated attention in every block (attention='replicated'), where every rank runs the whole decode "
           "step, or experts 'layer' in every block (experts='layer'), a pipeline of whole blocks"
           if not plan.replicated else
           f"exchange='auto' (got {exchange!r}): a forced exchange splits a lone sequence's step over the ranks"
           if exchange != "auto" else
           "experts without replicas: each rank routes a replicated expert's copies by its own round-robin state"
           if replicas else None)
    if why is not None:
        raise ValueError(f"compile=True on N ranks needs {why}")
    return plan


def check_options(gpus: int, cpu_kernels: str, attention: str, experts: str, exchange: str, compile: bool | str | None,
                  threads: int | None = None) -> None:
    """`from_pretrained`'s choices, each refused in one line before anything is loaded or started."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if cpu_kernels not in KERNELS:
        raise ValueError(f"cpu_kernels={cpu_kernels!r}: use one of {', '.join(KERNELS)}")
    if attention not in ATTENTION_STRATEGIES:
        raise ValueError(f"attention={attention!r}: use one of {', '.join(ATTENTION_STRATEGIES)}")
    if experts not in EXPERT_STRATEGIES:
        raise ValueError(f"experts={experts!r}: use one of {', '.join(EXPERT_STRATEGIES)}")
    if experts == "layer" and attention != "layer":
        raise ValueError(f"experts='layer' (each block's experts on its owner) needs attention='layer', "
                         f"got {attention!r}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: use one of {', '.join(EXCHANGES)}")
    if compile not in (None, True, False, "torch"):
        raise ValueError(f"compile must be None, True, False or 'torch', got {compile!r}")
    if compile and cpu_kernels == "onednn":
        raise ValueError("compile=True cannot trace oneDNN-packed weights: use cpu_kernels='auto' or 'torch'")
