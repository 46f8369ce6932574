"""Peak memory of this process, as the scripts and benchmarks report it."""

from __future__ import annotations

import resource

import torch


def peak_memory_mib(device: torch.device | str = "cpu") -> float:
    """Peak resident memory (CPU), or peak allocated GPU memory on CUDA, in MiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM belongs to this address space; ru_maxrss survives exec and would include a spawning parent's peak.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
