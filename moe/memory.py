"""Peak memory of this process, as the scripts and benchmarks report it."""

from __future__ import annotations

import resource

import torch


def peak_memory_mib(device: torch.device | str = "cpu") -> float:
    """Peak resident memory (CPU), or peak allocated GPU memory on CUDA, in MiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
