"""`scripts/chat.py` as people use it: lines through a pipe, a session on a pseudo-terminal, Ctrl-C in a reply."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys

import pytest

from moe import MoEModel
from moe.cli.chat import Session
from tests.checkpoints import ROOT
from tests.test_chat_template import CHATML, checkpoint

CHAT = [sys.executable, str(ROOT / "scripts" / "chat.py")]
FLAGS = ["--temperature", "0", "--max-new-tokens", "6", "--quiet"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("chat"), template_config=CHATML)


def replies(path, turns: list[str], system: str | None = None) -> list[str]:
    """What the conversation's replies are, one turn at a time through model.chat."""
    out, messages = [], [{"role": "system", "content": system}] if system else []
    with MoEModel.from_pretrained(path) as model:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            out.append(str(model.chat(messages, max_new_tokens=6, temperature=0)))
            messages.append({"role": "assistant", "content": out[-1]})
    return out


def test_each_piped_line_is_a_turn_and_each_reply_is_printed(ckpt):
    done = subprocess.run([*CHAT, "--ckpt", str(ckpt), *FLAGS, "--system", "Be brief."],
                          input="Who is Emma?\n\nAnd Mr Knightley?\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    want = replies(ckpt, ["Who is Emma?", "And Mr Knightley?"], system="Be brief.")
    assert done.stdout == "".join(r + "\n" for r in want)


def test_reset_forgets_and_exit_ends_the_piped_session(ckpt):
    done = subprocess.run([*CHAT, "--ckpt", str(ckpt), *FLAGS], input="Who is Emma?\n/reset\nWho is Emma?\n/exit\nx\n",
                          capture_output=True, text=True, timeout=300)
    first = replies(ckpt, ["Who is Emma?"])[0]
    assert done.returncode == 0 and done.stdout == f"{first}\n{first}\n"


def test_a_session_on_a_terminal(ckpt):
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*CHAT, "--ckpt", str(ckpt), *FLAGS], stdin=follower, stdout=follower, stderr=follower,
                            close_fds=True)
    os.close(follower)
    seen = b""

    def read_until(marker: bytes) -> None:
        nonlocal seen
        while marker not in seen:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready, f"no {marker!r} on the terminal; it shows {seen[-300:]!r}"
            seen += os.read(leader, 4096)

    read_until(b"> ")
    os.write(leader, b"Who is Emma?\n")
    seen = b""
    read_until(b"> ")
    reply = seen.decode().replace("\r\n", "\n").split("\n", 1)[1].rsplit("\n", 1)[0]
    os.write(leader, b"/exit\n")
    assert proc.wait(timeout=120) == 0
    os.close(leader)
    assert reply == replies(ckpt, ["Who is Emma?"])[0]


def test_ctrl_c_stops_a_reply_and_keeps_the_session(ckpt, monkeypatch, capsys):
    with MoEModel.from_pretrained(ckpt) as model:
        session = Session(model, None, None, dict(max_new_tokens=6, temperature=0), None)
        pieces = []

        def write(piece: str) -> None:
            pieces.append(piece)
            if len(pieces) == 2:
                raise KeyboardInterrupt  # Ctrl-C while the reply streams

        monkeypatch.setattr(sys.stdout, "write", write)
        session.reply("Who is Emma?")
        monkeypatch.undo()
        assert session.messages[-1] == {"role": "assistant", "content": pieces[0] + pieces[1]}
        session.reply("And Mr Knightley?")  # the model still answers
        assert session.messages[-1]["role"] == "assistant" and len(session.messages) == 4
        want = model.chat(session.messages[:3], max_new_tokens=6, temperature=0)
        assert session.messages[-1]["content"] == want


def test_a_checkpoint_without_a_template_is_refused_in_one_line(tmp_path):
    path = checkpoint(tmp_path)
    done = subprocess.run([*CHAT, "--ckpt", str(path), "--quiet"], input="hi\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--chat-template FILE" in done.stderr
    template = tmp_path / "t.jinja"
    template.write_text(CHATML)
    done = subprocess.run([*CHAT, "--ckpt", str(path), *FLAGS, "--chat-template", str(template)], input="hi\n",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("\n")


def test_the_settings_line_names_generation_configs_defaults_and_the_reply_follows_them(tmp_path):
    path = checkpoint(tmp_path, template_config=CHATML)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8}))
    done = subprocess.run([*CHAT, "--ckpt", str(path), "--max-new-tokens", "6", "--top-p", "0.5", "--seed", "3"],
                          input="Who is Emma?\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("settings:")] == [
        "settings: max_new_tokens=6 temperature=0.7* top_p=0.5 top_k=0 seed=3 (* from generation_config.json)"]
    with MoEModel.from_pretrained(path) as model:  # the same reply asked for with every setting spelled out
        want = model.chat([{"role": "user", "content": "Who is Emma?"}], max_new_tokens=6, seed=3, temperature=0.7,
                          top_p=0.5)
    assert done.stdout == f"{want}\n"


def test_chat_template_kwargs_reach_the_template(ckpt):
    done = subprocess.run([*CHAT, "--ckpt", str(ckpt), *FLAGS, "--chat-template-kwargs", '{"enable_thinking": false}'],
                          input="Who is Emma?\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    messages = [{"role": "user", "content": "Who is Emma?"}]
    with MoEModel.from_pretrained(ckpt) as model:
        want = model.chat(messages, max_new_tokens=6, temperature=0, template_kwargs={"enable_thinking": False})
        assert model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False) != \
            model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # the switch changes the prompt
    assert done.stdout == f"{want}\n"
