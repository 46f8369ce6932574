"""Memory of a rank, labelled: host peak resident memory, and on a GPU what PyTorch's allocator holds."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from moe.host import rusage_peak_mib


def _proc_kib(path: str, key: str) -> float | None:
    """A `key: N kB` line of a /proc file, in KiB (None where /proc is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def host_peak_mib() -> float:
    """Peak resident memory of this process in MiB."""
    # VmHWM belongs to this address space; ru_maxrss survives exec and would include a spawning parent's peak.
    kib = _proc_kib("/proc/self/status", "VmHWM")
    return kib / 1024 if kib is not None else rusage_peak_mib()


def return_freed_memory() -> None:
    """Hand memory that was freed back to the OS. glibc keeps freed heap memory for reuse: after a checkpoint's
    tensors are converted (packed, quantized) and the originals freed, resident memory stayed 150-170 MiB above
    what the model holds on `small` (bf16 746 -> 597 MiB, int8 541 -> 418 MiB after trimming). No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_mib() -> float:
    """Memory the kernel could give this machine's processes now (MemAvailable), in MiB; inf if unknown."""
    kib = _proc_kib("/proc/meminfo", "MemAvailable")
    return kib / 1024 if kib is not None else float("inf")


def peak_memory_mib(device: torch.device | str = "cpu") -> float:
    """Peak memory where the weights live: allocated GPU memory on CUDA, else host resident memory (MiB)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return host_peak_mib()


@dataclass(frozen=True)
class MemoryUse:
    """One rank's memory in MiB; the GPU fields are None on a CPU rank."""

    host_peak: float
    gpu_allocated: float | None = None
    gpu_reserved: float | None = None
    gpu_peak: float | None = None

    @classmethod
    def now(cls, device: torch.device | str) -> MemoryUse:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(host_peak_mib())
        return cls(host_peak_mib(), torch.cuda.memory_allocated(device) / 2**20,
                   torch.cuda.memory_reserved(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20)


def describe(uses: list[MemoryUse]) -> str:
    """`peak RSS 260 MiB`, `peak RSS per rank 260/254 MiB`, or on GPUs every figure, labelled, per rank."""
    def per_rank(values: list[float]) -> str:
        return "/".join(f"{v:.0f}" for v in values)

    host = f"peak RSS {per_rank([u.host_peak for u in uses])} MiB"
    if len(uses) > 1:
        host = host.replace("peak RSS", "peak RSS per rank")
    if uses[0].gpu_peak is None:
        return host
    gpu = [(u.gpu_peak, u.gpu_allocated, u.gpu_reserved) for u in uses]
    return (f"GPU peak {per_rank([g[0] for g in gpu])} MiB, allocated {per_rank([g[1] for g in gpu])} MiB, "
            f"reserved {per_rank([g[2] for g in gpu])} MiB; host {host}")


def check_kv_cache(cfg, info, engine, batch: int, length: int,
                   hint: str = "ask for fewer new tokens or fewer prompts") -> None:
    """Refuse, before any memory is taken, a request (or a server's sequences) whose KV cache cannot fit where it
    would live."""
    from models.kv_cache import KVCache
    from moe.checkpoint.loader import activation_dtype

    need = batch * length * cfg.n_layers * KVCache.bytes_per_token(cfg, activation_dtype(info.dtype).itemsize)
    device = getattr(engine, "device", torch.device("cpu")) if info.launch == "local" else None
    if device is not None and device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], str(device)
    elif info.backend in ("none", "gloo"):  # this machine's memory holds every rank's share
        free, where = available_mib() * 2**20, "host memory"
    else:
        return  # GPU ranks in other processes: their free memory is not visible from here
    if need > free:
        raise ValueError(f"a KV cache for {batch} sequence(s) of {length} positions needs {need / 2**30:.1f} GiB, "
                         f"{where} has {free / 2**30:.1f} GiB free; {hint}")
