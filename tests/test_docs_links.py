"""Every link between the project's Markdown files reaches its file and, where it names one, its section: a reader
who follows a claim's link lands on the figures behind it, not on the top of a page or a 404."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.checkpoints import ROOT

PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "weights").glob("*/README.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")  # a repeated heading gets -1, -2, ... as on GitHub
            seen[base] = n + 1
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_slug_is_githubs():
    assert slug("Serving against llama-server (AMD EPYC Zen 4, family 25 model 17, 2 cores)") == \
        "serving-against-llama-server-amd-epyc-zen-4-family-25-model-17-2-cores"
    assert slug("`--compile` and torch.compile_step") == "--compile-and-torchcompile_step"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_reach_their_file_and_section(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such section in {dest.relative_to(ROOT)}")
    assert not broken, broken
