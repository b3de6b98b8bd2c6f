"""Rows of a table file, as the text-pair readers take them: JSON lines, JSON (one array of rows, or JSON lines), CSV,
TSV (with a header line, or without one where the columns are named elsewhere), plain text (a text a line, the column
`text`, as Hugging Face datasets' text builder names it), the five compressed too (`formats`),
Parquet (pyarrow, the `[data]` extra), and a Hugging Face `save_to_disk` folder or `.arrow` file (`hf_disk`). Shared
by text pairs (`pairs`), query-document rows with images (`vl_pairs`) and STS evaluation pairs
(`components/sts_eval`)."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, open_text
from titan_contrastive.datasets.hf_disk import open_hf_dataset
from titan_contrastive.extras import import_failure

__all__ = ["TEXT_COLUMN", "Rows", "arrow_batches", "guarded_rows", "opened_rows", "read_table", "table_rows"]

TEXT_COLUMN = "text"
"""A `.txt` file's one column."""

JSON_CHUNK = 1 << 20
"""Characters a JSON array's file is read by (`_array_rows`)."""
_SPACE = re.compile(r"[ \t\n\r]*")
"""JSON's white space."""

BATCH = 4096
"""Rows an Arrow table (Parquet, a saved dataset) is read by at a time."""

STREAM_BYTES = 1 << 20
"""Bytes a Parquet column chunk is read by (pyarrow's `buffer_size`, without `pre_buffer`): a row group of a million
passages is decoded a batch at a time, not read whole first."""


class Rows(Iterator[Any]):
    """A table's rows one at a time, and how many there are where the file says so without being read (`length`:
    Parquet's footer, an Arrow dataset; None for JSON, CSV and TSV)."""

    def __init__(self, rows: Iterator[Any], length: int | None = None) -> None:
        self._rows, self.length = rows, length

    def __next__(self) -> Any:
        return next(self._rows)


def read_table(file: Path, columns: Sequence[str], split: str) -> tuple[list[str] | None, list[Any]]:
    """(the column names, or None when rows come unnamed or name their own; the rows: dicts by
    column name, or lists of values). `split`: a saved DatasetDict's split to read. A damaged file: a DataError."""
    names, rows = opened_rows(file, columns, split)
    return names, list(guarded_rows(file, rows))


def column_rows(file: Path, columns: Sequence[str], split: str, where: str) -> list[dict[str, Any]]:
    """`read_table`'s rows, each a dict holding `columns` (an evaluation set's rows); a DataError, one line beginning
    with `where` (the setting and the path), for a file that is not there or a row without the columns."""
    if not file.exists():
        raise DataError(f"{where} does not exist; give a .jsonl, .json or .parquet file of {', '.join(columns)}")
    rows = read_table(file, columns, split)[1]
    for n, row in enumerate(rows):
        missing = [c for c in columns if not isinstance(row, dict) or c not in row]
        if missing:
            raise DataError(f"{where}: row {n} has no column {', '.join(missing)}; its rows hold {', '.join(columns)}")
    return rows


def table_rows(file: Path, columns: Sequence[str], split: str) -> tuple[list[str] | None, Rows]:
    """`read_table`'s column names and its rows one at a time, read from the file as they are iterated: a reader that
    keeps what it needs of each row never holds the whole file. A damaged file's error comes from the iteration."""
    kind = data_suffix(file)
    if kind in (".jsonl", ".json") and not file.is_dir():
        return None, Rows(_json_rows(file))
    if kind in (".csv", ".tsv") and not file.is_dir():
        rows = _csv_rows(file, named=kind == ".csv" or bool(columns))
        return next(rows), Rows(rows)
    if kind == ".txt" and not file.is_dir():
        return [TEXT_COLUMN], Rows(_text_lines(file))
    names, batches, length = arrow_batches(file, split)
    return names, Rows(_batched(batches), length)


def arrow_batches(file: Path, split: str) -> tuple[list[str], Iterator[Any], int]:
    """(the column names, the Arrow record batches or tables of `BATCH` rows, how many rows) of a Parquet file or a
    saved dataset (`table_rows`'s other formats), read as they are iterated: for a reader that selects rows by a
    column before any row is made Python objects."""
    if file.is_dir() or file.suffix == ".arrow":
        ds = open_hf_dataset(str(file), split, kind="pairs", suffixes={".arrow": "arrow"})
        return list(ds.column_names), ds.with_format("arrow").iter(batch_size=BATCH), len(ds)
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{import_failure(e, f'{file}: Parquet', 'data')} (or give .jsonl/.csv/.tsv)") from None
    table = pq.ParquetFile(file, buffer_size=STREAM_BYTES, pre_buffer=False)
    return list(table.schema_arrow.names), table.iter_batches(batch_size=BATCH), table.metadata.num_rows


def _json_rows(file: Path) -> Iterator[Any]:
    """A JSON lines file's rows, or a `.json` file's: one JSON array of rows (objects or lists), read an element at a
    time (`_array_rows`), or else JSON lines."""
    if data_suffix(file) == ".json" and _is_array(file):
        yield from _array_rows(file)
    else:
        yield from _json_lines(file)


def _is_array(file: Path) -> bool:
    """Whether the `.json` file holds one JSON array: its first character other than white space is `[`, and its first
    line is not a whole JSON value followed by more (JSON lines of lists, `["a query", "its document"]` a line, are
    JSON lines)."""
    with open_text(file) as f:
        first = next((line for line in f if line.strip()), "")
        if not first.lstrip().startswith("["):
            return False
        try:
            json.loads(first)
        except ValueError:
            return True  # an array over several lines
        return next((line for line in f if line.strip()), None) is None


def _array_rows(file: Path) -> Iterator[Any]:
    """The elements of the JSON array in `file`, each decoded as its text is read (`json.JSONDecoder.raw_decode` over
    a window of the file, grown only while an element does not fit in it): the array is never held whole."""
    decoder = json.JSONDecoder()
    with open_text(file) as f:
        text, at, done, n, value = "", 0, False, 0, True  # value: a row (or the end) comes next, not a comma

        def fill() -> None:  # the window from `at` on, and as much again of the file (at least JSON_CHUNK)
            nonlocal text, at, done
            chunk = f.read(max(JSON_CHUNK, len(text) - at))
            text, at, done = text[at:] + chunk, 0, not chunk

        fill()
        while _SPACE.match(text, at).end() == len(text) and not done:  # to the [ (`_is_array`)
            at = len(text)
            fill()
        at = _SPACE.match(text, at).end() + 1
        while True:
            at = _SPACE.match(text, at).end()
            if at == len(text):
                if done:
                    raise _bad_array(file, "it ends before its closing ]")
                fill()
                continue
            if text[at] == "]" and (not value or not n):
                if (text[at + 1 :] + f.read()).strip():
                    raise _bad_array(file, "more follows its closing ]")
                return
            if not value:
                if text[at] != ",":
                    raise _bad_array(file, f"row {n} is followed by {text[at]!r}, not a comma")
                at, value = at + 1, True
                continue
            try:
                obj, end = decoder.raw_decode(text, at)
            except ValueError as e:
                if done:
                    raise _bad_array(file, f"row {n + 1}: {e.msg}") from None
                fill()  # the row goes on past the window
                continue
            n, at, value = n + 1, end, False
            if not isinstance(obj, (dict, list)):
                raise DataError(
                    f"{file}: row {n} of its JSON array is a {type(obj).__name__}; write each row as an object"
                )
            yield obj


def _bad_array(file: Path, why: str) -> DataError:
    return DataError(
        f"{file}: neither one JSON array of rows nor JSON lines ({why}); write a JSON array of objects, or one object "
        "per line"
    )


def _json_lines(file: Path) -> Iterator[Any]:
    """A JSON lines file's rows: each line's object (a dict) or list. Lines end at a line break only (a JSON string may
    hold U+2028 or U+0085 as it is)."""
    array = " or one JSON array of them" if data_suffix(file) == ".json" else ""
    with open_text(file) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{file}:{n}: not a JSON line ({e}); write one JSON object or list per line{array}"
                ) from None
            yield obj if isinstance(obj, dict) else list(obj)


def _csv_rows(file: Path, named: bool) -> Iterator[Any]:
    """The header's column names (None when not `named`: a TSV without data.pairs_columns has no header), then the
    rows: dicts by column name (a longer line's extra fields: a list under None), or lists of values."""
    tsv = data_suffix(file) == ".tsv"
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {}
    with open_text(file, newline="") as f:
        if not named:
            yield None
            yield from csv.reader(f, **dialect)
            return
        reader = csv.DictReader(f, **dialect)
        yield list(reader.fieldnames or [])
        yield from reader


def _text_lines(file: Path) -> Iterator[dict[str, str]]:
    """A `.txt` file's rows: each line that is not blank, without its line break (SimCSE's `wiki1m_for_simcse.txt`)."""
    with open_text(file) as f:
        for line in f:
            if line.strip():
                yield {TEXT_COLUMN: line.rstrip("\n")}


def _batched(batches: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """The rows of Arrow record batches or tables, as dicts by column name; once read, Arrow's allocator hands back
    the memory the batches took (it keeps freed memory for reuse)."""
    import pyarrow

    for batch in batches:
        yield from batch.to_pylist()
    pyarrow.default_memory_pool().release_unused()


def opened_rows(file: Path, columns: Sequence[str], split: str) -> tuple[list[str] | None, Rows]:
    """`table_rows`, an error of opening the file a DataError naming it."""
    try:
        return table_rows(file, columns, split)
    except Exception as e:  # noqa: BLE001 - mapped as `guarded_rows` maps them
        raise _unreadable(file, e) from None


def guarded_rows(file: Path, rows: Iterator[Any]) -> Iterator[Any]:
    """`rows`, an error of reading them (a damaged file) a DataError naming the file."""
    try:
        yield from rows
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged Parquet file, a JSON line of no row
        raise _unreadable(file, e) from None


def _unreadable(file: Path, e: Exception) -> DataError:
    if isinstance(e, DataError):
        return e
    if isinstance(e, (OSError, UnicodeDecodeError, csv.Error)):
        return DataError(f"{file}: not readable ({type(e).__name__}: {e})")
    return DataError(f"{file}: not a readable {data_suffix(file)[1:]} file ({type(e).__name__}: {e})")
