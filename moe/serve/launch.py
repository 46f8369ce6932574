"""Where the server runs: this process is the only rank, or one rank of torchrun's group, or (`--gpus N`) this
process starts N rank processes that join one group as torchrun's ranks would. On every rank the engine loop owns
the main thread; rank 0 also answers HTTP (uvicorn in a thread of its own), and only rank 0 handles SIGTERM: it
stops accepting, lets the running requests finish within the drain time, then tells every rank to stop."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from moe.checkpoint.files import checkpoint_name
from moe.errors import first_line
from moe.host import name_this_thread, stacks_on_sigusr1
from moe.memory import check_kv_cache
from moe.parallel.distributed import DEFAULT_TIMEOUT_S
from moe.progress import Progress
from moe.serve.app import OpenAIServer, ServerState


@dataclass(frozen=True)
class ServeOptions:
    ckpt: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str | None = None
    device: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    max_queue: int = 64
    token_budget: int = 2048
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    drain_s: float = 30.0
    threads: int | None = None
    attention: str = "layer"
    experts: str = "expert"
    placement: str | None = None  # a placement file (`--placement`)
    timeout_s: float = DEFAULT_TIMEOUT_S
    progress: bool = True  # checkpoint reading shown on rank 0
    compile: bool = True  # compiled decode steps at start-up (one CPU rank, or a pipeline on N ranks); False: eager
    generation_config: bool = True  # a request's sampling defaults: the checkpoint's generation_config.json's
    template_kwargs: dict = field(default_factory=dict)  # the chat template's switches a request leaves out
    reasoning_parser: str | None = None  # chat answers' <think> part apart (`moe.serve.reasoning`)
    cpu_kernels: str = "auto"  # see MoEModel.from_pretrained


def serve(options: ServeOptions) -> int:
    """Serve in this process (one rank, or one of torchrun's ranks) until SIGTERM or Ctrl-C; 0 after a drain."""
    from moe.api import MoEModel
    from moe.serve.engine_loop import EngineLoop
    from moe.serve.metrics import Metrics
    from moe.serve.scheduler import Scheduler

    stacks_on_sigusr1()
    rank = int(os.environ.get("RANK", "0"))
    state = ServerState(options.served_model_name or checkpoint_name(options.ckpt),
                        options.max_model_len or 0, options.max_body_bytes, options.api_key,
                        template_kwargs=dict(options.template_kwargs), reasoning_parser=options.reasoning_parser)
    http = _start_http(state, options) if rank == 0 else None
    try:
        model = MoEModel.from_pretrained(options.ckpt, dtype=options.dtype, device=options.device,
                                         threads=options.threads, attention=options.attention,
                                         experts=options.experts, placement=options.placement,
                                         timeout_s=options.timeout_s, progress=options.progress and rank == 0,
                                         compile=None if options.compile else False, cpu_kernels=options.cpu_kernels)
    except BaseException as e:
        state.dead = f"loading failed: {e}"
        _stop_http(http)
        raise
    with model:
        length = _context(model, options)
        state.max_model_len, state.tokenizer, state.vocab_size = length, model.tokenizer, model.config.vocab_size
        if options.generation_config:
            state.defaults = dict(model.generation_defaults.sampling)
        if options.compile:
            _compiled_steps(model, options.max_num_seqs, length, options.progress and rank == 0)
        scheduler = None
        if rank == 0:
            scheduler = Scheduler(options.max_num_seqs, options.max_queue, options.token_budget, model.eos_ids,
                                  model.tokenizer, Metrics())
            scheduler.metrics.dense = model.config.dense_layers
            signal.signal(signal.SIGTERM, lambda *_: scheduler.drain(options.drain_s))
            signal.signal(signal.SIGINT, lambda *_: scheduler.drain(0))
            state.scheduler = scheduler  # /health turns 200
            print(f"serving {state.served} on http://{options.host}:{options.port} ({model.info.ranks} rank(s), "
                  f"{options.max_num_seqs} sequences of up to {length} tokens)", file=sys.stderr, flush=True)
            if state.defaults:
                shown = " ".join(f"{k}={v}" for k, v in state.defaults.items())
                print(f"requests' sampling defaults from generation_config.json: {shown} (--generation-config vllm: "
                      "OpenAI's)", file=sys.stderr, flush=True)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then stops every rank
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        dist = getattr(model.engine, "dist", None)
        try:
            EngineLoop(model.engine, dist, length, options.max_num_seqs, scheduler, options.token_budget,
                       model.eos_ids).run()
        except BaseException as e:
            state.dead = f"a rank failed: {first_line(e) or type(e).__name__}"
            if scheduler is not None:
                scheduler.fail_all(state.dead)
            time.sleep(0.5)  # the open streams get their error event
            raise
        finally:
            _stop_http(http)
    return 0


def _compiled_steps(model, seqs: int, length: int, progress: bool) -> None:
    """Compiled decode steps for every size of the running batch at the server's cache length, ready before /health
    turns 200: a server lives long enough to repay the builds. One CPU rank builds or loads packages
    (`moe.engine.ahead`; a later server loads them); a pipeline of whole blocks on N ranks compiles each rank's part
    with `torch.compile` (`moe.engine.pipeline`), every rank the same steps in lock-step. Elsewhere (other layouts
    on N ranks, GPUs, other kernels) the steps stay eager."""
    from moe.engine.pipeline import PipelineEngine, pipeline_refusal

    engine = model.engine
    ahead = getattr(engine, "ahead", None)
    if ahead is not None:
        for batch in range(1, seqs + 1):
            ahead.step_at(batch, length, build=True)
        return
    if not isinstance(engine, PipelineEngine) or pipeline_refusal(engine.placement) is not None or \
            engine.device.type != "cpu":  # on CUDA its graphs would need caches at fixed addresses: never run there
        return
    engine.compile_decode()
    engine.exact_caches = True
    started = time.perf_counter()
    # in inference mode, as the engine loop runs them (a compiled step's graphs are told apart by the mode)
    with Progress("compiling the decode steps", unit="step", enabled=progress).start(seqs) as bar, \
            torch.inference_mode():
        for batch in range(1, seqs + 1):  # garbage tokens into caches dropped after: only the graphs are kept
            engine.start(batch, length, torch.zeros(batch, dtype=torch.long))
            engine.forward_last(torch.zeros(batch, 1, dtype=torch.long), 0)
            bar.update(1)
        engine.caches = {}
        bar.note(f"compiled the decode steps of 1 to {seqs} sequences in {time.perf_counter() - started:.0f} s "
                 "(each rank its blocks; --no-compile: eager steps)")


def _context(model, options: ServeOptions) -> int:
    cfg = model.config
    if model.tokenizer is None:
        raise ValueError(f"{options.ckpt}: the server needs the checkpoint's tokenizer")
    limit = cfg.max_seq_len
    length = options.max_model_len or min(limit, 4096)
    if not 1 < length <= limit:
        raise ValueError(f"--max-model-len {length}: must be between 2 and the model's context ({limit})")
    # every running sequence has a cache row of this length: the most of them must fit at start, not fail later
    check_kv_cache(cfg, model.info, model.engine, options.max_num_seqs, length,
                   "lower --max-model-len or --max-num-seqs")
    return length


def _start_http(state: ServerState, options: ServeOptions):
    import uvicorn

    config = uvicorn.Config(OpenAIServer(state).app(), host=options.host, port=options.port, log_level="warning",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)

    def run() -> None:
        name_this_thread("http")  # told apart from the engine's threads in `top -H` and by scripts/bench_serve.py
        server.run()

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise OSError(f"cannot listen on {options.host}:{options.port} (in use, or not an address of this machine)")
    return server, thread


def _stop_http(http) -> None:
    if http is not None:
        server, thread = http
        server.should_exit = True
        thread.join(timeout=5)


def serve_rank(rank: int, world_size: int, port: int, options: ServeOptions) -> None:
    """A rank process of `--gpus N`: joins the group as a torchrun rank would, then serves."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    serve(options)  # returns after a drain (the rank then exits 0); a failure raises


def serve_ranks(options: ServeOptions, world_size: int) -> int:
    """Start N rank processes and wait: SIGTERM or Ctrl-C here is passed to rank 0, which drains and stops all."""
    from moe.workers.group import run_ranks

    stacks_on_sigusr1()
    threads = options.threads or max(1, (os.cpu_count() or 1) // world_size)
    options = ServeOptions(**{**options.__dict__, "threads": threads})
    run_ranks(serve_rank, world_size, options, threads=threads, stop_through_rank0=True)
    return 0
