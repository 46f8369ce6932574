"""Linux, macOS and Windows: `import moe` and one rank work wherever the Linux-only APIs are missing; rank processes
need a POSIX system and refuse elsewhere in one line. The missing APIs are simulated: removed from `os`, `resource`
made unimportable, `sys.platform` changed where the code asks it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe import MoEModel, host
from tests.checkpoints import ROOT, SHIPPED

WITHOUT_LINUX_APIS = """
import os, sys
for name in ("sched_getaffinity", "sched_setaffinity"):
    delattr(os, name)  # macOS and Windows have neither
sys.modules["resource"] = None  # Windows has none
import builtins
real_open = builtins.open
def no_proc(path, *a, **k):  # no /proc: macOS, Windows
    if str(path).startswith("/proc/"):
        raise FileNotFoundError(path)
    return real_open(path, *a, **k)
builtins.open = no_proc
from moe import MoEModel
from moe.host import usable_cores
print("cores", usable_cores())
for gpus in (1, 2):
    with MoEModel.from_pretrained(sys.argv[1], gpus=gpus) as model:
        print(gpus, model.generate([[1, 415, 1077]], max_new_tokens=4), len(model.peak_memory_mib()) == gpus)
"""


@pytest.mark.multiprocess
def test_without_linux_apis_one_rank_and_rank_processes_run():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", WITHOUT_LINUX_APIS, str(SHIPPED)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == f"cores {os.cpu_count()}"
    one, two = (line.split(" ", 1)[1] for line in lines[1:3])
    assert one == two and one.endswith("True"), lines


def test_host_answers_without_the_linux_apis(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.delattr(os, "sched_setaffinity")
    monkeypatch.setitem(sys.modules, "resource", None)
    assert host.usable_cores() == (os.cpu_count() or 1) and host.core_ids() == list(range(host.usable_cores()))
    assert not host.can_pin()
    assert host.rusage_peak_mib() != host.rusage_peak_mib()  # NaN: no getrusage on Windows
    assert host.process_alive(os.getpid())
    assert host.thread_cpu_s(2**22 + 1) == {}  # no such process (as no /proc): nothing, not an error
    monkeypatch.setattr(host.sys, "platform", "darwin")
    host.name_this_thread("anything")  # no prctl there: a no-op


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and /proc are Linux's")
def test_a_named_threads_cpu_is_read_back_under_its_name():
    """scripts/bench_serve.py tells the server's HTTP thread apart from its engine's by the name it gives it."""
    import threading
    import time

    spun, read = threading.Event(), threading.Event()

    def work() -> None:
        host.name_this_thread("moe-test-spin")
        while time.thread_time() < 0.1:
            pass
        spun.set()
        read.wait()  # alive (its /proc entry there) until read

    thread = threading.Thread(target=work)
    thread.start()
    spun.wait()
    spent = host.thread_cpu_s(os.getpid()).get("moe-test-spin", 0.0)
    read.set()
    thread.join()
    assert spent >= 0.05  # whole clock ticks of the 0.1 s it spun


def test_rank_processes_on_windows_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(host.sys, "platform", "win32")
    with pytest.raises(ValueError, match=r"^gpus=2: starting rank processes needs a POSIX system \(Linux or macOS\), "
                                         r"not win32; run one rank, or start the ranks with torchrun$"):
        MoEModel.from_pretrained(SHIPPED, gpus=2)
    assert host.rank_processes_refusal(1) is None


def test_a_call_from_another_thread_than_the_loading_one_warns_once(monkeypatch):
    """GNU OpenMP's pools, one per thread that runs parallel ops, outnumber the cores: the user hears why it is slow,
    once, at their own line; the loading thread's calls say nothing."""
    import threading
    import warnings

    monkeypatch.setattr(host, "usable_cores", lambda: 1)  # two pools of any size are more than one core
    monkeypatch.setattr(sys, "platform", "linux")
    with MoEModel.from_pretrained(SHIPPED) as model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate([[1, 2, 3]], max_new_tokens=2)

        def call() -> None:
            for _ in range(2):
                model.generate([[1, 2, 3]], max_new_tokens=2)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    said = [w for w in caught if "loaded on another thread" in str(w.message)]
    assert len(said) == 1 and said[0].category is RuntimeWarning and said[0].filename == __file__


def test_a_model_loaded_on_a_thread_that_ended_is_called_anywhere_without_a_warning(monkeypatch):
    """The loading thread's OpenMP pool ends with it: a call from another thread then makes the only pool."""
    import threading
    import warnings

    monkeypatch.setattr(host, "usable_cores", lambda: 1)
    loaded = []
    loader = threading.Thread(target=lambda: loaded.append(MoEModel.from_pretrained(SHIPPED)))
    loader.start()
    loader.join()
    with loaded[0] as model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate([[1, 2, 3]], max_new_tokens=2)
    assert not [w for w in caught if "loaded on another thread" in str(w.message)]
