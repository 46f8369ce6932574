"""The one-rank engine: the whole model in this process; with `compile`, decode steps run compiled
(`moe.engine.compiled`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from models.attention import Padding
from models.decode_plan import DecodePlan
from models.kv_cache import KVCache
from models.transformer import Transformer
from moe.checkpoint.distributed_save import save_distributed
from moe.engine.ahead import AheadDecode, ahead_compilable
from moe.engine.compiled import CompiledDecode
from moe.generation import GenerationResult, SamplingParams, generate_tokens, needs_tokenizer
from moe.generation.scoring import prompt_scores
from moe.memory import MemoryUse
from moe.parallel.distributed import single_process
from moe.progress import Progress
from moe.reports.counters import local_load_stats, reset_load_stats, set_round_robin, track_entropy
from moe.tokenizer import tokenizer_of


class LocalEngine:
    def __init__(self, model: Transformer, compile: bool | str | None = None) -> None:
        """`compile`: None runs decode steps through a package compiled ahead of time where one is cached for this
        model's shapes, True builds a missing one first, False never compiles (`moe.engine.ahead`). "torch", and
        True for a model no package takes (`ahead_compilable`), compiles them with `torch.compile` instead."""
        self.model = model
        self._caches: dict[str, KVCache] | None = None
        self._padding: Padding | None = None
        self.plan: DecodePlan | None = None  # an eager batch's decode steps (`models.decode_plan`), made per batch
        ahead = compile in (None, True) and ahead_compilable(model)
        self.ahead = AheadDecode(model, may_build=compile is True) if ahead else None
        # `start` rounds a request's cache length up to a package's (`moe.engine.ahead.bucket`); a server, which
        # holds caches of its own length, sets this
        self.exact_caches = False
        self.ahead_ran = False  # the last decode step ran through a package
        self.compiled = CompiledDecode(model) if compile == "torch" or (compile is True and not ahead) else None
        self.checkpoint_dir: str | None = None  # its tokenizer, read when a request has stop strings

    @property
    def caches(self) -> dict[str, KVCache] | None:
        return self._caches

    @caches.setter
    def caches(self, caches: dict[str, KVCache] | None) -> None:
        self._caches, self.plan = caches, None  # a new batch (the server's rows join and leave this way too)
        if self.ahead is not None:
            self.ahead.unbind()  # nor does the package's step hold the old ones

    @property
    def padding(self) -> Padding | None:
        return self._padding

    @padding.setter
    def padding(self, padding: Padding | None) -> None:
        self._padding, self.plan = padding, None

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    # -- stepping (moe.generation.Stepper) ---------------------------------------------------------
    def start(self, batch: int, length: int, pad_B: torch.Tensor) -> None:
        if self.ahead is not None and not self.exact_caches:
            length = self.ahead.cache_length(batch, length)
        if self.compiled is not None:
            self.caches = self.compiled.caches_for(batch, length)
        else:
            self.caches = self.model.make_caches(batch, length)
        self.padding = Padding.of(pad_B, self.device)

    def forward_last(self, tokens_BS: torch.Tensor, start: int) -> torch.Tensor:
        if not torch.is_inference_mode_enabled():  # `generate` and the server's loop run every step in it already
            with torch.inference_mode():
                return self.forward_last(tokens_BS, start)
        if self.ahead is not None and tokens_BS.shape[1] == 1:  # a package (on the CPU, where the tokens are)
            pad = self.padding.device_B if self.padding is not None else None
            logits = self.ahead.decode(tokens_BS, start, pad, self.caches)
            self.ahead_ran = logits is not None
            if logits is not None:
                return logits
        tokens_BS = tokens_BS.to(self.device)
        if self.compiled is not None and tokens_BS.shape[1] == 1:  # a decode step: every shape static
            return self.compiled(tokens_BS, start, self.padding.device_B if self.padding is not None else None)
        if self.plan is None:
            self.plan = DecodePlan(self.model, self.caches, self.padding)
        if self.plan.runs(tokens_BS, start):
            return self.plan.logits(tokens_BS, start)
        return self.model(tokens_BS, start, self.caches, self.padding, last_only=True)[:, -1]

    def share(self, decided: torch.Tensor) -> torch.Tensor:
        return decided  # one rank: it decided everything itself

    alone = True

    # -- the Engine interface ----------------------------------------------------------------------
    def generate(self, ids: list[list[int]], params: SamplingParams | list[SamplingParams],
                 eos: tuple[int, ...], context: int, on_token: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        with torch.inference_mode():  # the whole loop: one entry, not one a step (each 10-20 us on a CPU)
            return generate_tokens(self, ids, params, eos, context, on_token, should_stop,
                                   tokenizer_of(self.checkpoint_dir) if needs_tokenizer(params) else None)

    @torch.inference_mode()
    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_BS.to(self.device))

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[list[int]], top: int) -> list:
        out = []
        for prompt in ids:  # on caches of its own: the engine's (a server's running batch) are left as they are
            caches = self.model.make_caches(1, len(prompt))
            out.append(prompt_scores(lambda t, s, c=caches: self.model(t.to(self.device), s, c),
                                     lambda packed: packed, prompt, top, self.device))
        return out

    def load_stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        counts, entropy = local_load_stats(self.model)
        return counts, entropy, counts.sum(dim=(1, 2))[:, None]  # one rank computes every copy

    def reset_load_stats(self) -> None:
        reset_load_stats(self.model)

    def set_round_robin(self, enabled: bool) -> None:
        set_round_robin(self.model, enabled)
        if self.ahead is not None:
            self.ahead.unbind()  # a package is not built with these modes

    def track_entropy(self, enabled: bool) -> None:
        track_entropy(self.model, enabled)
        if self.ahead is not None:
            self.ahead.unbind()

    def save(self, out: str, max_shard_bytes: int | None, beside: list[Path],
             progress: bool = False) -> list[dict]:
        return [save_distributed(self.model, self.model.cfg, out, single_process(), max_shard_bytes, beside,
                                 Progress("saving", unit="B", enabled=progress))]

    def memory(self) -> list[MemoryUse]:
        return [MemoryUse.now(self.device)]

    def random_seed(self) -> int:
        return random.randrange(2**31)

    def close(self) -> None:
        self.caches = None
        if self.ahead is not None:
            self.ahead.unbind()
        if self.compiled is not None:
            self.compiled.caches = None
