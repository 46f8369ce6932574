"""Speed cases for scripts/bench.py: this project and Hugging Face transformers on the same weights.

Each case runs in its own process (so its peak RSS is its own) and returns a dict of figures:
load seconds, prefill tokens/s (batch 1 x 512), time to first token, decode tokens/s at batch 1 and 8
(128 new tokens, greedy, KV cache), peak RSS. `decode_bytes_per_token` is what one decode step must read.
"""

from __future__ import annotations

import collections
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models.config import ModelConfig
from moe.memory import peak_memory_mib

PREFILL, DECODE_PROMPT, NEW_TOKENS = 512, 32, 128


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def memory_bandwidth(threads: int, mib: int = 512, repeats: int = 9) -> float:
    """GB/s of a large fp32 copy, counted as bytes copied per second (the figure the speed targets use),
    median of `repeats`."""
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**18)
    dst = torch.zeros_like(src)  # touched, so no page faults are timed
    return src.numel() * 4 / _median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def warm_page_cache(directory: str | Path) -> None:
    """Read every file of a checkpoint once, so load times compare cases, not which one ran first."""
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def read_bandwidth(threads: int, mib: int = 512, repeats: int = 9) -> float:
    """GB/s of reading a large fp32 tensor (its sum), median of `repeats`: what a decode step mostly does."""
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**18)
    return src.numel() * 4 / _median_seconds(src.sum, repeats) / 1e9


def matmul_peak(threads: int, dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 7) -> dict:
    """GFLOP/s of a large square matrix product, median of `repeats`: with torch's `a @ b` (MKL on CPU, the
    figure the issue's targets use) and, where available, oneDNN with a packed weight (what bf16 prompts run on a
    CPU with bf16 instructions). bf16 on a CPU without bf16 instructions: the fp32 peak, since prompts widen to
    fp32 there (`onednn.widened`)."""
    from models.kernels import onednn

    torch.set_num_threads(threads)
    if dtype == torch.bfloat16 and not onednn.native_bf16():
        dtype = torch.float32
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    peaks = {"torch": 2 * n**3 / _median_seconds(lambda: a @ b, repeats) / 1e9}
    if onednn.can_pack(b):
        packed = onednn.pack(b)
        peaks["onednn"] = 2 * n**3 / _median_seconds(lambda: onednn.linear(a, packed), repeats) / 1e9
    return peaks


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """Matrix-product FLOPs per prompt token: projections, k experts, the last position's head share is
    negligible; attention scores and values over on average length/2 keys."""
    D, F = cfg.dim, cfg.hidden_dim
    attention = D * cfg.n_heads * cfg.head_dim * 2 + D * cfg.n_kv_heads * cfg.head_dim * 2
    per_block = 2 * (attention + D * cfg.n_experts + cfg.top_k * 3 * D * F)
    per_block += 2 * 2 * cfg.n_heads * cfg.head_dim * length / 2
    return cfg.n_layers * per_block


def decode_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    """Weights one decode step must read: per block attention, norms, router and k experts; final norm, head."""
    D, F = cfg.dim, cfg.hidden_dim
    attention = D * cfg.n_heads * cfg.head_dim * 2 + D * cfg.n_kv_heads * cfg.head_dim * 2
    router = D * cfg.n_experts if cfg.n_experts > 1 else 0
    experts = cfg.top_k * 3 * D * F
    per_block = attention + router + experts + 2 * D
    return (cfg.n_layers * per_block + D + cfg.vocab_size * D + D) * element_size  # + one embedding row


def ours(path: str, gpus: int, dtype: str, threads: int, repeats: int, attention: str = "layer",
         cpu_kernels: str = "auto", exchange: str = "auto", compile: bool = False, strategy: str | None = None) -> dict:
    """`strategy`: every block's "attention/experts[:expert group size]" (`moe.bench.collectives.strategy_plan`)."""
    from moe import MoEModel
    from moe.bench.collectives import strategy_plan

    torch.set_num_threads(threads)
    plan = strategy_plan(checkpoint_config(path), gpus, strategy) if strategy else None
    t0 = time.perf_counter()
    # N ranks share the same cores: each gets threads / N.
    model = MoEModel.from_pretrained(path, dtype=dtype, gpus=gpus, threads=max(1, threads // gpus), placement=plan,
                                     attention=attention, cpu_kernels=cpu_kernels, exchange=exchange, compile=compile)
    load = time.perf_counter() - t0
    V = model.config.vocab_size
    with model:
        model.generate(prompts(1, 16, V), max_new_tokens=4, ignore_eos=True)  # warm-up (compiled: each batch size)
        if compile:
            model.generate(prompts(8, 16, V), max_new_tokens=4, ignore_eos=True)
        prefill, decode1, decode8, decode32, tokens8 = [], [], [], [], None
        for r in range(repeats):
            model.generate(prompts(1, PREFILL, V, r), max_new_tokens=1, ignore_eos=True)
            prefill.append(model.last_result.prefill_seconds)
            model.generate(prompts(1, DECODE_PROMPT, V, r), max_new_tokens=NEW_TOKENS, ignore_eos=True)
            decode1.append(model.last_result.decode_seconds / (NEW_TOKENS - 1))
            out = model.generate(prompts(8, DECODE_PROMPT, V, r), max_new_tokens=NEW_TOKENS, ignore_eos=True)
            decode8.append(model.last_result.decode_seconds / (NEW_TOKENS - 1))
            # The first batch-8 run's greedy tokens, to compare schedules across processes.
            tokens8 = tokens8 or hashlib.sha1(str(out).encode()).hexdigest()
            if gpus > 1 and strategy is None:  # the strategy comparison shows batch 1 and 8
                model.generate(prompts(32, DECODE_PROMPT, V, r), max_new_tokens=NEW_TOKENS, ignore_eos=True)
                decode32.append(model.last_result.decode_seconds / (NEW_TOKENS - 1))
        model.reset_expert_load()
        model.generate(prompts(1, DECODE_PROMPT, V), max_new_tokens=NEW_TOKENS, ignore_eos=True)
        received = model.expert_load().rank_load().sum(dim=1)  # rows each block's experts computed
        peak = model.peak_memory_mib()
        weights_mib = [b / 2**20 for b in model.info.bytes_read]
    routed_per_token = (received / (DECODE_PROMPT + NEW_TOKENS - 1)).tolist()
    return {"load_s": load, "prefill_s": statistics.median(prefill), "ttft_s": statistics.median(prefill),
            "decode1_step_s": statistics.median(decode1), "decode8_step_s": statistics.median(decode8),
            "decode32_step_s": statistics.median(decode32) if decode32 else None, "tokens8_hash": tokens8,
            "peak_rss_mib": peak, "rows_per_block_per_token": routed_per_token, "weights_mib": weights_mib,
            "loaded_over_baseline_mib": [p - b for p, b in zip(model.info.loaded_peak_mib, model.info.baseline_mib,
                                                               strict=True)]}


def products_alone(path: str, dtype: str, threads: int, repeats: int) -> dict:
    """A batch-1 decode step's weight products alone (`products_step`): what a step would take with nothing else in
    it, called from Python (about 5-15 us per call on top) and as the compiled step calls them (`compiled_as_step`).
    Medians of `repeats` x 5 runs of 10 steps, one after the other: set against whole steps only in turns with them
    (`moe.bench.peer_turns`), since the machine's bandwidth moves between spells."""
    from moe import MoEModel

    torch.set_num_threads(threads)
    model = MoEModel.from_pretrained(path, dtype=dtype, gpus=1, threads=threads, compile=False)  # eager: its ops
    with model, torch.inference_mode():
        net = model.engine.model
        step = products_step(net, dtype)

        def median_step(fn) -> float:
            fn()  # warm-up (compiled: the compile)
            times = []
            for _ in range(5 * repeats):
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                times.append((time.perf_counter() - t0) / 10)
            return statistics.median(times)

        result = {"products_step_s": median_step(step)}
        ops = decode_step_ops(model.engine)
        products = sum(n for op, n in ops.items() if op in PRODUCT_OPS)
        result |= {"eager_ops_per_block": (sum(ops.values()) - products) / net.cfg.n_layers,
                   "eager_products_per_block": products / net.cfg.n_layers}
        if net.norm.weight.device.type == "cpu":
            result["products_compiled_step_s"] = median_step(compiled_as_step(step, net.norm.weight.device))
    return result


def products_step(net, dtype: str) -> Callable[[], list[torch.Tensor]]:
    """One batch-1 decode step's weight products alone, as the step calls them on 1 rank: q/k/v fused, the attention
    output, two experts of every block in the two grouped calls (with the SwiGLU between), the head (the router's
    few rows left out)."""
    dt = net.norm.weight.dtype if dtype != "int8" else torch.bfloat16  # int8: bf16 activations
    cfg, device = net.cfg, net.norm.weight.device
    x = torch.randn(1, cfg.dim, device=device).to(dt)
    attn_out = torch.randn(1, cfg.n_heads * cfg.head_dim, device=device).to(dt)
    counts = torch.zeros(cfg.n_experts, dtype=torch.long, device=device)
    counts[:cfg.top_k] = 1  # k experts, one row each: what a token's step reads
    rows = x.expand(cfg.top_k, -1).contiguous()

    def step() -> list[torch.Tensor]:  # returned: a compiled step would drop products whose results go unused
        outs = []
        for block in net.layers.values():
            attention = block.attention
            outs += [attention.wqkv(x), attention.wo(attn_out), block.feed_forward.experts(rows, counts)]
        return outs + [net.output(x)]

    return step


def compiled_as_step(step: Callable, device: torch.device) -> Callable:
    """`step` compiled as the decode step is, its graph called without dynamo, from inductor's C++ wrapper
    (`moe.engine.compiled`)."""
    from moe.engine.compiled import compile_step, frozen

    graphs = []
    once = compile_step(step, device, on_compile=lambda graph, inputs, fn: graphs.append((fn, inputs)))
    with frozen(device):
        once()
    fn, inputs = graphs[-1]
    return lambda: fn(*inputs)


# the ops that read weights (`models.kernels.decode_block`'s: a block's products with the glue between them, one op
# each half)
PRODUCT_OPS = {"moe_cpu.grouped_matvec", "moe_cpu.grouped_gemm", "aten.linear", "aten.mm", "aten.addmm",
               "aten._weight_int8pack_mm", "moe_cpu.routed_experts", "moe_cpu.add_routed_experts",
               "moe_cpu.add_attention"}


def decode_step_ops(engine) -> collections.Counter:
    """The torch ops (aten's and ours) of one eager batch-1 decode step after a 4-token prompt, by name: a step's
    glue is what they are besides the weight products (`PRODUCT_OPS`), each 1-3 us through torch's dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        engine.start(1, 32, torch.zeros(1, dtype=torch.long))
        engine.forward_last(torch.tensor([[1, 5, 9, 3]]), 0)
        with Count():
            engine.forward_last(torch.tensor([[7]]), 4)
    return counts


class _Clock:
    """A transformers streamer that timestamps every put(): the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_case(path: str, dtype: str, threads: int, repeats: int) -> dict:
    from transformers import MixtralForCausalLM

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    model = MixtralForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    load = time.perf_counter() - t0
    V = model.config.vocab_size

    def run(batch: int, length: int, new: int, seed: int) -> list[float]:
        ids = torch.tensor(prompts(batch, length, V, seed))
        clock = _Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, streamer=clock if batch == 1 else None, pad_token_id=0)
        end = time.perf_counter()
        return [start, *clock.times[1:], end]  # times[0] is the prompt being echoed

    run(1, 16, 4, 0)  # warm-up
    prefill, decode1, decode8 = [], [], []
    for r in range(repeats):
        t = run(1, PREFILL, 1, r)
        prefill.append(t[1] - t[0])
        t = run(1, DECODE_PROMPT, NEW_TOKENS, r)
        decode1.append((t[-2] - t[1]) / (NEW_TOKENS - 1))
        first = run(8, DECODE_PROMPT, 1, r)
        full = run(8, DECODE_PROMPT, NEW_TOKENS, r)
        decode8.append(((full[-1] - full[0]) - (first[-1] - first[0])) / (NEW_TOKENS - 1))
    return {"load_s": load, "prefill_s": statistics.median(prefill), "ttft_s": statistics.median(prefill),
            "decode1_step_s": statistics.median(decode1), "decode8_step_s": statistics.median(decode8),
            "peak_rss_mib": [peak_memory_mib()]}


def checkpoint_config(path: str | Path) -> ModelConfig:
    from moe.checkpoint.formats import detect

    return detect(path).config
