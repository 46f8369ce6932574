"""Which engine runs a placement on N ranks, and whether its decode steps may run compiled."""

from __future__ import annotations

from moe.engine.pipeline import PipelineEngine, pipeline_refusal
from moe.engine.replicated import ReplicatedAttentionEngine
from moe.engine.sharded import ShardedEngine
from moe.parallel.placement import Placement


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
