"""The decode step compiled ahead of time: built once into a file (AOTInductor) and loaded in milliseconds later.

`torch.compile` re-traces the step in every new process (16 s before the first token of `small` with a warm
inductor cache, issue 47), so the compiled step paid for itself only after about 1,500 tokens. Here the step is
exported once (`torch.export`), compiled by AOTInductor into a package in the step cache (`cache_dir`) and, in later
processes, loaded without dynamo or inductor and called from C++ with the step's tensors.

The model's weights are inputs of the package, never part of it: during the export every tensor the step reads
(what one eager step's operations touch, and what the traced step's own branches read) is swapped, wherever the
model holds it, for an input of the exported function. The package is a few MB whatever the model's size, one
package serves every checkpoint of the same shape, and the weights are read in place.

A package is found by its key: the model's config, dtype and kernels, the batch and cache length, the torch version
and the source of the model's code (`step_key`). It also records the shape and dtype of every input it takes;
one whose record does not match this model, or that does not load, is rebuilt, never run. Writes are atomic
(a temporary name renamed into place), so an interrupted build leaves nothing that looks built.

One rank on the CPU, with the native kernels (`models.kernels`): oneDNN-packed weights cannot be traced and N
ranks keep `torch.compile` (`moe.engine.compiled`), whose collectives are Python ops. Never run on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.kv_cache import KVCache
from models.router import Router
from models.transformer import Transformer
from moe.engine.compiled import CACHE_BUCKET
from moe.engine.tensor_slots import TensorSlots
from moe.progress import Progress

CODE = [Path(__file__).resolve().parents[2] / "models", Path(__file__).resolve()]  # what the step's graph comes from


def ahead_compilable(model: Transformer) -> bool:
    """One rank's whole model on the CPU with the native kernels (not oneDNN's packed weights)."""
    choice = getattr(model, "kernel_choice", None)
    return (choice is not None and choice.native  # only ever on the CPU, and only where auto or native was asked
            and model.tok_embeddings is not None and len(model.held_blocks) == model.cfg.n_layers)


def cache_dir() -> Path:
    """$MOE_STEP_CACHE, else moe/steps in the user's cache folder."""
    root = os.environ.get("MOE_STEP_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe" / "steps"


@functools.cache
def code_digest() -> str:
    """The source of everything the step's graph is traced from, and the native kernels it calls (read once a
    process)."""
    h = hashlib.sha256()
    for root in CODE:
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        for f in files:
            if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
                h.update(f.relative_to(root.parent).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def step_key(model: Transformer, batch: int, length: int) -> str:
    """Everything that changes the compiled code of a decode step of this model."""
    what = dict(config=repr(model.cfg), dtype=str(model.norm.weight.dtype),  # the kernels: with their build's flavour
                kernels=repr(getattr(model, "kernel_choice", None)), blocks=list(model.held_blocks), batch=batch,
                length=length, torch=torch.__version__, code=code_digest())
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


class _Reads(TorchDispatchMode):
    """Ids of every tensor an operation receives."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor):
                self.ids.add(id(a))
        return func(*args, **(kwargs or {}))


def _example(batch: int) -> list[torch.Tensor]:
    """Tokens [B, 1], the cache slot [1] and each sequence's left padding [B] (zeros: no padding)."""
    return [torch.ones(batch, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long)]


def eager_steps(model: Transformer, caches: dict[str, KVCache], batch: int) -> None:
    """An eager step that leaves no trace: it makes what the model makes at first use (the rotary table), and the
    load counters are put back as they were."""
    buffers = [b.clone() for b in model.buffers()]
    tokens, slot, pad = _example(batch)
    with torch.inference_mode():
        model.decode_step(tokens, slot, caches, pad)
        for b, saved in zip(model.buffers(), buffers, strict=True):
            b.copy_(saved)


def step_reads(model: Transformer, caches: dict[str, KVCache], batch: int) -> set[int]:
    """Ids of the tensors an eager decode step reads (a traced step can take other branches: `export_step` adds
    the model's tensors those read)."""
    eager_steps(model, caches, batch)
    reads = _Reads()
    with reads:
        eager_steps(model, caches, batch)
    return reads.ids


class _Step(torch.nn.Module):
    """What is exported: the decode step as a function of its inputs, the model's tensors among them."""

    def __init__(self, model: Transformer, slots: TensorSlots, names: list[str]) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: its tensors come in as inputs
        self.slots, self.names = slots, names

    def forward(self, tokens_B1, slot, pad_B, kv: list[torch.Tensor], weights: list[torch.Tensor]):
        caches = {name: KVCache.holding(kv[2 * i], kv[2 * i + 1]) for i, name in enumerate(self.names)}
        with self.slots.swapped(weights):
            return self.model.decode_step(tokens_B1, slot, caches, pad_B)


def export_step(model: Transformer, caches: dict[str, KVCache], batch: int):
    """(the exported step, its TensorSlots, its example inputs). A traced step takes the compiled branches of the
    model's code (more rows on the streaming kernel, for one), so a model tensor only they read shows up as a
    constant of the first export: it becomes an input and the step is exported again. A constant that is no tensor
    of the model is refused."""
    fixed, wanted = _example(batch), step_reads(model, caches, batch)
    kv = [t for c in caches.values() for t in (torch.zeros_like(c.k), torch.zeros_like(c.v))]
    slots = TensorSlots.of(model, wanted)
    for _ in range(3):
        with torch.no_grad(), _quiet_torch():
            exported = torch.export.export(_Step(model, slots, list(caches)), (*fixed, kv, slots.read()),
                                           strict=False)
        if not exported.constants:
            return exported, slots, [*fixed, *kv, *slots.read()]
        wanted = wanted | {id(t) for t in exported.constants.values()}
        more = TensorSlots.of(model, wanted)
        if len(more.paths) == len(slots.paths):  # none of the constants is a tensor of the model
            break
        slots = more
    raise RuntimeError(f"the exported step holds {len(exported.constants)} tensors that are not the model's")


@contextlib.contextmanager
def _quiet_torch():
    """Without the FutureWarnings of torch's own pytree use during export and packaging (not ours to act on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _specs(tensors: list[torch.Tensor]) -> list[list]:
    return [[list(t.shape), str(t.dtype)] for t in tensors]


def build_package(model: Transformer, batch: int, length: int, path: Path, note=print,
                  progress: bool = True) -> None:
    """Export and compile the step for this batch and cache length into `path` (atomically), with a bar of its two
    phases."""
    from torch._inductor import aoti_compile_and_package

    note(f"compiling the decode step ahead of time for batch {batch} and {length} cache slots, once: about half a "
         f"minute on a 2-core CPU (a minute the first time on a machine); kept in {path.parent} ($MOE_STEP_CACHE)")
    started = time.perf_counter()
    bar = Progress("compiling the decode step", unit="phase", enabled=progress).start(2)
    try:
        exported, slots, inputs = export_step(model, model.make_caches(batch, length), batch)
        bar.update(1, phase="AOTInductor")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
        meta = dict(key=path.stem, inputs=json.dumps(_specs(inputs)), slots=json.dumps(slots.paths))
        try:
            with _quiet_torch():
                aoti_compile_and_package(exported, package_path=str(partial),
                                         inductor_configs={"aot_inductor.metadata": meta})
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        bar.update(1)
    finally:
        bar.close()
    note(f"compiled in {time.perf_counter() - started:.0f} s ({len(slots.paths)} of the model's tensors as inputs): "
         f"{path}")


class AheadStep:
    """A loaded package and the tensors it is called with."""

    def __init__(self, model: Transformer, path: Path, batch: int, length: int) -> None:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        meta = loader.get_metadata()
        if meta.get("key") != path.stem:
            raise RuntimeError("the package's key is not its name")
        self.slots = TensorSlots.at(model, json.loads(meta["slots"]))
        self.weights = self.slots.read()
        self.specs = json.loads(meta["inputs"])
        self.loader, self.batch, self.length = loader, batch, length

    def check(self, inputs: list[torch.Tensor]) -> None:
        """The package was built for tensors of exactly these shapes and dtypes."""
        if _specs(inputs) != self.specs:
            raise RuntimeError("the package's inputs do not match this model")


class AheadDecode:
    """A one-rank engine's compiled steps, a package per batch size and cache length (rounded up as
    `moe.engine.compiled` rounds them). `may_build`: build a missing package (`compile=True`), else only use one
    already built (the default, `compile=None`)."""

    def __init__(self, model: Transformer, may_build: bool, note=None) -> None:
        self.model, self.may_build = model, may_build
        self.note = note or (lambda line: print(line, file=sys.stderr, flush=True))
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.steps: dict[tuple[int, int], AheadStep] = {}
        self.missing: set[tuple[int, int]] = set()  # shapes looked for that had no usable package
        self.slot = torch.zeros(1, dtype=torch.long)
        # the caches of the request being decoded, its step and that step's inputs but the tokens and padding (`bind`)
        self.bound: tuple[dict[str, KVCache], AheadStep | None, list, torch.Tensor] | None = None

    def cache_length(self, batch: int, length: int) -> int:
        """The cache length for a request of `batch` sequences and `length` positions: rounded up to a package's
        where one will run (one is cached, or may be built at its first decode step), else `length` itself."""
        slots = bucket(length, self.model.cfg.max_seq_len)
        return slots if self.may_build or self.step_at(batch, slots, build=False) is not None else length

    def step_at(self, batch: int, length: int, build: bool | None = None) -> AheadStep | None:
        """The step for caches of exactly this batch and length (built if missing where `build`, by default
        `may_build`): looked for once per shape, then remembered."""
        build = self.may_build if build is None else build
        key = (batch, length)
        if any(r.round_robin or r.track_entropy for r in self.routers):  # modes a package is not built with
            return None
        if key not in self.steps and (build or key not in self.missing):
            step = self._load_or_build(batch, length, build)
            if step is not None:
                self.steps[key] = step
            self.missing.add(key)  # looked for (and, where allowed, built): never again, whatever came of it
        return self.steps.get(key)

    def decode(self, tokens_B1: torch.Tensor, start: int, pad_B: torch.Tensor | None,
               caches: dict[str, KVCache]) -> torch.Tensor | None:
        """Logits [B, V] of one step on `caches` through their shape's package; None where there is none. The step
        and its inputs are found at a request's first step (`bind`) and reused for the rest: between two steps only
        the tokens, the slot and the padding change (each Python line of this path costs 5-15 us a step on a CPU,
        run just after a step whose weights pushed it out of the caches)."""
        if self.bound is None or self.bound[0] is not caches:
            self.bind(caches)
        _, step, inputs, no_pad = self.bound
        if step is None:
            return None
        self.slot.fill_(start)
        inputs[0] = tokens_B1.contiguous()  # a column of the sampler's packed rows (logprobs): a package reads rows
        inputs[2] = pad_B if pad_B is not None else no_pad
        return step.loader.run(inputs)[0]

    def bind(self, caches: dict[str, KVCache]) -> None:
        """The step for `caches` (None: no package for their shape, or routers in a mode no package is built
        with), and its inputs: the tokens, the slot, the padding, the caches' tensors, the model's."""
        step, batch = None, 0
        if caches:
            k = next(iter(caches.values())).k
            step, batch = self.step_at(k.shape[0], k.shape[2]), k.shape[0]
        kv = [t for c in caches.values() for t in (c.k, c.v)]
        self.bound = (caches, step, [None, self.slot, None, *kv, *(step.weights if step is not None else ())],
                      torch.zeros(batch, dtype=torch.long))  # the padding of a batch with none (the package reads it)

    def unbind(self) -> None:
        """Forget the bound request (its caches are freed, or the routers' modes change)."""
        self.bound = None

    def _load_or_build(self, batch: int, length: int, build: bool) -> AheadStep | None:
        """Loaded from the cache, or built there when `build` (a package that fails its checks is rebuilt then, and
        otherwise left unused)."""
        path = cache_dir() / f"{step_key(self.model, batch, length)}.pt2"
        for attempt in range(2):
            if path.exists():
                caches = self.model.make_caches(batch, length)  # for the checks only: each request makes its own
                kv, fixed = [t for c in caches.values() for t in (c.k, c.v)], _example(batch)
                eager_steps(self.model, caches, batch)  # what the model makes at first use, before its tensors bind
                try:
                    step = AheadStep(self.model, path, batch, length)
                    step.check([*fixed, *kv, *step.weights])
                    return step
                except Exception as exc:  # a corrupt, truncated or foreign package: never run
                    self.note(f"the compiled step {path} cannot be used ({str(exc).splitlines()[0]}); "
                              + ("rebuilding it" if build else "running eager steps"))
                    if not build:
                        return None
                    path.unlink(missing_ok=True)
            if not build or attempt:
                return None
            build_package(self.model, batch, length, path, self.note)
        return None


def bucket(length: int, most: int) -> int:
    return max(length, min(-(-length // CACHE_BUCKET) * CACHE_BUCKET, most))
