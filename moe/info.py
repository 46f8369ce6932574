"""What a loaded model is and where it runs (`MoEModel.info`), made from every rank's load report; the line on
stderr that says which kernels run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from moe.parallel.agreement import check_reports_agree
from moe.parallel.placement import Placement


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, and where it runs."""

    format: str  # "hf" or "mistral"
    dtype: str  # "float32", "bfloat16", "float16", "int8" (int8 weights, bf16 activations)
    cpu_kernels: str
    ranks: int
    backend: str  # "none" (one process), "gloo" or "nccl"
    launch: str  # "local" (this process), "processes" (started here), "torchrun" (this process is one rank)
    rank: int = 0  # this process's rank: 0 unless under torchrun
    placement: Placement | None = None
    attention: str = "layer"  # the shortcut asked for ("layer", "replicated", "tensor"); the plan has each block's
    experts: str = "expert"  # "expert" or "tensor"
    exchange: str = "auto"  # how token copies reach experts on N ranks (moe.parallel.gather)
    compiled: bool = False  # decode steps run through torch.compile (`MoEModel.from_pretrained`'s `compile`)
    kernels: str = ""  # which products and attention run (`models.kernels.choice.KernelChoice.describe`)
    load_seconds: list[float] = field(default_factory=list)  # per rank, reading its tensors
    bytes_read: list[int] = field(default_factory=list)  # per rank
    files_read: list[list[str]] = field(default_factory=list)  # per rank
    tensors_read: list[dict[str, list[list[int]]]] = field(default_factory=list)  # per rank: tensor -> shapes read
    rank_params: list[list[str]] = field(default_factory=list)  # per rank, the parameters it holds
    pids: list[int] = field(default_factory=list)  # process id of each rank
    baseline_mib: list[float] = field(default_factory=list)  # per rank, memory before any weight was read
    loaded_peak_mib: list[float] = field(default_factory=list)  # per rank, peak memory once loaded
    # per rank, the decode kernel's prefetch distance by weight kind, measured on its machine (`models.kernels.tuning`)
    prefetch_bytes: list[dict[str, int]] = field(default_factory=list)

    @classmethod
    def from_reports(cls, base: dict, reports: list[dict], **where) -> ModelInfo:
        """From every rank's `moe.workers.rank.load_report`, in rank order; ranks that loaded with other kernels or
        settings than rank 0 are refused (`check_reports_agree`)."""
        def each(key: str) -> list:
            return [r[key] for r in reports]

        check_reports_agree(reports)
        return cls(**base, **where, ranks=len(reports), backend=reports[0]["backend"], kernels=reports[0]["kernels"],
                   load_seconds=each("load_seconds"), bytes_read=each("bytes_read"), files_read=each("files_read"),
                   tensors_read=each("tensors_read"),
                   rank_params=each("params"), pids=each("pid"), baseline_mib=each("baseline_mib"),
                   loaded_peak_mib=each("loaded_peak_mib"),
                   prefetch_bytes=[r.get("prefetch_bytes", {}) for r in reports])


_announced: set[str] = set()  # the kernel lines this process has printed


def announce(info: ModelInfo) -> ModelInfo:
    """Say on stderr, once per process (rank 0 under torchrun) and per distinct line, which kernels run."""
    if info.rank == 0 and info.kernels and info.kernels not in _announced:
        _announced.add(info.kernels)
        print(info.kernels, file=sys.stderr)
    return info
