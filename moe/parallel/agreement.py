"""Ranks that must compute the same bits check that they do: at load, the kernels and the settings that change
bits (`KernelChoice.settings`) are compared across every rank's load report, and a difference stops the load with
one line naming the rank and the setting; while running, ranks that route the same tokens compare a checksum of
their routing once per request (`RoutingDiverged`), so a silent divergence becomes a clear error."""

from __future__ import annotations

import torch


class RanksDisagree(ValueError):
    """Ranks loaded with different kernels or settings: a setup error (one line, exit status 2)."""


class RoutingDiverged(RuntimeError):
    """Ranks that route the same tokens chose different experts: their kernels or inputs differ."""


def agreed(error: Exception) -> Exception:
    """Mark a user error that every rank raises at the same point, after a collective told each of them (a save
    whose directory rank 0 could not make): the ranks are in step, so the model stays usable
    (`moe.workers.rank.serve`), where any other error after a collective ends it."""
    error.agreed_by_all_ranks = True
    return error


def check_reports_agree(reports: list[dict], key: str = "kernel_settings") -> None:
    """Every rank's `key` equals rank 0's, or one line that names the first rank and setting that differ."""
    first = reports[0].get(key) or {}
    for rank, report in enumerate(reports[1:], start=1):
        other = report.get(key) or {}
        name = next((n for n in sorted(set(first) | set(other)) if first.get(n) != other.get(n)), None)
        if name is not None:
            raise RanksDisagree(f"rank {rank} loaded with {name}={other.get(name)!r} where rank 0 has "
                                f"{first.get(name)!r}: every rank must run the same kernels and settings (the same "
                                "torch, cpu_kernels and MOE_CPU_KERNELS, on CPUs of one kind)")


def check_routing_agrees(checks_RL: torch.Tensor, alike: dict[int, tuple[int, ...]]) -> None:
    """`checks_RL`: each rank's routing checksum per block (all-gathered); `alike`: per block, the ranks that routed
    the same tokens. Raises on every rank alike (every rank holds the same gathered checksums)."""
    for block, ranks in sorted(alike.items()):
        values = checks_RL[list(ranks), block]
        if (values != values[0]).any():
            other = ranks[int((values != values[0]).nonzero()[0])]
            raise RoutingDiverged(f"ranks {ranks[0]} and {other} routed the same tokens of block {block} to different "
                                  "experts: their kernels, settings or inputs differ, and the text would be wrong")
