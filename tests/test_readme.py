"""The README and docs/ cannot drift from the code: their Python examples and the README's first command run as a
reader runs them.

Each ```python block (README.md and every page of docs/) runs as a script of its own (no main guard, imports
included) in a fresh process, from a clean working directory that holds only the shipped `weights/` (as the
repository root would), twice: an example that writes a fixed path would fail the second time.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys

import pytest

from moe.parallel.distributed import free_port
from tests.readme_blocks import DOCS, README, ROOT, blocks

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def clean_dir(tmp_path):
    (tmp_path / "weights").symlink_to(ROOT / "weights")
    return tmp_path


EXAMPLES = [(page, i) for page in [README, *DOCS] for i in range(len(blocks("python", page)))]


@pytest.mark.parametrize("page, index", EXAMPLES, ids=[f"{p.name}-{i}" for p, i in EXAMPLES])
def test_python_example_runs_as_a_plain_script_twice(page, index, tmp_path):
    script = tmp_path / f"example{index}.py"
    script.write_text(blocks("python", page)[index])
    for attempt in range(2):
        proc = subprocess.run([sys.executable, script.name], cwd=clean_dir(tmp_path) if attempt == 0 else tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"run {attempt + 1}:\n{proc.stderr}"
        assert proc.stdout.strip(), "an example prints what it shows"


def test_first_command_generates_text(tmp_path):
    """The README's first command after its installs, with few tokens, from the repository root."""
    command = blocks("bash")[0].split("&&")[-1]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "scripts/generate.py"], command
    argv[argv.index("--max-new-tokens") + 1] = "8"
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prompt = argv[argv.index("--prompt") + 1]
    continuation = proc.stdout.split(prompt, 1)[1].split("\nload ")[0]
    assert len(continuation.split()) >= 4, proc.stdout


def test_chat_line_runs_as_written_with_a_line_typed_in():
    """The README's chat line from the repository root, a user's line arriving through a pipe, then the end of input."""
    (command,) = [b.strip() for b in blocks("bash") if "scripts/chat.py" in b]
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, input="Who is Emma?\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the reply is printed"


def test_serve_line_runs_as_written_and_answers():
    """The README's serve line from the repository root, until it answers a completion, then SIGTERM: exit 0. Run
    with --no-compile added (by default it first builds a compiled step per batch size: minutes on 2 cores, which
    tests/test_serve_compiled.py covers), and on a free port where 8000 is taken."""
    pytest.importorskip("uvicorn")
    from tests.servers import Server

    (command,) = [b.strip() for b in blocks("bash") if "scripts/serve.py" in b]
    argv = shlex.split(command)
    at = argv.index("--port") + 1
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", int(argv[at]))) == 0:
            argv[at] = str(free_port())
    with Server.of_command([*argv[1:], "--no-compile"], int(argv[at]), cwd=ROOT) as server:
        got = server.post("/v1/completions", {"prompt": "And God said", "max_tokens": 8})
        assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 8, got.text
        assert server.stop() == 0


def test_examples_pass_ruff(tmp_path):
    """The line-length rule and the rest of ruff's apply to what the pages show."""
    ruff = pytest.importorskip("ruff", reason="ruff is in the test extra")
    del ruff
    for n, (page, i) in enumerate(EXAMPLES):
        (tmp_path / f"{page.stem.replace('-', '_')}_{n}.py").write_text(blocks("python", page)[i])
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                           str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
