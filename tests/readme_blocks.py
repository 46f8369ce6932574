"""The fenced code blocks of the README and of docs/, so tests and CI run what a reader copies (stdlib only: CI
calls it before anything is installed).

    python3 tests/readme_blocks.py bash 0     # prints the README's first bash block
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def blocks(language: str, readme: Path = README) -> list[str]:
    """The bodies of the ```language fences, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", readme.read_text(), flags=re.M | re.S)


if __name__ == "__main__":
    print(blocks(sys.argv[1])[int(sys.argv[2])], end="")
