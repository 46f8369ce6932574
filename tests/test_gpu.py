"""GPU tests: `pytest -m gpu`. Each skips without CUDA, or with fewer GPUs than it needs; on a machine with
GPUs they check what the CPU suite cannot: the same answers on CUDA, NCCL between GPU ranks, sampling with a
generator on the device, training and saving from GPUs, and the decode step's host syncs as CUDA sees them."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from moe import MoEModel
from moe.generation import SamplingParams, generate_tokens
from moe.parallel.distributed import single_process
from tests.checkpoints import ROOT, TRAINED

PROMPT = "It is a truth universally acknowledged, that"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA device(s), found {GPUS}")


pytestmark = [pytest.mark.gpu, needs_gpus(1)]


@pytest.fixture(scope="module")
def on_cpu():
    with MoEModel.from_pretrained(TRAINED, device="cpu", cpu_kernels="torch") as model:
        yield model


@pytest.fixture(scope="module")
def on_gpu():
    with MoEModel.from_pretrained(TRAINED, device="cuda") as model:
        yield model


IDS = torch.tensor([[1, 415, 1077, 300, 22, 19, 7], [1, 33, 1800, 5, 5, 61, 900]])


def test_one_gpu_gives_the_cpu_answer(on_cpu, on_gpu):
    assert on_gpu.info.launch == "local" and on_gpu.memory()[0].gpu_peak > 0
    torch.testing.assert_close(on_gpu(IDS).cpu(), on_cpu(IDS), rtol=0, atol=1e-4)
    assert on_gpu.generate([PROMPT], max_new_tokens=32) == on_cpu.generate([PROMPT], max_new_tokens=32)


def test_sampling_with_a_seed_on_the_gpu(on_gpu):
    runs = [on_gpu.generate([PROMPT], max_new_tokens=16, temperature=0.9, seed=s) for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_int8_on_a_gpu_gives_the_cpus_int8_answer():
    """dtype="int8" on CUDA: decode rows through torch's own weight-only kernel (`_weight_int8pack_mm`, the int8
    weight read as it is), prompts as a bf16 product of the int8 values; the CPU runs the same ops with
    `cpu_kernels="torch"`."""
    with MoEModel.from_pretrained(TRAINED, device="cpu", dtype="int8", cpu_kernels="torch") as cpu, \
            MoEModel.from_pretrained(TRAINED, device="cuda", dtype="int8") as gpu:
        assert (gpu(IDS).cpu().float() - cpu(IDS).float()).abs().max().item() < 0.1  # bf16 sums in another order
        assert gpu.generate([PROMPT], max_new_tokens=32) == cpu.generate([PROMPT], max_new_tokens=32)


def test_compiled_decode_on_a_gpu_is_a_cuda_graph_with_the_eager_tokens(on_gpu):
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    skips = counters["inductor"]["cudagraph_skips"]
    with MoEModel.from_pretrained(TRAINED, device="cuda", compile=True) as model:
        assert model.generate([PROMPT], max_new_tokens=32) == on_gpu.generate([PROMPT], max_new_tokens=32)
    assert counters["inductor"]["cudagraph_skips"] == skips  # inductor captured the step, skipped nothing
    assert cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False) is not None


@needs_gpus(2)
@pytest.mark.parametrize("attention, experts", [("tensor", "tensor"), ("tensor", "expert"), ("layer", "tensor")])
def test_tensor_parallel_gpus_give_the_one_gpu_answer(on_gpu, attention, experts):
    """NCCL subgroups, the row-parallel all-reduces and the point-to-point moves of the hidden states."""
    with MoEModel.from_pretrained(TRAINED, device="cuda", gpus=2, attention=attention, experts=experts) as model:
        torch.testing.assert_close(model(IDS), on_gpu(IDS).cpu(), rtol=0, atol=1e-4)
        assert model.generate([PROMPT], max_new_tokens=32) == on_gpu.generate([PROMPT], max_new_tokens=32)


@needs_gpus(2)
def test_n_gpus_give_the_one_gpu_answer(on_gpu):
    with MoEModel.from_pretrained(TRAINED, device="cuda", gpus=GPUS) as model:
        assert model.info.backend == "nccl"
        torch.testing.assert_close(model(IDS), on_gpu(IDS).cpu(), rtol=0, atol=1e-4)
        assert model.generate([PROMPT], max_new_tokens=32) == on_gpu.generate([PROMPT], max_new_tokens=32)
        sampled = model.generate([PROMPT], max_new_tokens=16, temperature=0.9, seed=7)
    assert sampled == on_gpu.generate([PROMPT], max_new_tokens=16, temperature=0.9, seed=7)


def test_training_step_on_a_gpu_matches_the_cpu():
    from tests.test_training import one_step

    cpu, gpu = one_step(single_process("cpu")), one_step(single_process("cuda"))
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-5) and gpu["norm"] == pytest.approx(cpu["norm"], rel=1e-4)
    for name, grad in gpu["grads"].items():
        torch.testing.assert_close(grad, cpu["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


@needs_gpus(2)
def test_training_step_on_two_gpus_matches_one(tmp_path):
    from moe.parallel.distributed import init_process_group
    from moe.workers.group import run_ranks
    from tests.test_training import one_step

    run_ranks(_gpu_rank_step, 2, str(tmp_path))
    ref = one_step(single_process("cuda"))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    del init_process_group


def _gpu_rank_step(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from moe.parallel.distributed import init_process_group
    from tests.test_training import one_step

    ctx = init_process_group(rank, world_size, "127.0.0.1", port, "cuda")
    torch.save(one_step(ctx), f"{out_dir}/rank{rank}.pt")
    ctx.destroy()


def test_save_from_gpus_loads_on_the_cpu(on_cpu, tmp_path):
    with MoEModel.from_pretrained(TRAINED, device="cuda", gpus=GPUS) as model:
        model.save_pretrained(tmp_path / "copy", max_shard_size="5MB")
    with MoEModel.from_pretrained(tmp_path / "copy", device="cpu", cpu_kernels="torch") as copy:
        assert torch.equal(copy(IDS), on_cpu(IDS))


def test_torchrun_with_nccl_writes_the_one_process_text(on_cpu):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(GPUS), str(ROOT / "scripts" / "generate.py"), "--ckpt", str(TRAINED), "--device", "cuda",
                           "--prompt", PROMPT, "--max-new-tokens", "24", "--seed", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = next(line for line in proc.stdout.splitlines() if line.startswith(PROMPT))
    assert text == PROMPT + on_cpu.generate([PROMPT], max_new_tokens=24)[0]
    assert "GPU peak" in proc.stdout


def test_decode_step_host_syncs_as_cuda_counts_them(on_gpu):
    """CUDA's own sync detector (torch.cuda.set_sync_debug_mode) over a decode step: at most one sync per block
    and two for the tokens, the budget the CPU suite checks by counting calls (tests/test_host_syncs.py)."""
    prompts = [[1, 15, 27, 99, 7], [1, 300, 41, 8, 8]]
    counts = []
    for n in (4, 12):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate_tokens(on_gpu.engine, prompts, SamplingParams(n, 0.0, 1.0, 0, 0), (), 10**6)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    per_step = (counts[1] - counts[0]) / 8
    assert per_step <= on_gpu.config.n_layers + 2, counts
