"""The retrieval mode of each `::`-joined source of `data.path` (`source_modes`): `data.retrieval_modes`, one per
source, else `data.retrieval_mode` for each. A source's mode may be "auto" (or the whole list one "auto", for every
source): the mode its rows hold, read from its first rows (`PROBE`), as a reader of MMEB-train's subsets would say
it: a side holding texts only is text, images only image, both multi (VLM2Vec's rows: a query with an image keeps
its instruction beside it, so its image queries are m; its image documents that keep "Represent the given image."
are m too), whichever columns name them (ours, VLM2Vec's, colpali-engine's; an image a path or held in the cell)."""

from __future__ import annotations

import functools
import itertools
import logging
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.held_images import held
from titan_contrastive.datasets.retrieval import MODES, SIDES
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.tables import table_rows
from titan_contrastive.datasets.vl_files import COLUMNS, FORMATS
from titan_contrastive.datasets.vl_rows import from_colpali, from_vlm2vec

__all__ = ["AUTO", "PROBE", "rows_mode", "source_modes"]

AUTO = "auto"
PROBE = 64
"""The rows of a source its mode is read from: a side is an image side where any of them holds an image, and a text
side where any holds a text (so a row or two without one, bad samples, do not decide it)."""

logger = logging.getLogger("titan_contrastive")


def source_modes(data: Any) -> list[str]:
    """The mode of each source (see the module docstring); a DataError, one line naming the field, for modes of data
    other than vl_pairs rows, another count than sources, "auto" for rows of document ids (`data.corpus`: their
    documents' kinds are the corpus's), or t2t beside another (a step or a rank of text rows alone would leave the
    vision tower without gradients, which DDP needs every step). Rows of several modes share a batch unless
    `data.same_source_batches`."""
    parts = data.path.split("::")
    modes = list(data.retrieval_modes)
    if not modes:
        return [data.retrieval_mode] * len(parts)
    given = f"data.retrieval_modes={modes}"
    if data.dataset != "vl_pairs":
        raise DataError(
            f"{given}: per-source modes are for vl_pairs rows, not data.dataset={data.dataset!r}; leave it empty "
            "and set data.retrieval_mode"
        )
    if modes == [AUTO]:
        modes = modes * len(parts)
    if len(modes) != len(parts):
        raise DataError(
            f"{given}: {len(modes)} mode(s) for the {len(parts)} source(s) in data.path; give one per '::'-joined "
            "source ('auto' alone: each source's own), or leave it empty for data.retrieval_mode"
        )
    if AUTO in modes and data.corpus:
        raise DataError(
            f"{given}: 'auto' reads a source's rows, and rows of document ids (data.corpus) hold no documents; give "
            "their modes"
        )
    modes = [rows_mode(path, given) if mode == AUTO else mode for path, mode in zip(parts, modes)]
    if "t2t" in modes and len(set(modes)) > 1:
        raise DataError(
            f"{given}: a t2t step would leave the vision tower without gradients, which the other modes train (and "
            "DDP needs each step); train the t2t source apart, or give its rows images"
        )
    return modes


def rows_mode(path: str, given: str) -> str:
    """The mode `path`'s first `PROBE` rows hold (its first file's, of a pattern or folder of shards), read once per
    version of the file; `given` names the setting in a DataError."""
    shards = shard_files(path, FORMATS)
    file = shards[0] if shards else Path(path).expanduser()
    if not file.exists():
        raise DataError(f"{given}: 'auto' reads each source's rows, and {path} does not exist; give an existing file")
    stat = file.stat()
    mode, kinds = _read_mode(str(file), stat.st_mtime_ns, stat.st_size)
    if not mode:
        empty = next(side for side, kind in zip(SIDES, kinds) if not kind)
        raise DataError(
            f"{given}: {path}'s first rows hold no {empty}_text nor {empty}_image, so 'auto' finds no mode; give its "
            "mode, or its columns (query_text, query_image, doc_text, doc_image, or VLM2Vec's)"
        )
    return mode


@functools.cache
def _read_mode(file: str, version: int, size: int) -> tuple[str, tuple[str, ...]]:
    """The mode of `file`'s first rows ("" for none) and each side's kind in them ("" for a side they do not hold),
    logged once per version."""
    _, rows = table_rows(Path(file), COLUMNS, "train")
    seen = {side: {"text": False, "image": False} for side in SIDES}
    for row in itertools.islice(rows, PROBE):
        row = from_colpali(from_vlm2vec(row)) if isinstance(row, dict) else {}
        for side in SIDES:
            seen[side]["text"] |= _text(row.get(f"{side}_text"))
            seen[side]["image"] |= _image(row.get(f"{side}_image"))
    kinds = tuple(_kind(seen[side]) for side in SIDES)
    mode = next((m for m, k in MODES.items() if k == kinds), "")
    if mode:
        logger.info(f"{file}: rows of retrieval mode {mode} (data.retrieval_modes 'auto', read from its first rows)")
    return mode, kinds


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _image(value: Any) -> bool:
    """A path, or an image held in the cell (bytes, or an Image struct of bytes or a path)."""
    if not held(value):
        return _text(value)
    return bool(value) if isinstance(value, (bytes, bytearray)) else bool(value.get("bytes") or value.get("path"))


def _kind(seen: dict[str, bool]) -> str:
    return "multi" if seen["text"] and seen["image"] else "image" if seen["image"] else "text" if seen["text"] else ""
