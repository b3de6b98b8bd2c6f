"""The user's text pairs for the bi_encoder family: `(query, positive[, negative, ...])` rows.

Files: `.jsonl` (one JSON object per line, or a JSON list), `.tsv` (tab-separated; a header line
when `data.pairs_columns` names the columns, else none), `.parquet`. Columns: those named by
`data.pairs_columns` (query, positive, then negatives), else the row's columns in order, which
is sentence-transformers' convention (anchor, positive, negatives...).

Why everything is tokenized at load, as for WordNet: a batch is then one gather, and the texts
are small next to images. A row with an empty query or positive is skipped at load, counted
and logged; past `data.max_bad_fraction` of the file the load stops, naming the file and row.
Extra columns are hard negatives, served as `neg` [B, k, doc_length]: every step kind adds them
to the contrastive problem as extra columns (`batching.with_negatives`, `losses`), and the start
log says how many a file has.
"""

from __future__ import annotations

import csv
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.tokenizer import PairTokenizer

logger = logging.getLogger("titan_contrastive")
FORMATS = (".jsonl", ".tsv", ".parquet")


def _rows(file: Path, columns: Sequence[str]) -> list[list[Any]]:
    """Each row's values in column order."""
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
            rows.append(
                [obj.get(c) for c in columns]
                if columns and isinstance(obj, dict)
                else list(obj.values())
                if isinstance(obj, dict)
                else list(obj)
            )
        return rows
    if file.suffix == ".tsv":
        # -sig: a byte-order mark is not part of the first column
        with open(file, newline="", encoding="utf-8-sig") as f:
            lines = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        if not columns:
            return lines
        header = lines[0] if lines else []
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(
                f"{file}: no column {missing[0]!r} in the header ({', '.join(header)}); fix data.pairs_columns"
            )
        return [[line[header.index(c)] if header.index(c) < len(line) else None for c in columns] for line in lines[1:]]
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: Parquet needs pyarrow: pip install -e '.[data]' (or give .jsonl/.tsv)") from None

    table = pq.read_table(file)
    names = list(columns) or table.column_names
    missing = [c for c in names if c not in table.column_names]
    if missing:
        raise DataError(
            f"{file}: no column {missing[0]!r} (columns: {', '.join(table.column_names)}); fix data.pairs_columns"
        )
    data = table.select(names).to_pydict()
    return [list(row) for row in zip(*(data[c] for c in names))]


def read_pairs(path: str, columns: Sequence[str], max_bad_fraction: float) -> tuple[list[list[str]], Counter[str]]:
    """Rows of texts (query, positive, negatives...), each row as long as the first good one."""
    file = Path(path).expanduser()
    if file.suffix not in FORMATS or not file.is_file():
        raise DataError(
            f"data.path={path}: not an existing {'/'.join(FORMATS)} file; give query/positive[/negative] rows in one "
            "of those"
        )
    try:
        raw = _rows(file, columns)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{file}: not readable ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged Parquet file
        raise DataError(f"{file}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    rows, skipped, width = [], Counter(), 0
    for n, row in enumerate(raw):
        texts = [t.strip() if isinstance(t, str) else "" for t in row]
        width = width or len(texts)
        reason = (
            "short_row"
            if len(texts) < 2
            else "ragged_negatives"  # another number of hard negatives than the first good row
            if len(texts) != width
            else "missing_text"
            if not all(texts)
            else ""
        )
        if reason:
            skipped[reason] += 1
            logger.warning(f"{file} row {n + 1}: {reason}; skipped")
            if sum(skipped.values()) > max(1, int(max_bad_fraction * len(raw))):
                raise DataError(
                    f"{file}: {sum(skipped.values())} bad rows of {len(raw)} exceed "
                    f"data.max_bad_fraction={max_bad_fraction} "
                    f"({dict(skipped)}; last: row {n + 1}); fix the file or raise data.max_bad_fraction"
                )
            continue
        rows.append(texts)
    if not rows:
        raise DataError(f"{file}: no usable rows; every row needs a query and a positive")
    return rows, skipped


class PairsDataset:
    """Pre-tokenized rows: batches {query, doc, index[, neg]} (see the module docstring)."""

    def __init__(
        self,
        *,
        split: str,
        path: str,
        tokenizer: PairTokenizer,
        query_length: int,
        columns: Sequence[str] = (),
        max_bad_fraction: float = 0.001,
    ) -> None:
        rows, self.skipped = read_pairs(path, columns, max_bad_fraction)
        self.name, self.split, self.source, self.full = "pairs", split, path, True
        self.image_shape = None
        self.class_names = None
        self.recall_ks = (1, 10)
        self.recall_direction = "query_to_doc"
        self.tokenizer = tokenizer
        self.num_negatives = len(rows[0]) - 2
        self._queries = tokenizer.encode([r[0] for r in rows], query_length)
        self._docs = tokenizer.encode([r[1] for r in rows], tokenizer.doc_length)
        self._negs = (
            tokenizer.encode([t for r in rows for t in r[2:]], tokenizer.doc_length).view(
                len(rows), self.num_negatives, -1
            )
            if self.num_negatives
            else None
        )
        if self.num_negatives and split == "train":
            logger.info(
                f"pairs: {self.num_negatives} hard negative(s) per row in {path}: each query's problem has the "
                f"batch's positives and {self.num_negatives} hard negatives per query as columns"
            )

    def __len__(self) -> int:
        return len(self._queries)

    def set_epoch(self, epoch: int) -> None:
        """No per-sample randomness: the pairs are fixed."""

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        batch = {"query": self._queries[idx], "doc": self._docs[idx], "index": idx}
        if self._negs is not None:
            batch["neg"] = self._negs[idx]
        return batch
