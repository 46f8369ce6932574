"""Count the communication calls a rank makes, by kind: the figure that carries over from gloo on CPUs to
NCCL on GPUs, where each collective's cost is mostly its latency.

`with CollectiveCounter() as c: ...` counts every `DistContext` call that moves tensors between ranks
(collectives, and the point-to-point sends of layer placement) made in this process while it is open.
"""

from __future__ import annotations

from collections import Counter

from moe.parallel.distributed import DistContext

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast", "gather")
POINT_TO_POINT = ("send", "recv")


class CollectiveCounter:
    def __init__(self) -> None:
        self.by_call: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveCounter:
        for name in COLLECTIVES + POINT_TO_POINT:
            method = getattr(DistContext, name)
            self._saved[name] = method

            def counted(ctx, *args, _name=name, _method=method, **kwargs):
                if ctx.distributed:
                    self.by_call[_name] += 1
                return _method(ctx, *args, **kwargs)

            setattr(DistContext, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, method in self._saved.items():
            setattr(DistContext, name, method)

    @property
    def collectives(self) -> int:
        return sum(self.by_call[name] for name in COLLECTIVES)
