"""Documents by id: the file of `data.corpus`, whose rows give the texts that text pairs of document ids name
(tevatron's `positive_document_ids` and `negative_document_ids` into its corpus; `pair_rows`, `by_id`).

A corpus row is a document's id and its text: by column, the id in `docid` (tevatron), `_id` (BEIR) or `id`
(Pyserini), the text in `text` or `contents` (Pyserini), a `title` read before the text with a space between, as a
tevatron passage is; unnamed, a row (a TSV without a header, a JSON list) is `id, text` (MS MARCO's collection.tsv)
or `id, title, text`. The formats and shards are the text pairs' but `.txt` (`pair_rows.TABLE_FORMATS`; a pattern or a
folder of files is one corpus).

The corpus is read a row at a time and only the documents that the rows name are kept, each text held once with
the rows' own: a corpus of millions of passages costs the memory of those the training rows use. A Parquet or Arrow
corpus, and one of JSON lines from `ARROW_JSON_BYTES`, is matched by its id column in Arrow a batch at a time, and
only the rows named become Python objects. A row that names a document the corpus does not hold (or holds empty) is a
bad row, `unknown_document`, skipped and counted against data.max_bad_fraction.
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import lzma
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.bad_samples import too_many_bad
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, formats_named, open_text
from titan_contrastive.datasets.pair_rows import TABLE_FORMATS as FORMATS
from titan_contrastive.datasets.pair_rows import PairRows, cell_text, doc_id, kept_rows
from titan_contrastive.datasets.shards import shard_files
from titan_contrastive.datasets.tables import STREAM_BYTES, arrow_batches, guarded_rows, opened_rows

__all__ = [
    "ID_COLUMNS",
    "TEXT_COLUMNS",
    "corpus_files",
    "corpus_texts",
    "numbered_rows",
    "resolve_documents",
    "resolved",
]

logger = logging.getLogger("titan_contrastive")

ID_COLUMNS = ("docid", "_id", "id")
TEXT_COLUMNS = ("text", "contents")
ARROW_JSON_BYTES = 32 << 20
"""The size from which a JSON lines corpus is read by Arrow (`numbered_rows`): below it, a line at a time is as fast
and spares the process pyarrow's libraries (~55 MiB)."""


def resolve_documents(
    files: Sequence[PairRows], parts: Sequence[str], corpus: str, seen: dict[str, str], max_bad_fraction: float
) -> list[PairRows]:
    """`files` (the rows of the sources `parts`, read `by_id`) with each document id replaced by its text in the
    corpus at `corpus`; rows naming a document it does not hold skipped (see the module docstring)."""
    wanted = {doc for rows in files for row in rows.texts for doc in row[1:]}
    texts = corpus_texts(corpus, wanted, seen, "data.corpus")
    if not texts:
        raise DataError(
            f"data.corpus={corpus}: holds none of the {len(wanted)} documents the rows name (e.g. "
            f"{min(wanted)!r}); its ids are read from a {'/'.join(ID_COLUMNS)} column, or an unnamed row's first field"
        )
    logger.info(f"data.corpus={corpus}: {len(texts)} of the {len(wanted)} documents the rows name")
    return [resolved(rows, part, f"data.corpus={corpus}", texts, max_bad_fraction) for rows, part in zip(files, parts)]


def resolved(rows: PairRows, source: str, corpus: str, texts: dict[str, str], max_bad_fraction: float) -> PairRows:
    """One source's rows with their documents' texts (`texts`: {id: text} of the corpus `corpus`, the words naming it
    in an error); a DataError past `max_bad_fraction` of its rows unresolved."""
    keep = [i for i, row in enumerate(rows.texts) if all(d in texts for d in row[1:])]
    out = rows._replace(texts=[[row[0], *(texts.get(d, "") for d in row[1:])] for row in rows.texts])
    unknown = len(rows.texts) - len(keep)
    if not unknown:
        return out
    example = next(d for row in rows.texts for d in row[1:] if d not in texts)
    skipped = rows.skipped + Counter(unknown_document=unknown)
    if too_many_bad(skipped, len(rows.texts) + sum(rows.skipped.values()), max_bad_fraction):
        raise DataError(
            f"{source}: {unknown} of its {len(rows.texts)} rows name a document that {corpus} does not "
            f"hold (e.g. {example!r}; bad rows {dict(skipped)} exceed data.max_bad_fraction={max_bad_fraction}); "
            "give the corpus of these rows, or raise data.max_bad_fraction"
        )
    logger.warning(f"{source}: {unknown} row(s) name a document not in {corpus} (e.g. {example!r}); skipped")
    return kept_rows(out, keep, skipped)


def corpus_texts(path: str, wanted: set[str] | None, seen: dict[str, str], field: str) -> dict[str, str]:
    """{id: text} of the `wanted` documents (None: every one) of the corpus at `path`, each text interned in `seen`;
    a DataError naming `field` (the option that gave `path`) for a corpus that cannot be read or whose rows hold no
    id and text, or one id given two texts."""
    texts: dict[str, str] = {}
    for file in corpus_files(path, field):
        for n, row in guarded_rows(file, numbered_rows(file, wanted)):
            ident, cells = _document(file, n, row, field)
            text = cell_text(cells) if wanted is None or ident in wanted else ""
            if not text:
                continue
            if texts.setdefault(ident, seen.setdefault(text, text)) != text:
                raise DataError(
                    f"{field}={path}: document {ident!r} is given two texts ({file} row {n + 1} differs from an "
                    "earlier row); give each document one id"
                )
    return texts


def corpus_files(path: str, field: str, what: str = "an id and a text") -> list[Path]:
    """The files of the corpus at `path` (a file, a saved dataset, or the shards a pattern or folder names); a DataError
    naming `field` for a path that is none of them (`what`: what its rows hold, for the message)."""
    files = shard_files(path, FORMATS, field=field)
    if files is not None:
        return files
    file = Path(path).expanduser()
    if not (file.is_dir() or (data_suffix(file) in FORMATS and file.is_file())):
        raise DataError(
            f"{field}={path}: not an existing {formats_named(FORMATS)} file or save_to_disk folder; give the "
            f"documents' rows ({what} each) in one of those"
        )
    return [file]


def numbered_rows(
    file: Path, wanted: set[str] | None, bodies: Sequence[str] = TEXT_COLUMNS
) -> Iterator[tuple[int, Any]]:
    """(row number from 0, row) of the corpus file `file`: every row, or of a Parquet file, saved dataset or JSON lines
    (of `ARROW_JSON_BYTES` or more) with an id and a content column (one of `bodies`), the rows whose id may be
    `wanted`, chosen by Arrow (`pyarrow.compute`) before any row is made Python objects (a corpus of millions read for
    the thousands the rows name); the others `corpus_texts` skips. JSON lines that Arrow does not read as one table
    (an id of two types, a row without the first row's id column, an unnamed row, no pyarrow) are read again a line at
    a time, as every corpus was: the rows given twice are the same documents."""
    if wanted is not None and (file.is_dir() or file.suffix in (".parquet", ".arrow")):
        names, batches, _ = arrow_batches(file, "train")
        ident = next((c for c in ID_COLUMNS if c in names), None)
        if ident is not None and set(bodies) & set(names):
            yield from _wanted_rows(batches, ident, wanted)
            return
    if wanted is not None and data_suffix(file) in (".jsonl", ".json") and file.stat().st_size >= ARROW_JSON_BYTES:
        try:
            yield from _wanted_rows(*_json_batches(file), wanted, whole=True)
            return
        except _NotOneTable:
            pass
    _, rows = opened_rows(file, (), "train")
    yield from enumerate(rows)


class _NotOneTable(Exception):
    """JSON lines that Arrow does not read as a table of the first row's columns (`numbered_rows`)."""


def _json_batches(file: Path) -> tuple[Iterator[Any], str]:
    """(Arrow record batches of the JSON lines `file`, read `tables.STREAM_BYTES` at a time on one thread, the id column
    its first row names); `_NotOneTable` where its first row names no id and text, or where pyarrow or its streaming
    JSON reader is not installed."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        raise _NotOneTable from None
    with open_text(file) as f:
        line = next((line for line in f if line.strip()), "null")
    if line.lstrip().startswith("["):  # lists, or one JSON array: `tables` reads them
        raise _NotOneTable
    try:
        first = json.loads(line)
    except ValueError:  # the line-at-a-time read names it
        raise _NotOneTable from None
    ident = next((c for c in ID_COLUMNS if c in first), None) if isinstance(first, dict) else None
    if ident is None or not set(TEXT_COLUMNS) & set(first) or not hasattr(pj, "open_json"):  # an older pyarrow
        raise _NotOneTable
    try:
        source = lzma.open(file) if file.suffix == ".xz" else file  # pyarrow decompresses the others by their suffix
        reader = pj.open_json(source, read_options=pj.ReadOptions(use_threads=False, block_size=STREAM_BYTES))
    except pa.ArrowException:
        raise _NotOneTable from None

    def batches() -> Iterator[Any]:
        try:
            yield from reader
        except pa.ArrowException:  # a later block's id of another type, a field it did not have
            raise _NotOneTable from None

    return batches(), ident


def _wanted_rows(
    batches: Iterator[Any], ident: str, wanted: set[str], whole: bool = False
) -> Iterator[tuple[int, Any]]:
    """The numbered rows of Arrow `batches` whose `ident` column is in `wanted`: ids as `pair_rows.doc_id` reads them,
    texts or integers (of another type, no id: none of the batch's rows). `whole`: every row has that id and it is
    the first of `ID_COLUMNS` the batch has, and each wanted row its texts, as a row read alone would be read, else
    `_NotOneTable`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys, start = _large_strings(sorted(wanted)), 0
    for batch in batches:
        ids = batch.column(ident)
        names = batch.schema.names
        if whole and (ids.null_count or next(c for c in ID_COLUMNS if c in names) != ident):
            raise _NotOneTable
        ids = pc.cast(ids, ids.type.value_type) if pa.types.is_dictionary(ids.type) else ids
        if pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
            mask = pc.is_in(pc.utf8_trim_whitespace(pc.cast(ids, pa.large_string())), value_set=keys)
            kept = batch.filter(mask)
            if whole and any(kept.column(c).null_count for c in TEXT_COLUMNS if c in names):
                raise _NotOneTable  # a missing text and one given as null are two rows to a line's reader
            yield from zip((start + i for i in pc.indices_nonzero(mask).to_pylist()), kept.to_pylist())
        start += batch.num_rows
    pa.default_memory_pool().release_unused()


def _large_strings(values: list[str]) -> Any:
    """`values` as an Arrow array of large strings, made from its buffers: `pyarrow.array` of a Python list imports
    pandas (where installed) on its first call, a module this reader has no use for."""
    import pyarrow as pa

    encoded = [v.encode() for v in values]
    offsets = array.array("q", itertools.accumulate(map(len, encoded), initial=0))
    return pa.Array.from_buffers(
        pa.large_string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def _document(file: Path, n: int, row: Any, field: str) -> tuple[str, dict[str, Any]]:
    """(a corpus row's id, its title and text cells, joined by `pair_rows.cell_text`)."""
    if isinstance(row, dict):
        ident = next((c for c in ID_COLUMNS if c in row), None)
        body = next((c for c in TEXT_COLUMNS if c in row), None)
        if ident is None or body is None:
            raise DataError(
                f"{file} row {n + 1}: a corpus row holds an id ({'/'.join(ID_COLUMNS)}) and a text "
                f"({'/'.join(TEXT_COLUMNS)}); its columns are {', '.join(map(str, row))}: fix {field}"
            )
        return doc_id(row[ident]), {"title": row.get("title"), "text": row[body]}
    if len(row) not in (2, 3):
        raise DataError(
            f"{file} row {n + 1}: an unnamed corpus row is id, text or id, title, text, and this one has "
            f"{len(row)} fields: fix {field}"
        )
    return doc_id(row[0]), {"title": row[1] if len(row) == 3 else None, "text": row[-1]}
