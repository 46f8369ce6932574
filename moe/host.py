"""What this machine and process offer, asked portably: Linux has APIs that macOS and Windows lack (a process's CPU
affinity, /proc, `resource`, passing a file descriptor to a child). One rank runs everywhere; rank processes
started here need a POSIX system (`rank_processes_refusal`); elsewhere each answer falls back to what exists.
"""

from __future__ import annotations

import os
import platform
import sys

from models.kernels import cpuinfo


def cpu_name() -> str:
    """The CPU's model name, family and model number (for benchmark tables: a figure holds only on the machine it
    names; a virtual machine's name may say just "AMD EPYC", whichever generation) and the cores seen."""
    fields = cpuinfo.fields()
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    family = f"family {fields['cpu family']} model {fields.get('model', '?')}, " if "cpu family" in fields else ""
    return f"{fields['model name']} ({family}{os.cpu_count()} cores visible)"


def usable_cores() -> int:
    """The cores this process may run on: its affinity where the system has one (Linux), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    counted = getattr(os, "process_cpu_count", os.cpu_count)()  # Python 3.13 knows the process's own
    return counted or 1


def core_ids() -> list[int]:
    """The ids of `usable_cores`, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(usable_cores()))


def can_pin() -> bool:
    """This system lets a process choose its cores (Linux): CPU ranks keep to a share of them."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def pin(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone where /proc tells). Where nothing can tell without side
    effects (Windows: signal 0 would interrupt the process), assumed alive."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    if sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rusage_peak_mib() -> float:
    """Peak resident memory from getrusage (POSIX): KiB on Linux, bytes on macOS; NaN where there is none."""
    try:
        import resource
    except ImportError:  # Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rank_processes_refusal(ranks: int) -> str | None:
    """Why `ranks` rank processes cannot be started on this system, or None. They inherit one end of a pipe by its
    file descriptor (`pass_fds`), which Windows has not."""
    if ranks > 1 and sys.platform == "win32":
        return (f"gpus={ranks}: starting rank processes needs a POSIX system (Linux or macOS), not {sys.platform}; "
                "run one rank, or start the ranks with torchrun")
    return None
