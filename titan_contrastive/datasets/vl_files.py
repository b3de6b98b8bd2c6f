"""A vl_pairs source read into memory (`read_source`): its files' rows, each its values of the dataset's columns, packed
as they are read (`packed_rows.PackedRows`), each row's count of hard negatives beside them, and the source's retrieval
mode (`VLFile`: which of a row's cells its sides read)."""

from __future__ import annotations

import csv
import logging
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, formats_named
from titan_contrastive.datasets.held_images import ImageStore
from titan_contrastive.datasets.packed_rows import PackedRows, Unpackable, packable
from titan_contrastive.datasets.retrieval import MODES, SIDES, side_kinds
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.sources import rooted
from titan_contrastive.datasets.tables import table_rows
from titan_contrastive.datasets.vl_corpus import POSITIVE_IDS, POSITIVES_COLUMN, by_id, read_corpus, resolved_rows
from titan_contrastive.datasets.vl_rows import as_list, from_colpali, from_vlm2vec

__all__ = [
    "COLUMNS",
    "FORMATS",
    "NEGATIVES_COLUMN",
    "SCORES_COLUMN",
    "VLFile",
    "needed",
    "read_source",
    "with_documents",
]

FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")
FIELDS = {"text": ("text",), "image": ("image",), "multi": ("image", "text")}
"""A side's kind -> the fields a row needs for it."""
COLUMNS = tuple(f"{side}_{field}" for side in SIDES for field in ("image", "text"))
NEGATIVES_COLUMN = "doc_negatives"
SCORES_COLUMN = "doc_scores"

logger = logging.getLogger("titan_contrastive")


def needed(mode: str) -> list[str]:
    """The columns a row of `mode` needs (`retrieval.MODES`): a text side's `*_text`, an image side's `*_image`, a
    multi side's both."""
    return [f"{side}_{field}" for side, kind in side_kinds(mode).items() for field in FIELDS[kind]]


class VLFile(NamedTuple):
    root: Path
    """Image paths are relative to it (`data.image_root`, else the file's folder)."""
    source: str
    rows: PackedRows
    """Per row, its values of the dataset's columns (`VLPairsDataset._columns`), in that order."""
    negatives: np.ndarray
    """int64 [rows]: how many hard negatives each row holds."""
    mode: str
    """Its retrieval mode (`[data] retrieval_modes`, else `retrieval_mode`)."""
    positives: np.ndarray | None = None
    """int64 [rows]: how many positives each row names (rows of document ids, `with_documents`); None: one each."""

    @property
    def kinds(self) -> dict[str, str]:
        """Each side's kind: text, image or multi."""
        return side_kinds(self.mode)

    @property
    def needed(self) -> list[str]:
        return needed(self.mode)

    @property
    def negative_kind(self) -> str:
        """Its hard negatives' kind, its documents': texts, image paths, or (multi) `{"image", "text"}` objects."""
        return self.kinds["doc"]


def read_source(
    path: str,
    key: str,
    mode: str,
    split: str,
    columns: Sequence[str],
    image_root: Path | None,
    scored: bool,
    store: ImageStore,
    ids: bool = False,
) -> VLFile:
    """One source's rows: its file's, or the rows of each file a pattern or a folder of shards names
    (`shards.shard_files`) in order, each file's image paths made absolute from its own folder (unless `image_root`);
    each row its values of `columns`. `scored`: its rows give a teacher's scores (`SCORES_COLUMN`). Images held in
    the cells (a Parquet file's Hugging Face image column) are written to `store` and read from there. `ids`: rows of
    document ids (`vl_corpus`; `with_documents` then reads their documents)."""
    shards = shard_files(path, FORMATS)
    files = [Path(path).expanduser()] if shards is None else shards
    for file in files:
        if not (file.is_dir() or data_suffix(file) in FORMATS and file.is_file()):
            raise DataError(
                f"{key}={path}: not an existing {formats_named(FORMATS)} file or save_to_disk folder; "
                "data.dataset='vl_pairs' reads rows "
                f"with the columns {', '.join(COLUMNS)}"
            )
    negatives, at, place = array("q"), [files[0], 0], list(columns).index(NEGATIVES_COLUMN)
    each_root = shards is not None and not image_root

    def rows() -> Iterator[list[Any]]:  # every file's, each row's count of hard negatives kept as it goes
        for file in files:
            for values in _file_rows(file, each_root, mode, split, columns, scored, at, store, ids):
                negatives.append(len(as_list(values[place])))
                yield values

    try:
        packed = PackedRows(rows())
    except Unpackable as e:
        column, value = next((c, v) for c, v in zip(columns, e.value) if not packable(v))
        raise DataError(
            f"{at[0]}: row {at[1]}: {column} holds a {type(value).__name__}; "
            "vl_pairs reads texts and image paths (strings), images in image columns (encoded bytes, or a Hugging "
            "Face Image column's {bytes, path}), lists of them and numbers"
        ) from None
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{at[0]}: not readable ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged Parquet file, a decompressor's
        kind = data_suffix(at[0])[1:]
        raise DataError(f"{at[0]}: not a readable {kind} file ({type(e).__name__}: {e})") from None
    return VLFile(image_root or files[0].parent, path, packed, np.frombuffer(negatives, dtype=np.int64), mode)


def _file_rows(
    file: Path,
    each_root: bool,
    mode: str,
    split: str,
    columns: Sequence[str],
    scored: bool,
    at: list[Any],
    store: ImageStore,
    ids: bool,
) -> Iterator[list[Any]]:
    """One file's rows, each its values of `columns` as it is read, `at` the file and the row (from 1); `each_root`:
    image paths made absolute from the file's folder; images held in cells written to `store`, their paths in their
    place; `ids`: rows of document ids (`vl_corpus.by_id`). A DataError naming what is wrong."""
    at[:] = [file, 0]
    need, doc_kind = needed(mode), MODES[mode][1]
    if ids:
        need = [c for c in need if c.startswith("query_")] + [POSITIVE_IDS]
    images = {c for c in columns if c.endswith("_image")} | (
        {NEGATIVES_COLUMN} if doc_kind != "text" and not ids else set()
    )
    root = str(file.parent.absolute())
    seen: set[str] = set()
    _, rows = table_rows(file, (*COLUMNS, NEGATIVES_COLUMN, SCORES_COLUMN), split)
    for n, row in enumerate(rows, 1):
        at[1] = n
        if not isinstance(row, dict):
            raise DataError(f"{file}: row {n}: rows must be JSON objects (or a header line) naming {', '.join(need)}")
        row = from_colpali(from_vlm2vec(row, doc_kind))
        seen.update(row)
        row = by_id(row) if ids else row
        values = [_stored(store, c, row.get(c)) if c in images else row.get(c) for c in columns]
        yield [_rooted(root, c, v) if each_root and c in images else v for c, v in zip(columns, values)]
    if not at[1]:
        raise DataError(f"{file}: no rows; give one row per query-document pair with {', '.join(need)}")
    missing = [c for c in need if c not in seen]
    if missing:
        raise DataError(
            f"{file}: no column {', '.join(missing)}; its retrieval mode, {mode}, needs {', '.join(need)} (image paths "
            "relative to the file's folder)"
        )
    if scored and SCORES_COLUMN not in seen:
        raise DataError(
            f"{file}: loss.distill reads a teacher's scores of each row's documents from a {SCORES_COLUMN} column "
            f"(the document's, then each of {NEGATIVES_COLUMN}'), and it has none; add it, or leave loss.distill "
            "empty"
        )


def with_documents(
    file: VLFile, columns: Sequence[str], corpus: str, store: ImageStore, image_root: Path | None
) -> VLFile:
    """`file`'s rows of document ids (`read_source`'s `ids`) with the documents of the corpus at `corpus` in their place
    (`vl_corpus`); a DataError where it holds none of them."""
    wanted = {i for row in file.rows for c in (POSITIVES_COLUMN, NEGATIVES_COLUMN) for i in row[columns.index(c)]}
    docs = read_corpus(corpus, wanted, store, image_root)
    if not docs:
        example = f" (e.g. {min(wanted)!r})" if wanted else ""
        raise DataError(
            f"data.corpus={corpus}: holds none of the {len(wanted)} documents {file.source}'s rows name{example}; its "
            "ids are read from a docid, _id or id column"
        )
    place = columns.index(POSITIVES_COLUMN)
    counts = np.array([max(1, len(row[place])) for row in file.rows], dtype=np.int64)
    unknown = sum(
        any(i not in docs for c in (place, columns.index(NEGATIVES_COLUMN)) for i in row[c]) for row in file.rows
    )
    logger.info(
        f"data.corpus={corpus}: {len(docs)} of the {len(wanted)} documents {file.source}'s rows name"
        + (f"; {unknown} row(s) name one it does not hold, bad samples when served" if unknown else "")
    )
    rows = PackedRows(resolved_rows(file.rows, columns, docs, file.negative_kind))
    return file._replace(rows=rows, positives=counts)


def _stored(store: ImageStore, column: str, value: Any) -> Any:
    """An image column's value with the images its cells hold written to `store`, their paths in their place."""
    if column != NEGATIVES_COLUMN or not isinstance(value, (list, tuple)):
        return store.path(value)
    return [
        {**v, "image": store.path(v.get("image"))} if isinstance(v, dict) and "image" in v else store.path(v)
        for v in value
    ]


def _rooted(root: str, column: str, value: Any) -> Any:
    """An image column's value with its paths made absolute from the folder `root` (an absolute path stays as it is)."""
    if not value:
        return value
    if column == NEGATIVES_COLUMN:  # image paths, or `{"image", "text"}` objects of image + text documents
        return [
            {**v, "image": _rooted(root, "", v.get("image"))} if isinstance(v, dict) else _rooted(root, "", v)
            for v in as_list(value)
        ]
    return rooted(root, value) if isinstance(value, str) else value
