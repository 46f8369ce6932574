"""Decode on CPU: run independent matrix-vector products side by side on a small thread pool.

At decode time each expert multiplies a handful of rows by its weights. Those products are memory-bound
and MKL runs them on one thread whatever `torch.set_num_threads` says, so with two cores one sits idle,
while OpenMP's idle workers spin on it after every parallel op. Inside `side_by_side()` torch runs with
one intra-op thread and this module spreads independent products (the chosen experts, the halves of the
output head) over a pool of the original thread count; torch releases the GIL inside its kernels. Every
product is computed exactly as it would be alone, so results are bit-identical to the plain order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_workers = 0  # > 1 inside side_by_side(): threads to spread jobs over
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


@contextmanager
def side_by_side(device: torch.device) -> Iterator[None]:
    """For a forward pass over few rows (decode). No effect on GPUs or with one thread."""
    global _workers, _pool, _pool_threads
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < 2 or _workers:
        yield
        return
    if _pool_threads != threads:
        _pool, _pool_threads = ThreadPoolExecutor(threads - 1, thread_name_prefix="moe-decode"), threads
    _workers = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _workers = 0


def run_side_by_side(jobs: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Results of `jobs` in order; inside side_by_side() the jobs are split over the pool's threads."""
    threads = min(_workers, len(jobs))
    if threads < 2 or torch.is_grad_enabled():
        return [job() for job in jobs]
    inference = torch.is_inference_mode_enabled()

    def run_group(group: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        with torch.inference_mode(inference):  # inference mode is per thread: carry the caller's
            return [job() for job in group]

    size = -(-len(jobs) // threads)
    groups = [jobs[i:i + size] for i in range(0, len(jobs), size)]
    futures = [_pool.submit(run_group, g) for g in groups[1:]]
    results = run_group(groups[0])
    for f in futures:
        results += f.result()
    return results


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear; inside side_by_side() a large weight's output rows are computed in parts, one per thread."""
    if _workers < 2 or weight.shape[0] < 4096 or torch.is_grad_enabled():
        return F.linear(x, weight)
    parts = weight.chunk(_workers, dim=0)
    return torch.cat(run_side_by_side([lambda w=w: F.linear(x, w) for w in parts]), dim=-1)
