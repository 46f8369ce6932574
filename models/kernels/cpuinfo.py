"""What /proc/cpuinfo says of this CPU (Linux; elsewhere nothing), read once: the kernels' build flags
(`models.kernels.native`), the prefetch measurement's key (`models.kernels.tuning`) and the benchmarks' machine
line (`moe.host.cpu_name`)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def fields() -> dict[str, str]:
    """Each field's first value (the first processor's): "vendor_id", "cpu family", "model", "model name", ..."""
    found: dict[str, str] = {}
    for line in _lines():
        name, _, value = line.partition(":")
        found.setdefault(name.strip(), value.strip())
    return found


def flags() -> set[str]:
    """Every processor's flags together."""
    return {word for line in _lines() if line.startswith("flags") for word in line.split(":", 1)[1].split()}
