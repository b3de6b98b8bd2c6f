"""A teacher file's index written beside it, `FILE.index`: where each (side, text) of the file is
(`text_index.TextIndex`) and what the file's checks found, so that the ranks of a run map it instead of each hashing
every key of the file and checking every vector (`frozen.EmbeddingTable.read`).

It is an uncompressed Arrow IPC file of one record batch: the index's `high` and `low` digest halves (uint64) and
each key's `row` (int64), sorted by the high half, which every process of a machine maps (one copy of the pages per
machine); its schema's metadata holds, under `METADATA`, the rows and width of the file's table, whether it has a
side column, its sides and its number of image views, and the size and modification time of the file it indexes. An
index whose file has changed since (another size or time) is stale: the reader says so and indexes the file itself.
`python -m titan_contrastive.embed` and `embed_images` write it with the file (.arrow and .parquet), and
`python -m titan_contrastive.index_embeddings FILE` for a file written by anything else."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_contrastive.atomic_write import write_atomically
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.text_index import TextIndex

__all__ = ["INDEX_COMMAND", "Saved", "index_path", "load", "save"]

logger = logging.getLogger("titan_contrastive")

SUFFIX = ".index"
METADATA = b"titan_contrastive.index"
VERSION = 1
COLUMNS = (("high", "uint64"), ("low", "uint64"), ("row", "int64"))
INDEX_COMMAND = "python -m titan_contrastive.index_embeddings"


@dataclass(frozen=True)
class Saved:
    """What a file's checks found: its `index`, its table's `rows` and `dim`, whether it has a side column (`sided`)
    and its stored image views (`views`, `frozen.EmbeddingTable.views`)."""

    index: TextIndex
    rows: int
    dim: int
    sided: bool
    views: int


def index_path(file: Path) -> Path:
    """Where `file`'s index is: beside it, named FILE.index."""
    return file.with_name(file.name + SUFFIX)


def _stamp(file: Path) -> dict[str, int]:
    """`file`'s size and modification time (ns): what an index of it names."""
    stat = os.stat(file)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def save(out: Path, saved: Saved, of: Path) -> Path:
    """Write `saved` as `out`'s index (through a temporary file), naming the size and time of `of`: `out` itself, or
    the file that will be renamed to it (a rename keeps both)."""
    import pyarrow as pa

    index = saved.index
    facts = {
        "version": VERSION,
        "rows": saved.rows,
        "dim": saved.dim,
        "sided": saved.sided,
        "sides": sorted(index.sides),
        "views": saved.views,
        **_stamp(of),
    }
    arrays = [pa.array(np.asarray(a, dtype=kind)) for a, (_, kind) in zip((index.high, index.low, index.rows), COLUMNS)]
    batch = pa.record_batch(arrays, names=[name for name, _ in COLUMNS], metadata={METADATA: json.dumps(facts)})

    def write(tmp: Path) -> None:
        with pa.ipc.new_file(str(tmp), batch.schema) as writer:
            writer.write_batch(batch)

    return write_atomically(index_path(out), write)


def load(file: Path) -> Saved | None:
    """`file`'s index, its arrays mapped from its index file; None where it has none, or a stale one (a warning); a
    DataError where the index file is damaged."""
    path = index_path(file)
    if not path.is_file():
        return None
    import pyarrow as pa

    fix = f"delete it, or write it again: {INDEX_COMMAND} {file}"
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        facts = json.loads((reader.schema.metadata or {}).get(METADATA, b"null"))
        batch = reader.get_batch(0) if reader.num_record_batches == 1 else None
        kinds = [(field.name, str(field.type)) for field in batch.schema] if batch is not None else []
        if not _facts(facts) or kinds != list(COLUMNS):
            raise DataError(f"{path} is not an index of version {VERSION} (columns {kinds}); {fix}")
        if {k: facts[k] for k in ("size", "mtime_ns")} != _stamp(file):
            logger.warning(
                f"warning: {path} is stale ({file} has changed since it was written), so every process indexes the "
                f"file itself; write it again: {INDEX_COMMAND} {file}"
            )
            return None
        high, low, rows = (batch.column(name).to_numpy(zero_copy_only=True) for name, _ in COLUMNS)  # no nulls
    except DataError:
        raise
    except (OSError, ValueError, pa.ArrowException) as e:  # not an Arrow file, not JSON metadata, a null
        raise DataError(f"its index {path} is not readable ({type(e).__name__}: {e}); {fix}") from None
    return Saved(
        TextIndex(high, low, rows, frozenset(facts["sides"])),
        facts["rows"],
        facts["dim"],
        facts["sided"],
        facts["views"],
    )


def _facts(facts: object) -> bool:
    """`facts` are an index's metadata of this version, each of the right type."""
    if not isinstance(facts, dict) or facts.get("version") != VERSION:
        return False
    counts = ("rows", "dim", "views", "size", "mtime_ns")
    sides = facts.get("sides")
    return (
        all(type(facts.get(k)) is int and facts[k] >= 0 for k in counts)
        and type(facts.get("sided")) is bool
        and isinstance(sides, list)
        and all(isinstance(side, str) for side in sides)
    )
