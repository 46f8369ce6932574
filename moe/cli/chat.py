"""`scripts/chat.py` (`moe-chat`): talk to an instruct model through its chat template, on 1 or N ranks.

On a terminal: a `> ` prompt with line editing and history, replies streamed as they are written; `/reset` forgets
the conversation, `/exit` (or Ctrl-D) ends it, Ctrl-C stops the current reply and keeps the session (what was shown
stays in the conversation). When standard input is not a terminal, each line is one user turn and each reply is
printed as it is produced, one reply a line block, nothing else on standard output.
"""

from __future__ import annotations

import argparse
import sys

from moe.api import MoEModel
from moe.chat.template import read_template_file
from moe.cli.common import (
    add_model_args,
    add_sampling_args,
    add_template_kwargs_arg,
    run_command,
    sampling_args,
    sampling_settings,
)
from moe.parallel.distributed import under_torchrun
from moe.tokenizer import load_tokenizer

EXAMPLES = """examples:
  python scripts/chat.py --ckpt DIR
  python scripts/chat.py --ckpt DIR --gpus 2 --system "Answer in one sentence." --temperature 0.7
  printf 'Hello\\nAnd then?\\n' | python scripts/chat.py --ckpt DIR --temperature 0
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="chat.py", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Chat with an instruct model through its chat template.")
    add_model_args(ap)
    add_sampling_args(ap, max_new_tokens=512)
    ap.add_argument("--system", default=None, help="a system message opening the conversation")
    ap.add_argument("--chat-template", default=None, metavar="FILE",
                    help="a Jinja chat template to use instead of the checkpoint's (or for one that has none)")
    add_template_kwargs_arg(ap, "every turn")
    ap.add_argument("--seed", type=int, default=None, help="random seed of the first reply (then one more a turn)")
    return ap


def main(argv: list[str] | None = None) -> int:
    return run_command(chat, parser().parse_args(argv))


def chat(args: argparse.Namespace) -> int:
    if under_torchrun():
        raise ValueError("chat.py reads its turns on one process; under torchrun start the ranks with --gpus N "
                         "instead (or call model.chat with the same messages on every rank)")
    template = read_template_file(args.chat_template) if args.chat_template else None
    sampling = sampling_args(args)
    tokenizer = load_tokenizer(args.ckpt)
    if tokenizer is None:
        raise ValueError(f"{args.ckpt}: no tokenizer.json or tokenizer.model beside the weights; chat needs one")
    tokenizer.chat_template(template)  # a checkpoint without one is refused before loading
    interactive = sys.stdin.isatty()
    with MoEModel.from_pretrained(args.ckpt, dtype=args.dtype, device=args.device, gpus=args.gpus,
                                  placement=args.placement, threads=args.threads, timeout_s=args.timeout,
                                  progress=interactive and not args.quiet) as model:
        session = Session(model, args.system, template, sampling, args.seed, args.chat_template_kwargs)
        if not args.quiet:  # standard output holds the replies alone
            shown, note = sampling_settings(model, args)
            print(f"settings: {shown} seed={'random' if args.seed is None else args.seed}{note}", file=sys.stderr)
        if interactive:
            print("chat: /reset forgets the conversation, /exit ends it; Ctrl-C stops a reply", file=sys.stderr)
            _line_editing()
        for line in _turns(interactive):
            command = line.strip()
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                session.reset()
                print("(conversation forgotten)", file=sys.stderr)
            elif command:
                session.reply(command)
    return 0


class Session:
    """The conversation so far, and one reply at a time streamed to standard output."""

    def __init__(self, model: MoEModel, system: str | None, template: str | None, sampling: dict,
                 seed: int | None, template_kwargs: dict | None = None) -> None:
        self.model, self.system, self.template, self.sampling, self.seed = model, system, template, sampling, seed
        self.template_kwargs = template_kwargs or {}
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        shown: list[str] = []

        def show(_: int, piece: str) -> None:
            shown.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()

        try:
            answer = self.model.chat(self.messages, chat_template=self.template, streamer=show, seed=self.seed,
                                     template_kwargs=self.template_kwargs, **self.sampling)
            content = str(answer)
        except KeyboardInterrupt:  # the request was cancelled on every rank; the model stays usable
            content = "".join(shown)
            print(" [stopped]", file=sys.stderr, end="")
        except ValueError as e:  # the template refused the conversation: say so, keep the session
            self.messages.pop()
            print(f"error: {e}", file=sys.stderr)
            return
        finally:
            if self.seed is not None:
                self.seed += 1
        print(flush=True)
        self.messages.append({"role": "assistant", "content": content})


def _turns(interactive: bool):
    """User lines: from `input()` on a terminal (Ctrl-D ends), else standard input's lines."""
    if not interactive:
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, the session goes on
            print(file=sys.stderr)


def _line_editing() -> None:
    try:
        import readline  # noqa: F401 -- input() gains editing and history where the platform has it
    except ImportError:
        pass
