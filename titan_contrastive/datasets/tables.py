"""Rows of a table file, as the text-pair readers take them: JSON lines, CSV, TSV (with a header line, or
without one where the columns are named elsewhere), Parquet (pyarrow, the `[data]` extra), and a Hugging
Face `save_to_disk` folder or `.arrow` file (`hf_disk`). Shared by text pairs (`pairs`), query-document rows
with images (`vl_pairs`) and STS evaluation pairs (`components/sts_eval`)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.hf_disk import open_hf_dataset
from titan_contrastive.extras import import_failure

__all__ = ["read_table"]


def read_table(file: Path, columns: Sequence[str], split: str) -> tuple[list[str] | None, list[Any]]:
    """(the column names, or None when rows come unnamed or name their own; the rows: dicts by
    column name, or lists of values). `split`: a saved DatasetDict's split to read."""
    if file.is_dir() or file.suffix == ".arrow":
        ds = open_hf_dataset(str(file), split, kind="pairs", suffixes={".arrow": "arrow"})
        return list(ds.column_names), ds.to_list()
    if file.suffix == ".jsonl":
        rows = []
        # -sig: a byte-order mark is no JSON
        for n, line in enumerate(file.read_text(encoding="utf-8-sig").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{file}:{n}: not a JSON line ({e}); write one JSON object or list per line") from None
            rows.append(obj if isinstance(obj, dict) else list(obj))
        return None, rows
    if file.suffix in (".csv", ".tsv"):
        tsv = file.suffix == ".tsv"
        dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {}
        # -sig: a byte-order mark is not part of the first column
        with open(file, newline="", encoding="utf-8-sig") as f:
            if tsv and not columns:  # a TSV without data.pairs_columns has no header
                return None, list(csv.reader(f, **dialect))
            reader = csv.DictReader(f, **dialect)  # a longer line's extra fields: a list under None
            return list(reader.fieldnames or []), list(reader)
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{import_failure(e, f'{file}: Parquet', 'data')} (or give .jsonl/.csv/.tsv)") from None
    table = pq.read_table(file)
    return list(table.column_names), table.to_pylist()
