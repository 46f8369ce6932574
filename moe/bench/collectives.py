"""Count the communication calls a rank makes, by kind: the figure that carries over from gloo on CPUs to
NCCL on GPUs, where each collective's cost is mostly its latency.

`with CollectiveCounter() as c: ...` counts every `DistContext` call that moves tensors between ranks
(collectives, and the point-to-point sends of layer placement) made in this process while it is open, and the
bytes this rank sends in them under the ring algorithms NCCL uses at these sizes (`bytes_sent`).
"""

from __future__ import annotations

import inspect
import json
import tempfile
from collections import Counter
from pathlib import Path

from moe.parallel.distributed import DistContext

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "gather")
POINT_TO_POINT = ("send", "recv")


def bytes_sent(name: str, ctx: DistContext, a: dict) -> float:
    """Bytes this rank sends in one call (`a`: the call's arguments by name): an all-reduce over g ranks 2(g-1)/g
    of the tensor, an all-gather its input to g-1 ranks, a reduce-scatter (g-1)/g, an all-to-all the rows for
    other ranks, a send or a broadcast from here the tensor once, a gather the tensor unless this rank gathers."""
    t = a.get("x", a.get("t"))
    if t is None:
        return 0.0
    size, world = t.numel() * t.element_size(), ctx.world_size
    if name == "all_reduce":
        g = len(a["ranks"]) if a.get("ranks") is not None else world
        return 2 * (g - 1) / g * size
    if name == "all_gather":
        return (world - 1) * size
    if name in ("reduce_scatter", "all_to_all") and a.get("in_splits") is None:
        return (world - 1) / world * size
    if name == "all_to_all":
        return sum(n for r, n in enumerate(a["in_splits"]) if r != ctx.rank) * size / max(1, t.shape[0])
    if name == "broadcast":
        return size if a["src"] == ctx.rank else 0.0
    if name == "gather":
        return size if a["dst"] != ctx.rank else 0.0
    return size if name == "send" else 0.0


class CollectiveCounter:
    def __init__(self) -> None:
        self.by_call: Counter[str] = Counter()
        self.bytes_sent = 0.0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for name in COLLECTIVES + POINT_TO_POINT:
            method = getattr(DistContext, name)
            self._saved[name] = method
            signature = inspect.signature(method)  # once per method, not per call

            def counted(ctx, *args, _name=name, _method=method, _sig=signature, **kwargs):
                a = _sig.bind(ctx, *args, **kwargs)
                a.apply_defaults()
                ranks = a.arguments.get("ranks")
                if ctx.distributed and (ranks is None or len(ranks) > 1):  # a group of one makes no call
                    self.by_call[_name] += 1
                    self.bytes_sent += bytes_sent(_name, ctx, a.arguments)
                return _method(ctx, *args, **kwargs)

            setattr(DistContext, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, method in self._saved.items():
            setattr(DistContext, name, method)

    @property
    def collectives(self) -> int:
        return sum(self.by_call[name] for name in COLLECTIVES)


DECODE_PROMPTS = [[1, 15, 27, 99, 7], [1, 300, 41, 8, 8]]  # equal lengths: decode steps only, no padding rows


def count_decode_step(path: str, world_size: int, exchange: str = "auto", dtype: str = "float32",
                      kernels: str = "auto", strategy: str = "layer/expert", sequences: int = 2) -> list[dict]:
    """Per rank: communication calls by kind, bytes sent and host syncs in one greedy decode step of `sequences`
    (1 or 2) on `world_size` rank processes (a run of 12 new tokens minus a run of 4, divided by 8).
    `kernels="torch"` runs the experts one by one as GPUs do (their counts read on the host), "auto" the CPU's
    streaming kernel. `strategy`: every block's "attention/experts" (`moe.parallel.strategies`), e.g.
    "tensor/tensor:2"."""
    from moe.workers.group import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(_count_on_rank, world_size, str(path), dtype, exchange, kernels, strategy, sequences, out)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world_size)]


def strategy_plan(cfg, world_size: int, strategy: str):
    """The plan for "attention/experts[:expert group size]" over `world_size` ranks."""
    from moe.parallel.placement import Placement

    attention, _, experts = strategy.partition("/")
    experts, _, size = experts.partition(":")
    plan = Placement.default(cfg.n_layers, cfg.n_experts, world_size)
    if (attention, experts, size) != ("layer", "expert", ""):
        plan = plan.with_strategies(attention, experts, int(size) if size else None)
    return plan.validate(cfg.n_layers, cfg.n_experts, world_size, cfg)


def _count_on_rank(rank: int, world_size: int, port: int, path: str, dtype: str, exchange: str, kernels: str,
                   strategy: str, sequences: int, out: str) -> None:
    from moe.bench.syncs import HostSyncCounter
    from moe.checkpoint.formats import detect
    from moe.generation import SamplingParams, generate_tokens
    from moe.parallel.distributed import init_process_group
    from moe.workers.rank import ShardSpec, load_shard

    dist = init_process_group(rank, world_size, "127.0.0.1", port)
    cfg = detect(path).config
    plan = strategy_plan(cfg, world_size, strategy)
    engine, _ = load_shard(ShardSpec(path, dtype, plan.to_json(), cpu_kernels=kernels, exchange=exchange), dist)
    runs = []
    for n in (4, 12):
        with CollectiveCounter() as calls, HostSyncCounter() as syncs:
            generate_tokens(engine, DECODE_PROMPTS[:sequences], SamplingParams(n, 0.0, 1.0, 0, 0), (), 10**6)
        runs.append((calls.by_call, syncs.total, calls.bytes_sent))
    (calls4, syncs4, sent4), (calls12, syncs12, sent12) = runs
    result = {"calls": {name: (calls12[name] - calls4[name]) / 8 for name in calls12},
              "collectives": sum((calls12[n] - calls4[n]) / 8 for n in COLLECTIVES),
              "syncs": (syncs12 - syncs4) / 8, "blocks": cfg.n_layers,
              "bytes_per_token": (sent12 - sent4) / 8 / sequences}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy()


def collective_cost(world_size: int, dim: int, product_mb: int = 16, calls: int = 300) -> dict:
    """What one decode-step collective costs between `world_size` rank processes of one thread each, pinned as rank
    processes are (`moe.workers.rank.keep_to_share`): the all-gather of a [1, dim] fp32 row (what a lone
    sequence's block sums), timed on rank 0 with the ranks idle and with an equal fp32 product of `product_mb` MB
    on every rank before each call (as in a step), each waited for by sleeping and by polling
    (`DistContext.poll`). Seconds: {"idle"|"working"|"idle polled"|"working polled": {"median", "mean", "p90"}}."""
    from moe.workers.group import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(_cost_on_rank, world_size, dim, product_mb, calls, out)
        return json.loads((Path(out) / "rank0.json").read_text())


def _cost_on_rank(rank: int, world_size: int, port: int, dim: int, product_mb: int, calls: int, out: str) -> None:
    import dataclasses
    import statistics
    import time

    import torch

    from moe.parallel.distributed import init_process_group
    from moe.workers.rank import keep_to_share

    torch.set_num_threads(1)
    own_cores = keep_to_share(rank, world_size, 1)
    sleeping = init_process_group(rank, world_size, "127.0.0.1", port)
    x = torch.randn(1, dim)
    side = int((product_mb * 2**20 / 4) ** 0.5)
    w, v = torch.randn(side, side), torch.randn(side)
    result = {}
    for dist, polled in ((sleeping, ""), (dataclasses.replace(sleeping, poll=own_cores), " polled")):
        for name, work in (("idle", 0), ("working", 1)):
            spent = []
            for _ in range(calls):
                for _ in range(work):
                    w @ v
                t = time.perf_counter()
                dist.all_gather(x)
                spent.append(time.perf_counter() - t)
            spent.sort()
            result[name + polled] = {"median": statistics.median(spent), "mean": statistics.fmean(spent),
                                     "p90": spent[int(0.9 * len(spent))]}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    sleeping.destroy()
