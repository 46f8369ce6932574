"""Count the calls that would make the host wait for a GPU, on any device.

On CUDA a host sync drains the GPU queue and exposes every small kernel launch after it, so the decode step
is allowed one per MoE block (the exchange's split sizes) and two per step (the sampled tokens). This mode
counts them in a CPU run too, by what the call is, not by how long it waited: reading a tensor's values on
the host (`tolist`, `item`, `bool`/`int`/`float`, `numpy`; `.cpu()`/`.to("cpu")` of a tensor not on the host)
and the operations whose output size depends on the data (`nonzero`, boolean-mask indexing, `masked_select`,
`unique`, `bincount`, `repeat_interleave` without `output_size`). Each call counts once; a CPU run counts
every value read as if the tensor were on a GPU.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero",
          "masked_select", "unique", "unique_consecutive", "bincount"}


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _READS:
        return True
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name == "cpu":  # a copy to the host: a sync unless the tensor is there already
        return source is not None and source.device.type != "cpu"
    if name == "to":
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        to_host = str(target) == "cpu" or (isinstance(target, torch.device) and target.type == "cpu")
        return to_host and source is not None and source.device.type != "cpu"
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return False


class HostSyncCounter(TorchFunctionMode):
    """`with HostSyncCounter() as c: ...`; then `c.total` and `c.by_call` (call name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_call: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_sync(name, args, kwargs):
            self.by_call[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_call.values())
