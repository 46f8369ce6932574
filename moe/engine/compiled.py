"""The decode step compiled: `torch.compile` of `Transformer.decode_step`, whose shapes never change within a
request, so it compiles once per batch size and cache length and then runs as one graph. One rank's whole model, or
on N ranks each rank's where every rank runs the whole step (`moe.engine.replicated`; its collectives are opaque ops
of the graph, `moe.parallel.distributed`).

On CPU inductor fuses the step's small operations (norms, rotary, routing, the weighted sum) around the streaming
kernel (an opaque op to it, `models.kernels.native`); on CUDA, `mode="reduce-overhead"` captures the step as a CUDA
graph (never run on CUDA yet). Caches are kept from one request to the next and their length rounded up to
`CACHE_BUCKET` slots, so a new request of the same batch size reuses both the cache and the compiled graph (the
mask hides slots past the current one, which may hold an earlier request's keys).

Weights: on CPU the step compiles with them frozen (`frozen`), constants of its graph rather than inputs of every
call; it reads them as they were when it compiled (a model's weights do not change under its steps). Caches are
not the model's state (`KVCache` is no module), so they stay inputs and one graph serves every cache of its shape.

Calls: before each call dynamo checks about 1400 guards (measured before the weights were frozen: every module,
parameter and flag the step reads). A model does not change under its step, so a call signature (input shapes,
cache, padding, routing modes) goes through dynamo and every guard once. On CPU, where that first call compiles a
graph, its compiled callable is kept (`CompiledDecode.direct`, handed over by a backend of our own), and later
calls of the signature call it with the step's inputs, without dynamo: on this repository's 2-core AVX-512 EPYC,
0.11-0.23 ms less per decode step of 1.5-2.9 ms (int8, bf16; git log docs/benchmarks.md) than entering through dynamo
with its guards skipped. A signature whose first call compiled nothing (a graph of an earlier one passed its
guards), and every signature on CUDA, runs through dynamo checking only the guards that tell this step's graphs
apart (`skip_guard_eval_unsafe`; dynamo keeps among them every input tensor's guard and every guard that ever sent
a call to another graph). Each model's step keeps its own graphs (`isolate_recompiles`), so another model's graphs
are never candidates. That stance is process-wide while a step runs: a step of another model in another thread at
that instant skips its guards too.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from models.kv_cache import KVCache
from models.router import Router
from models.transformer import Transformer

CACHE_BUCKET = 256  # cache lengths are multiples of this: few shapes, each a compile; at most 255 slots unused
# Recent torch features, looked for rather than assumed: without both every call checks every guard, as before.
ISOLATES = "isolate_recompiles" in inspect.signature(torch.compile).parameters
SKIPS_GUARDS = ISOLATES and hasattr(torch.compiler, "set_stance") and \
    "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


def frozen(device: torch.device):
    """Where a step compiles: on CPU with the model's weights frozen into its graph (inductor's `freezing`), so
    they are constants of the C++ wrapper rather than about 120 inputs that every call passes, guards and
    checks (0.15-0.6 ms of a 2.5-4.7 ms step). Dynamo reads the flag while it traces, so it is set around the
    calls that may compile; on CUDA (never run there) the step compiles as before.

    Without freezing's weight prepacking: the only plain products left in the step are the routers' (every
    other weight is our kernel's), and prepacking made each a oneDNN linear, about 12 us a call for one row
    against 8 x 512 where eager's `F.linear` (an aten mm) takes 2-3 us. Unpacked they stay that mm, so the
    compiled routers compute eager's logits with eager's kernel."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return torch._inductor.config.patch({"freezing": True, "cpp.weight_prepack": False})


def compile_step(step, device: torch.device, isolate: bool = False, on_compile=None):
    """`step` compiled as a decode step is: one graph of static shapes; on CUDA a CUDA graph, on CPU called from a
    C++ wrapper (0.3-0.5 ms less per step than inductor's Python one). `isolate`: its own compiled graphs.
    `on_compile(graph, example_inputs, compiled)` (CPU): told of each graph inductor compiles for `step`, with the
    inputs it was traced with and the callable that runs it (dynamo calls it as `compiled(*inputs)`)."""
    own = {"isolate_recompiles": True} if isolate and ISOLATES else {}
    if device.type == "cuda":
        return torch.compile(step, fullgraph=True, dynamic=False, mode="reduce-overhead", **own)

    def inductor(graph: torch.fx.GraphModule, example_inputs: list):  # inductor, as torch.compile calls it
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(graph, example_inputs, config_patches={"cpp_wrapper": True})
        if on_compile is not None:
            on_compile(graph, example_inputs, compiled)
        return compiled

    return torch.compile(step, fullgraph=True, dynamic=False, backend=inductor, **own)


class CompiledDecode:
    def __init__(self, model: Transformer, head: bool = True) -> None:
        """`head=False`: the step stops at the last block (a rank that runs the blocks for their collectives and
        needs no logits, `moe.engine.replicated`); it returns the hidden states."""
        self.model = model
        self.device = model.device
        self.step = compile_step(model.decode_step if head else model.decode_hidden, self.device, isolate=True,
                                 on_compile=self.keep_graph)
        self.direct: dict[tuple, tuple] = {}  # signature -> (its compiled graph, the role of each of its inputs)
        self.just_compiled: tuple | None = None  # what `keep_graph` was told during the current call
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # the step's cache slot, set in place
        self.inputs: dict[str, torch.Tensor] = {}  # the step's tokens and padding, copied in (`own`)
        self.caches: dict[str, KVCache] | None = None
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.seen: set[tuple] = set()  # call signatures that went through every guard

    def caches_for(self, batch: int, length: int) -> dict[str, KVCache]:
        """Caches of at least `length` slots (rounded up to the bucket, within the model's context), kept when a
        request of the same shape comes next."""
        length = max(length, min(-(-length // CACHE_BUCKET) * CACHE_BUCKET, self.model.cfg.max_seq_len))
        current = next(iter(self.caches.values())).k.shape if self.caches else None
        if current is None or current[0] != batch or current[2] != length:
            self.caches = None  # free the old caches before allocating new ones
            with torch.inference_mode():  # whatever the caller's mode (`own` says why)
                self.caches = self.model.make_caches(batch, length)
            if self.device.type == "cuda":  # written in place inside the CUDA graph: their addresses never change
                for cache in self.caches.values():
                    torch._dynamo.mark_static_address(cache.k)
                    torch._dynamo.mark_static_address(cache.v)
        return self.caches

    def signature(self, tokens_B1: torch.Tensor, pad_B: torch.Tensor | None) -> tuple:
        """What tells one compiled graph of this model's step from another."""
        cache = next(iter(self.caches.values())).k
        pad = None if pad_B is None else (pad_B.shape, pad_B.dtype, pad_B.device)
        modes = tuple((r.round_robin, r.track_entropy) for r in self.routers)
        return (tokens_B1.shape, tokens_B1.dtype, tokens_B1.device, cache.shape, cache.dtype, pad, modes,
                torch.is_inference_mode_enabled())

    def own(self, name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """`value` copied into an inference tensor of this step's own (steps run in inference mode). Dynamo tells an
        inference tensor from another one, so a caller's tensor would send a request made under
        `torch.inference_mode()` after one made without it (or the reverse) to a new graph, which the skipped
        guards refuse."""
        if value is None:
            return None
        mine = self.inputs.get(name)
        if mine is None or mine.shape != value.shape or mine.dtype != value.dtype:
            with torch.inference_mode():
                mine = self.inputs[name] = torch.empty_like(value, device=self.device)
        return mine.copy_(value)

    def roles(self) -> dict[int, tuple]:
        """The step's input tensors, each by its role: ("tokens",), ("pad",), ("slot",), ("k", block), ("v", block)."""
        named = {("tokens",): self.inputs.get("tokens"), ("pad",): self.inputs.get("pad"), ("slot",): self.slot}
        for name, cache in (self.caches or {}).items():
            named[("k", name)], named[("v", name)] = cache.k, cache.v
        return {id(t): role for role, t in named.items() if t is not None}

    def keep_graph(self, graph: torch.fx.GraphModule, example_inputs: list, compiled) -> None:
        """Keeps the graph just compiled for direct calls if it returns the step's one tensor and takes nothing but
        the step's inputs, known by their roles (otherwise the signature stays with dynamo)."""
        outputs = next(n for n in graph.graph.nodes if n.op == "output").args[0]
        roles = self.roles()
        if len(outputs) == 1 and all(id(t) in roles for t in example_inputs):
            self.just_compiled = (compiled, [roles[id(t)] for t in example_inputs])

    def argument(self, role: tuple) -> torch.Tensor:
        """This call's tensor of `role` (a later request may bring new caches or token buffers of the same shapes)."""
        if role[0] in ("k", "v"):
            cache = self.caches[role[1]]
            return cache.k if role[0] == "k" else cache.v
        return self.slot if role[0] == "slot" else self.inputs[role[0]]

    def __call__(self, tokens_B1: torch.Tensor, start: int, pad_B: torch.Tensor | None) -> torch.Tensor:
        self.slot.fill_(start)
        tokens_B1, pad_B = self.own("tokens", tokens_B1), self.own("pad", pad_B)
        key = self.signature(tokens_B1, pad_B)
        if key in self.direct:
            compiled, roles = self.direct[key]
            return compiled(*[self.argument(role) for role in roles])[0]
        if key in self.seen and SKIPS_GUARDS:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.step(tokens_B1, self.slot, self.caches, pad_B)
        self.just_compiled = None
        with frozen(self.device):
            logits = self.step(tokens_B1, self.slot, self.caches, pad_B)  # every guard; compiles a new signature
        self.seen.add(key)
        if self.just_compiled is not None:
            self.direct[key], self.just_compiled = self.just_compiled, None
        return logits
