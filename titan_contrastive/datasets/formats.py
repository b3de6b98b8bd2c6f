"""A data file's format: its suffix (`data_suffix`); JSON lines, JSON, CSV, TSV and plain text may come compressed
(`train.jsonl.gz`, `collection.tsv.gz`, as sentence-transformers' training files and tevatron's corpora are published;
`.bz2`, `.xz`, and `.zst` with the `[data]` extra): the format is then the suffix before the compression's, and the
file is decompressed as it is read (`open_text`), never written out whole."""

from __future__ import annotations

import bz2
import gzip
import lzma
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO

from titan_contrastive.datasets.base import DataError
from titan_contrastive.extras import import_failure

try:
    from zstandard import ZstdError
except ImportError:  # without the [data] extra a .zst file is refused before it is read
    ZstdError = OSError

__all__ = ["COMPRESSIONS", "DAMAGED", "TEXT_FORMATS", "data_suffix", "file_kind", "formats_named", "open_text"]

TEXT_FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".txt")
"""The formats that may come compressed (one of `COMPRESSIONS` after the suffix)."""

COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""gzip, bzip2, xz (Python's own modules) and Zstandard (`zstandard`, the `[data]` extra)."""

DAMAGED: tuple[type[Exception], ...] = (OSError, EOFError, lzma.LZMAError, ZstdError)
"""What reading a damaged or cut-short file raises: an OS error, and each decompressor's own."""


def data_suffix(file: str | Path) -> str:
    """`file`'s format: its suffix, or a compressed text file's suffix before the compression's (`train.jsonl.gz`:
    `.jsonl`)."""
    file = Path(file)
    if file.suffix in COMPRESSIONS and len(file.suffixes) > 1 and file.suffixes[-2] in TEXT_FORMATS:
        return file.suffixes[-2]
    return file.suffix


def formats_named(suffixes: Collection[str]) -> str:
    """`suffixes` for a message: `.jsonl/.csv/.parquet`, the compressions of the text formats named after them."""
    text = [s for s in suffixes if s in TEXT_FORMATS]
    compressed = f" (the text ones also compressed: {text[0]}{', '.join(COMPRESSIONS)})" if text else ""
    return "/".join(suffixes) + compressed


def file_kind(file: Path) -> str:
    """`file`'s format as its name ends: `.jsonl`, or compressed `.jsonl.gz` (two kinds, for a folder holding both)."""
    return data_suffix(file) + (file.suffix if data_suffix(file) != file.suffix else "")


def open_text(file: Path, newline: str | None = None) -> IO[str]:
    """A JSON lines, JSON, CSV, TSV or plain text file opened to read as text, decompressed as it is read where it is
    compressed (`COMPRESSIONS`); a byte-order mark is dropped (no JSON, and not part of a CSV's first column)."""
    if data_suffix(file) == file.suffix:
        return open(file, encoding="utf-8-sig", newline=newline)
    return _opener(file)(file, "rt", encoding="utf-8-sig", newline=newline)


def _opener(file: Path) -> Callable[..., IO[str]]:
    """The `open` of `file`'s compression."""
    if file.suffix != ".zst":
        return {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[file.suffix]
    try:
        import zstandard
    except ImportError as e:
        raise DataError(f"{import_failure(e, f'{file} (Zstandard)', 'data')} (or give it gzipped)") from None
    return zstandard.open
