"""A data file's format: its suffix (`data_suffix`), and for JSON lines, CSV and TSV gzipped too (`train.jsonl.gz`,
`collection.tsv.gz`, as sentence-transformers' training files and tevatron's corpora are published): the format is then
the suffix before `.gz`, and the file is decompressed as it is read (`open_text`), never written out whole."""

from __future__ import annotations

import gzip
from collections.abc import Collection
from pathlib import Path
from typing import IO

__all__ = ["TEXT_FORMATS", "data_suffix", "file_kind", "formats_named", "open_text"]

TEXT_FORMATS = (".jsonl", ".csv", ".tsv")
"""The formats that may come gzipped (`.gz` after the suffix)."""


def data_suffix(file: str | Path) -> str:
    """`file`'s format: its suffix, or a gzipped text file's suffix before `.gz` (`train.jsonl.gz`: `.jsonl`)."""
    file = Path(file)
    if file.suffix == ".gz" and len(file.suffixes) > 1 and file.suffixes[-2] in TEXT_FORMATS:
        return file.suffixes[-2]
    return file.suffix


def formats_named(suffixes: Collection[str]) -> str:
    """`suffixes` for a message: `.jsonl/.csv/.parquet`, the text formats' gzipped form named after them."""
    gzipped = [s for s in suffixes if s in TEXT_FORMATS]
    return "/".join(suffixes) + (f" (or {'/'.join(s + '.gz' for s in gzipped)})" if gzipped else "")


def file_kind(file: Path) -> str:
    """`file`'s format as its name ends: `.jsonl`, or gzipped `.jsonl.gz` (two kinds, for a folder holding both)."""
    return data_suffix(file) + (".gz" if data_suffix(file) != file.suffix else "")


def open_text(file: Path, newline: str | None = None) -> IO[str]:
    """A JSON lines, CSV or TSV file opened to read as text, decompressed as it is read where it is gzipped (`.gz`); a
    byte-order mark is dropped (no JSON, and not part of a CSV's first column)."""
    if file.suffix == ".gz":
        return gzip.open(file, "rt", encoding="utf-8-sig", newline=newline)
    return open(file, encoding="utf-8-sig", newline=newline)
