"""What this machine and process offer, asked portably: Linux has APIs that macOS and Windows lack (a process's CPU
affinity, /proc, `resource`, passing a file descriptor to a child). One rank runs everywhere; rank processes
started here need a POSIX system (`rank_processes_refusal`); elsewhere each answer falls back to what exists.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import warnings

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


def name_this_thread(name: str) -> None:
    """The thread's name as `top -H`, `ps -L` and /proc show it (Linux; at most 15 bytes); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` writes every thread's Python stack to stderr and the process goes on: a server that seems
    stuck says where it is (POSIX; Windows has no SIGUSR1)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (a server's rank processes), from /proc; [pid] where there is none."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        try:
            for tid in os.listdir(f"/proc/{tree[-1]}/task"):
                with open(f"/proc/{tree[-1]}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return tree


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) a process's threads have spent, summed by thread name; {} where /proc is not."""
    spent: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return spent
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:  # the thread ended meanwhile
            continue
        fields = tail.split()  # after "pid (name)": state, ...; utime and stime are the 14th and 15th of the line
        name = head.split("(", 1)[1]
        spent[name] = spent.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return spent


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


class ThreadWatch:
    """Warns once when a model that computes in this process on a CPU is called on another thread than the one that
    loaded it. GNU OpenMP (torch's on Linux) keeps a pool of threads for each thread that runs parallel ops; once
    the pools hold more threads than the cores, its threads sleep between ops instead of spinning, and every op
    waits for them to wake: `generate` of a 64-token answer took 2.5-3.5x as long from a second thread (`small`,
    2 threads on a 2-core AMD EPYC Zen 5), and as long as on the loading thread when loaded on that thread too. A
    thread's pool ends with it: once the loading thread has ended, the next caller's thread is the model's own."""

    def __init__(self, computes_here: bool) -> None:
        self.home, self.armed = threading.current_thread(), computes_here and sys.platform == "linux"

    def check(self) -> None:
        if not self.armed or threading.current_thread() is self.home:
            return
        if not self.home.is_alive():  # its pool went with it: the caller's is the only one
            self.home = threading.current_thread()
            return
        self.armed = False
        import torch

        threads, cores = torch.get_num_threads(), usable_cores()
        if 2 * threads > cores:
            warnings.warn(f"this model was loaded on another thread: each thread that runs it keeps a pool of "
                          f"{threads} OpenMP threads, together more than the {cores} cores, so every parallel op waits "
                          "for sleeping threads to wake (decode measured 2.5-3.5x slower); load the model on the "
                          "thread that calls it", RuntimeWarning, stacklevel=_outside_the_package())


def _outside_the_package() -> int:
    """The stack level of the first caller outside this package (and contextlib): a warning names the user's line."""
    package, level, frame = os.path.dirname(os.path.abspath(__file__)), 1, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(package) or
                                 os.path.basename(frame.f_code.co_filename) == "contextlib.py"):
        frame, level = frame.f_back, level + 1
    return level
