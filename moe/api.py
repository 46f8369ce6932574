"""`MoEModel`: the user-facing handle. Loads a checkpoint, runs forward passes and generation.

It delegates to an engine: `LocalEngine` for one rank; the N-rank engine drives worker processes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from models.config import ModelConfig
from models.cpu_kernels import KERNELS
from moe.build import build_model
from moe.checkpoint.formats import detect
from moe.checkpoint.loader import parse_dtype
from moe.generation import SamplingParams, check_prompts
from moe.launcher import WorkerGroup
from moe.load_report import ExpertLoadReport
from moe.local import LocalEngine
from moe.placement import Placement
from moe.remote import RemoteEngine
from moe.tokenizer import IncrementalDecoder, Tokenizer
from moe.worker import print_progress, spec_for


def resolve_placement(placement: Placement | str | Path | dict | None, n_layers: int, n_experts: int, gpus: int,
                      blocks_per_rank: list[int] | None = None) -> Placement:
    """A validated plan from a Placement, a JSON file, a dict, or the default (optionally per-rank block counts)."""
    if placement is None:
        plan = Placement.default(n_layers, n_experts, gpus, blocks_per_rank)
    elif isinstance(placement, Placement):
        plan = placement
    elif isinstance(placement, dict):
        plan = Placement.from_json(placement)
    else:
        plan = Placement.load(placement)
    return plan.validate(n_layers, n_experts, gpus)


class MoEModel:
    def __init__(self, engine, config: ModelConfig, tokenizer: Tokenizer | None, info: dict) -> None:
        self.engine, self.config, self._tokenizer, self.info = engine, config, tokenizer, info

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype | None = None, device: str = "cpu",
                        gpus: int = 1, placement: Placement | str | Path | dict | None = None,
                        blocks_per_rank: list[int] | None = None, master_port: int | None = None,
                        threads: int | None = None, progress: bool = False, attention: str = "owner",
                        cpu_kernels: str = "onednn") -> MoEModel:
        """Load a Hugging Face or Mistral consolidated directory.

        With `gpus=N > 1`, N ranks (one GPU each, or CPU processes over gloo without CUDA) share the model
        under `placement` (default: contiguous block ranges, experts of every block spread over all ranks);
        the ranks stop on `close()`, at the end of a `with` block, or at interpreter exit. `progress` prints
        a line per checkpoint file as rank 0 reads it (to stderr). `attention="replicated"` gives every rank the
        dense weights and its own slice of the batch (for throughput on batches); the experts stay placed.
        `cpu_kernels="onednn"` (on CPU, fp32/bf16) keeps linear weights in oneDNN's layout, about 2x faster than
        torch's default CPU products here; "torch" keeps plain tensors and `F.linear`.
        """
        ckpt = detect(path)
        cfg = ckpt.config
        tok_path = Path(path) / "tokenizer.model"
        tokenizer = Tokenizer(tok_path) if tok_path.exists() else None
        torch_dtype = parse_dtype(dtype, ckpt.torch_dtype)
        info = {"format": ckpt.fmt, "dtype": str(torch_dtype).removeprefix("torch.")}
        if gpus < 1:
            raise ValueError(f"gpus must be at least 1, got {gpus}")
        if cpu_kernels not in KERNELS:
            raise ValueError(f"cpu_kernels={cpu_kernels!r}: use one of {', '.join(KERNELS)}")
        info["cpu_kernels"] = cpu_kernels
        if gpus == 1 and placement is None:
            model, _, stats = build_model(path, torch_dtype, device, progress=print_progress if progress else None,
                                          pack=cpu_kernels == "onednn")
            return cls(LocalEngine(model), cfg, tokenizer, info | stats | {"backend": "none", "ranks": 1})
        plan = resolve_placement(placement, cfg.n_layers, cfg.n_experts, gpus, blocks_per_rank)
        spec = spec_for(path, info["dtype"], plan, progress, attention, cpu_kernels)
        group = WorkerGroup(gpus, spec, master_port, threads)
        ready = group.ready
        info |= {"backend": ready[0]["backend"], "ranks": gpus, "placement": plan, "attention": attention,
                 "load_seconds": max(r["load_seconds"] for r in ready),
                 "bytes_read": [r["bytes_read"] for r in ready], "files_read": [r["files_read"] for r in ready],
                 "rank_params": [r["params"] for r in ready]}
        return cls(RemoteEngine(group, plan), cfg, tokenizer, info)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.model; pass token ids instead of text")
        return self._tokenizer

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for a LongTensor [batch, seq] (no cache, positions from 0)."""
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a LongTensor [batch, seq], "
                             f"got {input_ids.dtype} {list(input_ids.shape)}")
        check_prompts(input_ids.tolist(), self.config.vocab_size, self.config.max_seq_len + 1)
        return self.engine.logits(input_ids)

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 streamer: Callable[[int, str | int], None] | None = None,
                 ignore_eos: bool = False) -> list[str] | list[list[int]]:
        """New text per prompt for string prompts, new token ids per prompt for token-id prompts.

        `ignore_eos` generates exactly `max_new_tokens` (for benchmarks), as vLLM's option of that name.
        `streamer(prompt_index, piece)` receives each new text piece (or token id) as soon as it exists.
        """
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, list):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        is_text = bool(prompts) and all(isinstance(p, str) for p in prompts)
        if is_text and any(not p for p in prompts):
            raise ValueError(f"prompt {[bool(p) for p in prompts].index(False)} is empty")
        ids = [self.tokenizer.encode(p) for p in prompts] if is_text else [list(map(int, p)) for p in prompts]
        check_prompts(ids, self.config.vocab_size, self.config.max_seq_len)
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k,
                                seed if seed is not None else random.randrange(2**31))
        eos = self._tokenizer.eos_id if self._tokenizer is not None else self.config.eos_id
        eos = None if ignore_eos else eos
        on_token = None
        if streamer is not None and is_text:
            decoders = [IncrementalDecoder(self.tokenizer, p) for p in ids]
            def on_token(b: int, t: int) -> None:  # noqa: E306
                piece = decoders[b].push(t)
                if piece:
                    streamer(b, piece)
        elif streamer is not None:
            on_token = streamer
        result = self.engine.generate(ids, params, eos, self.config.max_seq_len, on_token)
        self.last_result = result
        if not is_text:
            return result.tokens
        return [self.tokenizer.decode_continuation(p, t) for p, t in zip(ids, result.tokens, strict=True)]

    def save_pretrained(self, path: str | Path, max_shard_size: str | int | None = "200MB") -> list[dict]:
        """Write a Hugging Face directory (safetensors + index, config.json, tokenizer) from wherever the weights
        are: each rank writes the tensors it holds, nothing is gathered. Atomic: the directory appears complete
        or not at all. Returns, per rank, the files it wrote and their bytes."""
        from moe.checkpoint.convert import parse_size
        from moe.checkpoint.writer import refuse_non_empty

        path = Path(path)
        refuse_non_empty(path)  # here, before the ranks start writing: a user error must not stop them
        size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
        tokenizer = str(self._tokenizer.path) if self._tokenizer is not None else None
        return self.engine.save(str(path.resolve()), size, tokenizer)

    def expert_load(self) -> ExpertLoadReport:
        """Which experts and ranks received how many token copies since loading (or the last reset)."""
        counts, entropy, received = self.engine.load_stats()
        placement = self.info.get("placement") or Placement.default(self.config.n_layers, self.config.n_experts, 1)
        tokens = int(counts.sum()) // (self.config.top_k * self.config.n_layers)
        return ExpertLoadReport(counts, placement, float(entropy), tokens, received)

    def reset_expert_load(self) -> None:
        self.engine.reset_load_stats()

    def set_debug_routing(self, round_robin: bool) -> None:
        """Round-robin routing (copy j of token t to expert (t*K+j) % E): exact, predictable loads for tests."""
        self.engine.set_round_robin(round_robin)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> MoEModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
