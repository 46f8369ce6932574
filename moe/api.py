"""`MoEModel`: the user-facing handle. Loads a checkpoint, runs forward passes and generation.

Plain steps in `from_pretrained`: read the config, pick where the model runs, build the engine:
`LocalEngine` for one rank in this process; under torchrun a `ShardedEngine` (this process is one rank);
otherwise `RemoteEngine` over N rank processes started here. All three answer the same calls
(`moe.engine.base.Engine`), so everything below the constructor is the same for every case.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from models.config import ModelConfig
from models.kernels import choice, native
from moe.chat.template import end_of_turn_id
from moe.checkpoint.files import beside_weights, resolve_checkpoint
from moe.checkpoint.formats import detect
from moe.checkpoint.generation_config import GenerationDefaults, read_generation_config
from moe.checkpoint.loader import INT8, parse_precision
from moe.engine.base import Engine
from moe.engine.layouts import check_options, compilable_plan
from moe.engine.start import join_torchrun, load_here, start_ranks
from moe.errors import USER_ERRORS, RankFailure, first_line
from moe.generation import SamplingParams, check_prompts
from moe.generation.loop import batch_of_prompts, needs_tokenizer
from moe.generation.params import DEFAULT_MAX_NEW_TOKENS, SEED_LIMIT, per_prompt_seeds, prepared
from moe.generation.results import Completion, TokenCompletion, to_results
from moe.generation.text import TextStreams
from moe.host import ThreadWatch
from moe.info import ModelInfo, announce
from moe.memory import MemoryUse, check_kv_cache
from moe.parallel.devices import ranks_device
from moe.parallel.distributed import DEFAULT_TIMEOUT_S, from_torchrun
from moe.parallel.placement import Placement, resolve_placement
from moe.reports.expert_load import ExpertLoadReport
from moe.tokenizer import Tokenizer, load_tokenizer
from moe.workers.rank import ShardSpec

CHAT_MAX_NEW_TOKENS = 256  # a reply's default length (generate's: DEFAULT_MAX_NEW_TOKENS)


class MoEModel:
    def __init__(self, engine: Engine, config: ModelConfig, tokenizer: Tokenizer | None, info: ModelInfo,
                 generation_defaults: GenerationDefaults | None = None, checkpoint_dir: Path | None = None) -> None:
        self.engine, self.config, self._tokenizer, self.info = engine, config, tokenizer, info
        # the checkpoint's generation_config.json, and its directory (a save copies its tokenizer files)
        self.generation_defaults, self.checkpoint_dir = generation_defaults or GenerationDefaults(), checkpoint_dir
        self._lock = threading.Lock()  # one call at a time: the ranks run one request in lock-step
        self._broken = ""  # under torchrun: why this rank's model can no longer be used
        self._thread = ThreadWatch(info.launch != "processes" and str(getattr(engine, "device", "")) == "cpu")

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype | None = None, device: str = "auto",
                        gpus: int = 1, placement: Placement | str | Path | dict | None = None,
                        blocks_per_rank: list[int] | None = None, master_port: int | None = None,
                        threads: int | None = None, progress: bool = False, attention: str = "layer",
                        cpu_kernels: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                        exchange: str = "auto", compile: bool | str | None = None, experts: str = "expert") -> MoEModel:
        """Load a Hugging Face or Mistral consolidated directory, or a Hub repository id from the local cache.

        `device`: "auto" (CUDA with a GPU for every rank, CPU with none; else an error), "cuda", "cpu", "cuda:N".
        With `gpus=N > 1`, N ranks (one GPU each with NCCL, or CPU processes over gloo) share the model under
        `placement` (default: contiguous block ranges, experts of every block spread over all ranks); the ranks are
        fresh interpreters, so this works from any script, `python -c` or a notebook, and they stop on `close()`, at
        the end of a `with` block, or at interpreter exit. Under torchrun (RANK and WORLD_SIZE set) this process joins
        the given group as one rank instead, and every rank makes the same calls. `progress` shows checkpoint reading
        on rank 0 (a bar on a terminal, a line per file). `timeout_s` is how long a collective waits for the slowest
        rank (loading, saving); a rank that dies is found within seconds regardless. `threads`: CPU threads per rank
        (in this process: torch's own setting).
        `attention` and `experts` shard every block one way over all N ranks (the placement file can say it per
        block, `moe.parallel.strategies`): attention "layer" (one owner per block, default), "replicated" (every
        rank holds the dense weights and runs its own slice of the batch) or "tensor" (heads split over the ranks);
        experts "expert" (whole experts placed, default), "tensor" (each expert's hidden dimension split) or "layer"
        (every expert on its block's owner: a pipeline of whole blocks, with attention "layer").
        `cpu_kernels`: `models.kernels.choice.CPU_KERNELS_HELP` says what each choice runs (that object decides;
        `info.kernels` says what runs). `dtype="int8"`: int8 weights quantized at load, bf16 activations.
        `compile`: one CPU rank runs decode steps through a package compiled ahead of time (`moe.engine.ahead`)
        where one is cached (None), after building a missing one (True), or never (False). "torch", and True where
        no package runs (N ranks, CUDA), compiles them with `torch.compile` (`moe.engine.compiled`, `.layouts`).
        `exchange` (N ranks): "auto" gathers a step's few rows to every rank (two collectives per block, no sizes
        on the host) for decode and exchanges them by all-to-all for prefill; "gather" or "all-to-all" forces one.
        """
        path = resolve_checkpoint(path)  # a directory, or a Hub repository id in the local cache
        ckpt = detect(path)
        cfg = ckpt.config
        tokenizer, defaults = load_tokenizer(path), read_generation_config(path, list(cfg.eos_ids) or cfg.eos_id)
        dtype_name = parse_precision(dtype, ckpt.torch_dtype)
        check_options(gpus, cpu_kernels, attention, experts, exchange, compile, threads)
        ranks_compile = compile in (True, "torch")  # N ranks: torch.compile or nothing
        base = dict(format=ckpt.fmt, dtype=dtype_name, cpu_kernels=cpu_kernels, attention=attention, experts=experts,
                    exchange=exchange)
        joined = from_torchrun(device, timeout_s)
        if threads is not None and (joined is not None or (gpus == 1 and placement is None)):
            torch.set_num_threads(threads)  # this process is the rank: `threads` is its own pool
        if joined is not None:
            engine, info = join_torchrun(path, cfg, base, *joined, gpus, placement, blocks_per_rank, progress,
                                         ranks_compile)
        else:
            kind = ranks_device(device, gpus)
            if kind == "cpu" and cpu_kernels in choice.NATIVE_ASKS:
                native.available()  # built here once, before N ranks start and load it
            if gpus == 1 and placement is None:
                engine, info = load_here(path, base, device if device.startswith("cuda:") else kind, progress,
                                         compile)
            else:
                plan = resolve_placement(placement, cfg, gpus, blocks_per_rank, attention, experts)
                compilable_plan(plan, ranks_compile, exchange)  # refused before any rank starts (load_shard too)
                spec = ShardSpec(str(path), dtype_name, plan.to_json(), progress, cpu_kernels, kind, timeout_s,
                                 exchange, ranks_compile)
                engine, info = start_ranks(spec, base, gpus, plan, master_port, threads)
        return cls(engine, cfg, tokenizer, announce(info), defaults, Path(path))

    @contextmanager
    def _calling(self):
        """One call at a time. Under torchrun this process is a rank: a user error's type raised after the call's
        first collective is no user error (the other ranks may wait in a collective this one will not enter), so it
        ends this model with the rank named, as a rank process's would (`moe.workers.rank.serve`)."""
        with self._lock:
            self._thread.check()
            if self._broken:
                raise RankFailure(f"this model can no longer be used ({self._broken}); load it again")
            dist = getattr(self.engine, "dist", None) if self.info.launch == "torchrun" else None
            entered = dist.collectives if dist is not None else 0
            try:
                yield
            except USER_ERRORS as e:
                if dist is None or dist.collectives == entered or getattr(e, "agreed_by_all_ranks", False):
                    raise
                self._broken = (f"rank {self.info.rank} raised {type(e).__name__} after the call's first collective: "
                                f"{first_line(e)}")
                raise RankFailure(self._broken) from e

    @property
    def rank(self) -> int:
        """This process's rank: 0 unless under torchrun, where every rank runs the same calls."""
        return self.info.rank

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError("this checkpoint has neither tokenizer.json nor tokenizer.model; pass token ids instead "
                             "of text")
        return self._tokenizer

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for a LongTensor [batch, seq] (no cache, positions from 0)."""
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a LongTensor [batch, seq], "
                             f"got {input_ids.dtype} {list(input_ids.shape)}")
        check_prompts(input_ids.tolist(), self.config.vocab_size, self.config.max_seq_len + 1)
        with self._calling():
            return self.engine.logits(input_ids)

    def random_seed(self) -> int:
        """A fresh seed, drawn on one rank and shared, so a printed seed reproduces the sampled text."""
        with self._calling():
            return self.engine.random_seed()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 max_new_tokens: int | SamplingParams | list[SamplingParams] = DEFAULT_MAX_NEW_TOKENS,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | list[int] | None = None, streamer: Callable[[int, str | int], None] | None = None,
                 ignore_eos: bool = False, *, min_p: float | None = None, repetition_penalty: float | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, stop: str | list[str] | None = None,
                 stop_token_ids: list[int] | None = None, logprobs: int | None = None, min_tokens: int = 0,
                 skip_special_tokens: bool = True, logit_bias: dict[int, float] | None = None,
                 include_stop_str_in_output: bool = False, prompt_logprobs: int | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion] | list[TokenCompletion]:
        """A list of one result per prompt (a text or token ids, or a list of them, as vLLM takes them): a
        `Completion` (a `str`: the new text) for text prompts, a `TokenCompletion` (a `list` of the new ids) for
        token-id prompts; both carry `token_ids`, `finish_reason` ("stop" or "length"), `stop_reason`, `logprobs`,
        `prompt_tokens` and `seed`. The parameters are vLLM's (`SamplingParams`); as in vLLM, a `SamplingParams` (or
        one per prompt) may be given instead, as the second argument or `sampling_params`, and is used as it is.
        Sampling values left out come from the checkpoint's `generation_config.json` where it sets them (as
        transformers and vLLM do; `self.last_defaults` names them), else greedy (temperature 0, top_p 1, top_k off).
        Generation stops at every end-of-sequence id of the tokenizer, config.json and generation_config.json.
        `seed`: one for every prompt, or one per prompt; left out, a fresh one per prompt (drawn on one rank). A
        prompt's samples depend only on it, its parameters and its seed, never on the rest of the batch.
        `ignore_eos` generates exactly `max_new_tokens` (for benchmarks), as vLLM's option of that name. The text
        leaves special tokens out (`skip_special_tokens`, vLLM's default, as llama.cpp and transformers' pipelines).
        `streamer(prompt_index, piece)` gets each new text piece (or token id) once final (stop strings: held back).
        """
        prompts, is_text = batch_of_prompts(prompts)
        ids = [self.tokenizer.encode(p) for p in prompts] if is_text else prompts
        if isinstance(max_new_tokens, (SamplingParams, list, tuple)):  # vLLM's generate(prompts, sampling_params)
            max_new_tokens, sampling_params = DEFAULT_MAX_NEW_TOKENS, max_new_tokens
        keywords = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, stop=stop, stop_token_ids=stop_token_ids,
                        logprobs=logprobs, ignore_eos=ignore_eos, skip_special_tokens=skip_special_tokens,
                        min_tokens=min_tokens, logit_bias=logit_bias, prompt_logprobs=prompt_logprobs,
                        include_stop_str_in_output=include_stop_str_in_output)
        named = [k for k, v in keywords.items() if v != KEYWORD_DEFAULTS[k]]
        rows = self._rows(len(ids), max_new_tokens, seed, sampling_params, keywords,
                          named + ["max_new_tokens"] * (max_new_tokens != DEFAULT_MAX_NEW_TOKENS))
        return self._generate(ids, rows, streamer, is_text)

    def _rows(self, prompts: int, max_new_tokens: int, seed, given: SamplingParams | list | None, keywords: dict,
              named: list[str]) -> list[SamplingParams]:
        """One SamplingParams per prompt: the caller's own (one for all, or one per prompt), used as they are, as
        vLLM does; else the keywords over the checkpoint's generation_config.json's values (`named`: those given)."""
        if given is not None:
            if named or seed is not None:
                raise ValueError(f"sampling_params holds every sampling setting; {(named or ['seed'])[0]} was given "
                                 "beside it")
            rows = [given] * prompts if isinstance(given, SamplingParams) else list(given)
            if len(rows) != prompts or not all(isinstance(p, SamplingParams) for p in rows):
                raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({prompts})")
            self.last_defaults = []
            return rows
        params = self._sampling(max_new_tokens, **keywords)
        return [dataclasses.replace(params, seed=s) for s in per_prompt_seeds(seed, prompts) or [None] * prompts]

    def _sampling(self, max_new_tokens: int, stop=None, stop_token_ids=None, **given) -> SamplingParams:
        """The request's parameters: the caller's, else the checkpoint's generation_config.json's, else off."""
        defaulted = {k: given.pop(k, None) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        sampling, self.last_defaults = self.generation_defaults.merged(**defaulted)
        return SamplingParams(max_new_tokens, **sampling, **given, stop=() if stop is None else stop,
                              stop_token_ids=() if stop_token_ids is None else stop_token_ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             max_new_tokens: int | SamplingParams | list[SamplingParams] = CHAT_MAX_NEW_TOKENS, *,
             chat_template: str | None = None, template_kwargs: dict | None = None, tools: list[dict] | None = None,
             seed: int | list[int] | None = None, streamer: Callable[[int, str], None] | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             **sampling) -> Completion | list[Completion]:
        """The assistant's reply to one conversation (a list of {"role", "content"} messages), or a list of replies
        to a list of conversations, through the checkpoint's chat template (`chat_template`: another template's
        source or name; `template_kwargs`: the template's own switches, e.g. {"enable_thinking": False}). It stops at
        the template's end-of-turn token too. `sampling`: `generate`'s keywords, or (as vLLM's `chat`) a
        `SamplingParams` as the second argument or `sampling_params`. `continue_final_message`: the reply goes on with
        the last message, not a new turn (`add_generation_prompt` then defaults to False), as vLLM's `chat`."""
        conversations = messages if (many := bool(messages) and isinstance(messages[0], (list, tuple))) else [messages]
        template = self.tokenizer.chat_template(chat_template)
        opens = not continue_final_message if add_generation_prompt is None else add_generation_prompt
        ids = [self.tokenizer.apply_chat_template(c, opens, return_dict=False, chat_template=template,
                                                  tools=tools, continue_final_message=continue_final_message,
                                                  **(template_kwargs or {}))
               for c in conversations]
        turn_end = end_of_turn_id(self.tokenizer, template)
        if isinstance(max_new_tokens, (SamplingParams, list, tuple)):
            max_new_tokens, sampling_params = CHAT_MAX_NEW_TOKENS, max_new_tokens
        rows = self._rows(len(ids), max_new_tokens, seed, sampling_params, sampling,
                          [k for k, v in sampling.items() if v != KEYWORD_DEFAULTS.get(k)]
                          + ["max_new_tokens"] * (max_new_tokens != CHAT_MAX_NEW_TOKENS))
        replies = self._generate(ids, rows, streamer, True, () if turn_end is None else (turn_end,))
        return replies if many else replies[0]

    def _generate(self, ids: list[list[int]], rows: list[SamplingParams],
                  streamer: Callable[[int, str | int], None] | None, is_text: bool,
                  extra_eos: tuple[int, ...] = ()) -> list:
        ids, rows = prepared(ids, rows, self.config.vocab_size, self.config.max_seq_len, self._tokenizer)
        check_prompts(ids, self.config.vocab_size, self.config.max_seq_len)
        # the tokenizer where it is needed (a missing one refused early), else the one there may be
        tokenizer = self.tokenizer if needs_tokenizer(rows) or (is_text and streamer) else self._tokenizer
        check_kv_cache(self.config, self.info, self.engine, len(ids),
                       min(max(len(i) + p.max_new_tokens for i, p in zip(ids, rows, strict=True)),
                           self.config.max_seq_len))
        stream = TextStreams(tokenizer, ids, rows, streamer, is_text) if streamer is not None else None
        with self._calling():
            if any(p.seed is None for p in rows):  # fresh seeds, drawn on one rank: a printed seed reproduces
                base = self.engine.random_seed()
                rows = [p if p.seed is not None else dataclasses.replace(p, seed=(base + b) % SEED_LIMIT)
                        for b, p in enumerate(rows)]
            result = self.engine.generate(ids, rows, tuple(dict.fromkeys(self.eos_ids + extra_eos)),
                                          self.config.max_seq_len, stream.on_token if stream else None)
            top = max((p.prompt_logprobs for p in rows if p.prompt_logprobs is not None), default=None)
            scores = self.engine.prompt_logprobs(ids, top) if top is not None else None
        if stream is not None:
            stream.finish()
        self.last_result = result
        return to_results(self._tokenizer, ids, result.rows, rows, is_text, scores)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: the tokenizer's, config.json's and generation_config.json's."""
        tokenizer = self._tokenizer.eos_id if self._tokenizer is not None else None
        found = [tokenizer, self.config.eos_id, *self.config.eos_ids, *self.generation_defaults.eos_ids]
        return tuple(dict.fromkeys(i for i in found if i is not None))

    def save_pretrained(self, path: str | Path, max_shard_size: str | int | None = "200MB",
                        progress: bool = False) -> list[dict]:
        """Write a Hugging Face directory (safetensors + index, config.json, the tokenizer and generation_config.json
        files it was loaded with) from wherever the weights are: each rank writes the tensors it holds, nothing is
        gathered. Atomic: the directory appears complete or not at all. Returns, per rank, the files it wrote and
        their bytes. `progress`: a bar of the bytes rank 0 writes, on a terminal."""
        from moe.checkpoint.convert import parse_size
        from moe.checkpoint.writer import refuse_non_empty

        if self.info.dtype == INT8:
            raise ValueError("an int8 model cannot be saved: its weights are quantized at load and would not load "
                             "back bit-exactly; save the checkpoint it was loaded from (in bf16 or fp32) instead")
        path = Path(path)
        refuse_non_empty(path)  # here, before the ranks start writing: a user error must not stop them
        size = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
        with self._calling():
            return self.engine.save(str(path.resolve()), size, beside_weights(self.checkpoint_dir), progress)

    def memory(self) -> list[MemoryUse]:
        """Each rank's memory in MiB: host peak resident, and on a GPU allocated, reserved and peak."""
        with self._calling():
            return self.engine.memory()

    def peak_memory_mib(self) -> list[float]:
        """Each rank's peak where its weights live: GPU peak allocated on CUDA, else host peak resident (MiB)."""
        return [u.gpu_peak if u.gpu_peak is not None else u.host_peak for u in self.memory()]

    def expert_load(self) -> ExpertLoadReport:
        """Which experts and ranks received how many token copies since loading (or the last reset)."""
        with self._calling():
            counts, entropy, received = self.engine.load_stats()
        placement = self.info.placement or Placement.default(self.config.n_layers, self.config.n_experts, 1)
        return ExpertLoadReport.of(counts, entropy, received, placement, self.config)

    def track_router_entropy(self, enabled: bool = True) -> None:
        """Sum each router's entropy for `expert_load()` reports (a few kernels per block and step, so off
        unless asked for; the expert-load commands turn it on)."""
        with self._calling():
            self.engine.track_entropy(enabled)

    def reset_expert_load(self) -> None:
        with self._calling():
            self.engine.reset_load_stats()

    def set_debug_routing(self, round_robin: bool) -> None:
        """Round-robin routing (copy j of token t to expert (t*K+j) % E): exact, predictable loads for tests."""
        with self._calling():
            self.engine.set_round_robin(round_robin)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> MoEModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# generate's sampling keywords as left out: any other value is a keyword given (refused beside sampling_params)
KEYWORD_DEFAULTS = {name: p.default for name, p in inspect.signature(MoEModel.generate).parameters.items()}
