"""Where ranks run, decided the same way everywhere: CUDA with a GPU per rank, CPU without GPUs, and an error
(never a silent fall back) in between. Torchrun's machines choose from LOCAL_WORLD_SIZE and must agree."""

from __future__ import annotations

import pytest

from moe.parallel.devices import agree_on_device, backend_for, resolve_device, torchrun_layout


@pytest.mark.parametrize("device,ranks,gpus,want", [
    ("auto", 1, 0, "cpu"), ("auto", 4, 0, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 4, 4, "cuda"),
    ("auto", 2, 8, "cuda"), ("cpu", 4, 8, "cpu"), ("cuda", 2, 2, "cuda"), ("cuda:1", 1, 2, "cuda"),
])
def test_device_choice(device, ranks, gpus, want):
    assert resolve_device(device, ranks, gpus) == want


@pytest.mark.parametrize("device,ranks,gpus,message", [
    ("auto", 4, 1, "4 GPU ranks on this machine but only 1 CUDA device(s); use --device cpu"),
    ("cuda", 2, 1, "2 GPU ranks on this machine but only 1 CUDA device(s); use --device cpu"),
    ("cuda", 1, 0, "device=.cuda. but no CUDA device is visible; use --device cpu"),
    ("tpu", 1, 0, "device='tpu': use one of auto, cuda, cpu"),
    ("cuda:0", 2, 2, "device='cuda:0': use one of auto, cuda, cpu"),
])
def test_device_errors_are_one_line_and_say_what_to_do(device, ranks, gpus, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as e:
        resolve_device(device, ranks, gpus)
    assert "\n" not in str(e.value)


def test_backends():
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"


def test_torchrun_layout_of_the_readmes_two_machines():
    """2 machines x 2 GPUs: WORLD_SIZE 4, each machine decides for its own 2 local ranks."""
    machine_b = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    rank, world, local_rank, local_world = torchrun_layout(machine_b)
    assert (rank, world, local_rank, local_world) == (3, 4, 1, 2)
    assert resolve_device("auto", local_world, 2) == "cuda"  # not CPU because 2 GPUs < WORLD_SIZE 4
    assert torchrun_layout({"RANK": "0", "WORLD_SIZE": "2"}) == (0, 2, 0, 2)  # one machine, older launchers


class FakeStore:
    """The rendezvous store's two calls, as the ranks of one job share it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_machines_that_choose_alike_pass():
    store = FakeStore()
    for rank in range(4):
        store.set(f"moe/device/{rank}", "cuda")
    agree_on_device(store, 0, 4, "cuda")


def test_machines_with_different_gpu_counts_are_an_error_not_a_hang():
    """Machine A has 2 GPUs (cuda), machine B none (cpu): NCCL beside gloo would hang; this is one error."""
    store = FakeStore()
    for rank, kind in enumerate(["cuda", "cuda", "cpu", "cpu"]):
        store.set(f"moe/device/{rank}", kind)
    with pytest.raises(ValueError, match=r"ranks disagree on their device: cpu on ranks \[2, 3\]; cuda on ranks "
                                         r"\[0, 1\]"):
        agree_on_device(store, 0, 4, "cuda")


def test_memory_is_labelled_per_rank():
    from moe.memory import MemoryUse, describe

    assert describe([MemoryUse(260.4)]) == "peak RSS 260 MiB"
    assert describe([MemoryUse(260), MemoryUse(254)]) == "peak RSS per rank 260/254 MiB"
    gpus = [MemoryUse(900, 100, 128, 150), MemoryUse(880, 90, 128, 140)]
    assert describe(gpus) == ("GPU peak 150/140 MiB, allocated 100/90 MiB, reserved 128/128 MiB; "
                              "host peak RSS per rank 900/880 MiB")


@pytest.mark.parametrize("call", ["broadcast", "all_reduce", "send"])
def test_a_cpu_tensor_never_reaches_nccl(call):
    """The guard fires before torch.distributed is touched, so it is checked here without GPUs."""
    import torch

    from moe.parallel.distributed import DistContext

    ctx = DistContext(1, 2, torch.device("cuda", 1), "nccl")
    args = {"broadcast": (torch.zeros(3), 0), "all_reduce": (torch.zeros(3),), "send": (torch.zeros(3), 0)}[call]
    with pytest.raises(RuntimeError, match=r"rank 1: a cpu tensor \[3\] was handed to an NCCL collective"):
        getattr(ctx, call)(*args)
