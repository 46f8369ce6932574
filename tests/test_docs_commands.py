"""Every ```bash block of docs/ runs as it is written, from a folder that holds the repository's `scripts/` and
`weights/` (its outputs stay there). The curl blocks of serving.md go to a running server in tests/test_server.py.
Commands that need what CI does not have (GPUs, two machines, a download, half an hour) are ```text blocks that
say so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme_blocks import DOCS, ROOT, blocks

BLOCKS = [(page.name, i, block) for page in DOCS for i, block in enumerate(blocks("bash", page))
          if not block.startswith("curl ")]
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # the shipped model on 4 rank processes


def test_the_docs_have_shell_blocks_to_run():
    assert {page for page, _, _ in BLOCKS} >= {"checkpoints.md", "expert-load.md", "parallelism.md"}


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_a_docs_shell_block_runs_as_written(page, index, block, tmp_path):
    for name in ("scripts", "weights"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{page} block {index}:\n{block}\n{done.stderr[-3000:]}"
