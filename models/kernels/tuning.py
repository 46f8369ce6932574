"""The decode kernel's prefetch distance, measured on the machine at hand for the model at hand.

A decode step streams its weights once. On some CPUs the kernel's own requests for the line a few KB ahead beat the
hardware prefetcher, on others they only slow it, and the best distance moves with the rows' width. Eager decode
steps of `small` (processes alternating, 8 rounds): a Zen 5 EPYC was 1.3x faster in bf16 at 4096 bytes than at 1024;
a Zen 4 one 10% (bf16) and 18% (int8) faster with no requests than at 4096. So no distance is fixed from one machine:
when a model on the native kernels loads, its own decode-step reads (up to `MAX_BYTES` of them) are timed at each
candidate in turns, once per CPU model, thread count, weight kind and row widths, and the fastest is kept in
`prefetch.json` beside the kernels' build (about 0.1-0.3 s, once). A model whose step reads less than `MIN_BYTES`
stays in the caches, where no request matters: it is not measured. `MOE_PREFETCH_BYTES=N` sets the distance
instead. A request never changes a bit, only when the weights arrive.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models.kernels import cpuinfo, native

CANDIDATES = (0, 1024, 4096)  # bytes ahead; 0: no requests
KINDS = {torch.bfloat16: "bfloat16", torch.int8: "int8"}  # weights that take requests (fp32's never: matvec.cpp)
ENV = "MOE_PREFETCH_BYTES"
MIN_BYTES = 32 * 2**20  # a step reading less may stay in a last-level cache (32 MB on the EPYCs measured)
MAX_BYTES = 256 * 2**20  # the reads timed: a few ms at each candidate
ROUNDS = 9
TIE = 0.02  # medians this close are one speed: measurements of one machine differed by as much

# (weight [E, out, in] or [out, in], rows per expert [E] or None, scale or None): one `native.grouped` call
Read = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
_distances = {kind: 0 for kind in KINDS.values()}  # what the kernels were last told


def machine_key() -> str:
    """What the best distance depends on besides the model: the CPU model (family and model number: the name alone
    may say just "AMD EPYC") and the threads that read."""
    fields = cpuinfo.fields()
    cpu = " ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "model name"))
    return f"{cpu if fields else platform.processor()}; {torch.get_num_threads()} threads"


def tune(reads: list[Read], clock: Callable[[], float] = time.perf_counter) -> dict[str, int]:
    """Set the distance for the weight kind of `reads` (a model's decode step, `models.weights.decode_reads`):
    `MOE_PREFETCH_BYTES`, else this machine's cached measurement for such reads, else measured now and cached.
    The distances in force after, by kind."""
    asked = os.environ.get(ENV)
    if asked is not None:
        if not asked.isdigit() or int(asked) > 65536:
            raise ValueError(f"{ENV}={asked!r}: a number of bytes from 0 to 65536")
        return _set(dict.fromkeys(KINDS.values(), int(asked)))
    reads = [r for r in reads if r[0].dtype in KINDS]
    if not reads or sum(_bytes(r) for r in reads) < MIN_BYTES:
        return dict(_distances)
    kind = KINDS[reads[0][0].dtype]
    widths = sorted({r[0].shape[-1] * r[0].element_size() for r in reads})
    key = f"{machine_key()}; {kind}; rows of {', '.join(map(str, widths))} bytes"
    return _set({kind: _cached_or_measured(native.built_library().parent / "prefetch.json", key, reads, clock)})


def _set(distances: dict[str, int]) -> dict[str, int]:
    _distances.update(distances)
    native._ops.set_prefetch(_distances["bfloat16"], _distances["int8"])
    return dict(_distances)


def _cached_or_measured(path: Path, key: str, reads: list[Read], clock) -> int:
    """One process measures at a time (ranks loading together wait for the first, then read its result); a cache
    that cannot be locked, read or written means a measurement that is not kept, never a failure."""
    import fcntl  # POSIX; the native kernels build on Linux only

    try:
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        return measure(reads, clock)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read(path)
        if key not in known:
            known[key] = measure(reads, clock)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(known, indent=1))
                tmp.replace(path)
            except OSError:
                tmp.unlink(missing_ok=True)
        return known[key]


def _read(path: Path) -> dict[str, int]:
    """The cached choices, only well-formed entries (a corrupt or foreign file is measured over)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if v in CANDIDATES} if isinstance(data, dict) else {}


def measure(reads: list[Read], clock: Callable[[], float] = time.perf_counter) -> int:
    """The candidate whose median time over `ROUNDS` passes of `reads` (up to `MAX_BYTES`) is lowest, or the shortest
    distance within `TIE` of it (a request earns its place); the candidates take turns within a round, so that a
    change in the memory's speed meets them all."""
    started, taken, total = clock(), [], 0
    for r in reads:
        if total < MAX_BYTES:
            taken.append((torch.ones(_rows(r), r[0].shape[-1], dtype=torch.bfloat16), *r))
            total += _bytes(r)
    times: dict[int, list[float]] = {c: [] for c in CANDIDATES}
    for round_ in range(ROUNDS + 1):
        for c in CANDIDATES if round_ % 2 else CANDIDATES[::-1]:
            native._ops.set_prefetch(c, c)
            t = clock()
            for x, w, counts, scale in taken:
                native.grouped(x, w, counts, scale)
            if round_:  # round 0 warms the pages and the branch predictors
                times[c].append(clock() - t)
    medians = {c: statistics.median(times[c]) for c in CANDIDATES}
    best = min(c for c in CANDIDATES if medians[c] <= min(medians.values()) * (1 + TIE))
    native._ops.set_prefetch(_distances["bfloat16"], _distances["int8"])
    print(f"measured the decode kernel's prefetch distance on this CPU for this model's weights: {best} bytes "
          f"({clock() - started:.1f} s, once per CPU and row widths)", file=sys.stderr)
    return best


def _rows(r: Read) -> int:
    return 1 if r[1] is None else int(r[1].sum())


def _bytes(r: Read) -> int:
    """The bytes a call reads: the weights of the experts that get rows."""
    w, counts, _ = r
    per_weight = w.shape[-2] * w.shape[-1] * w.element_size()
    return per_weight * (1 if counts is None else int((counts > 0).sum()))
