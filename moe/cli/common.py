"""What every command shares: one-line errors, prompts from flags or files, output from rank 0 only."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from moe.checkpoint.files import resolve_checkpoint
from moe.errors import USER_ERRORS, RankFailure
from moe.parallel.devices import DEVICES
from moe.parallel.distributed import DEFAULT_TIMEOUT_S, under_torchrun


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command: a user error is one line and exit 2, a failure one line and exit 1, Ctrl-C one line
    (`interrupted`) and exit 130; `--debug` shows the traceback instead."""
    debug = getattr(args, "debug", False)
    try:
        check_flags(args)
        if getattr(args, "ckpt", None) is not None:  # a directory, or a Hub repository id in the local cache
            args.ckpt = resolve_checkpoint(args.ckpt)
        return command(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank finds the same bad input: say it once
            print(f"error: {e}", file=sys.stderr)
        return 2
    except (RankFailure, OSError) as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


def check_flags(args: argparse.Namespace) -> None:
    """Numbers every command shares, checked before anything starts."""
    for flag, low, high in (("threads", 1, 4096), ("gpus", 1, 4096), ("master_port", 1, 65535),
                            ("max_new_tokens", 1, 10**7), ("batch_size", 1, 10**6), ("seq_len", 1, 10**7)):
        value = getattr(args, flag, None)
        if value is not None and not low <= value <= high:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be between {low} and {high}")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < float("inf"):
        raise ValueError(f"--timeout {timeout}: must be a positive number of seconds")


def refuse_gpus_under_torchrun(args: argparse.Namespace) -> None:
    """Under torchrun the ranks are torchrun's: a --gpus that is not the default would be silently ignored."""
    if under_torchrun() and getattr(args, "gpus", 1) != 1:
        raise ValueError("--gpus does not apply under torchrun (its --nproc-per-node and --nnodes set the ranks); "
                         "drop it")


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += [line for line in read_text_arg("--prompt-file", args.prompt_file).splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def read_text_arg(flag: str, name: str) -> str:
    """A UTF-8 text file named on the command line; `-` is standard input."""
    try:
        data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {name}: no such file") from None
    except OSError as e:
        raise ValueError(f"{flag} {name}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {name}: not UTF-8 text (byte {e.start}); convert it, e.g. iconv -t UTF-8") from None


def parse_blocks_per_rank(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--blocks-per-rank {text!r} must be comma-separated integers, e.g. 3,2,2,1") from None


def say_from(rank: int) -> Callable[..., None]:
    """`print` on rank 0, nothing elsewhere (every torchrun process runs the same command)."""
    return print if rank == 0 else (lambda *a, **k: None)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--ckpt, --dtype, --gpus, --threads, --placement: how every inference command loads a model."""
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (Hugging Face or Mistral consolidated), or a "
                    "Hub repository id (org/name) in the local Hugging Face cache")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"], default=None,
                    help="weights and activations dtype (default: the checkpoint's, else float32); int8: "
                         "int8 weights quantized at load (per output channel), bf16 activations")
    ap.add_argument("--gpus", type=int, default=1,
                    help="ranks to start here: one per GPU with CUDA, else CPU processes over gloo (default 1; "
                         "not under torchrun, which sets the ranks itself)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    ap.add_argument("--placement", default=None,
                    help="placement plan JSON (owner rank of embedding, blocks, head; ranks of every expert)")
    ap.add_argument("--device", choices=DEVICES, default="auto",
                    help="auto (default): CUDA when there is a GPU per rank, CPU when there is none; cuda; cpu")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                    help=f"how long ranks wait for the slowest one, e.g. while loading (default {DEFAULT_TIMEOUT_S:g})")
    ap.add_argument("--quiet", action="store_true", help="no progress bars or load lines")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def add_sampling_args(ap: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    """`generate`'s sampling parameters as flags (vLLM's names); left out, the checkpoint's defaults apply."""
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                    help=f"tokens to generate per prompt (default {max_new_tokens})")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature; 0 is greedy (default: generation_config.json's, else 0)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="nucleus sampling threshold (default: generation_config.json's, else 1.0 = off)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="sample among the k most likely tokens (default: generation_config.json's, else 0 = off)")
    ap.add_argument("--min-p", type=float, default=None,
                    help="drop tokens less likely than min_p times the most likely one (default: off)")
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help="divide the logits of tokens already in the prompt or output (transformers'; 1 = off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="subtract from the logits of tokens already generated (OpenAI's; -2 to 2, default 0)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="subtract per occurrence in the output (OpenAI's; -2 to 2, default 0)")
    ap.add_argument("--stop", action="append", default=None, help="stop before this text; repeat for several")
    ap.add_argument("--stop-token-id", action="append", type=int, default=None, help="stop at this token id")
    ap.add_argument("--min-tokens", type=int, default=0,
                    help="no end-of-sequence or stop before this many new tokens (vLLM's; default 0)")
    ap.add_argument("--logit-bias", action="append", type=logit_bias, default=None, metavar="ID(+/-)BIAS",
                    help="add BIAS to token ID's logits, e.g. 15043+1 or 15043-100 (llama.cpp's); repeat for several")
    ap.add_argument("--special", action="store_true",
                    help="show special tokens (<|im_end|>, </s>) in the text (llama.cpp's flag); left out by default")


def sampling_args(args: argparse.Namespace) -> dict:
    """The command line's sampling options as `generate`'s keywords (None: the checkpoint's default)."""
    given = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                 stop=args.stop, stop_token_ids=args.stop_token_id, skip_special_tokens=not args.special,
                 min_tokens=args.min_tokens, logit_bias=dict(args.logit_bias) if args.logit_bias else None)
    return {k: v for k, v in given.items() if v is not None}


def logit_bias(text: str) -> tuple[int, float]:
    """An argparse type: llama.cpp's TOKEN_ID(+/-)BIAS, e.g. 15043+1."""
    found = re.fullmatch(r"(\d+)([+-](?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS, e.g. 15043+1, got {text!r}")
    return int(found[1]), float(found[2])


def sampling_settings(model, args: argparse.Namespace) -> tuple[str, str]:
    """The sampling a command runs with, for its `settings:` line: each option given or defaulted, `*` on
    those that came from the checkpoint's generation_config.json (as transformers and vLLM apply them)."""
    sampling, from_file = model.generation_defaults.merged(temperature=args.temperature, top_p=args.top_p,
                                                           top_k=args.top_k, min_p=args.min_p,
                                                           repetition_penalty=args.repetition_penalty)
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0} | sampling
    shown = " ".join(f"{k}={v}" + ("*" if k in from_file else "") for k, v in sampling.items())
    return f"max_new_tokens={args.max_new_tokens} {shown}", " (* from generation_config.json)" if from_file else ""


def json_object(text: str) -> dict:
    """An argparse type: a JSON object, e.g. '{"enable_thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def template_switches(text: str) -> dict:
    """An argparse type: a chat template's own switches, as a JSON object (`moe.chat.template.check_switches`)."""
    from moe.chat.template import check_switches

    try:
        return check_switches(json_object(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_template_kwargs_arg(ap: argparse.ArgumentParser, who: str) -> None:
    ap.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                    help=f"the chat template's own switches for {who}, e.g. '{{\"enable_thinking\": false}}' for "
                         "Qwen3's")
