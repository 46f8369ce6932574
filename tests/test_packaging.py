"""Every command is a console script, and a plain (non-editable) install gives working commands."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.checkpoints import ROOT, TRAINED

tomllib = pytest.importorskip("tomllib")


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_script_has_a_console_script_calling_the_same_function():
    scripts = console_scripts()
    for path in sorted((ROOT / "scripts").glob("*.py")):
        module, function = re.search(r"from (moe\.cli\.\w+) import (\w+)", path.read_text()).groups()
        assert scripts.get("moe-" + path.stem.replace("_", "-")) == f"{module}:{function}", path.name
    assert len(scripts) == len(list((ROOT / "scripts").glob("*.py")))


def test_a_plain_install_gives_working_commands(tmp_path):
    """Installed without -e into a fresh environment (torch and the others seen from this one's site-packages)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    # This environment's packages as plain paths after the new one's own: its .pth files (this checkout's editable
    # install among them) are not read there. `system_site_packages` would give the base interpreter's instead,
    # which in a virtual environment (as CI runs) need not hold torch.
    inner = subprocess.run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(inner) / "outer-environment.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    done = subprocess.run([bin_dir / "python", "-m", "pip", "install", "--no-deps", "-q",
                           str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    where = subprocess.run([bin_dir / "python", "-c", "import moe; print(moe.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path)
    assert str(env_dir) in where.stdout  # the installed copy, not this checkout
    for name in console_scripts():
        assert (bin_dir / name).exists(), name
    out = subprocess.run([bin_dir / "moe-generate", "--ckpt", str(TRAINED), "--prompt", "It is a truth",
                          "--max-new-tokens", "4", "--quiet"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("model:"), out.stderr
    helped = subprocess.run([bin_dir / "moe-chat", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0 and "chat template" in helped.stdout
    assert sys.prefix != str(env_dir)
