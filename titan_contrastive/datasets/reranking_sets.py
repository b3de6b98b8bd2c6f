"""A reranking set (`[eval] reranking_path`, `components/reranking_eval.py`): rows of a `query` and its own candidates,
its `positive` texts and its `negative` ones (each a list, or one text), as sentence-transformers' RerankingEvaluator
takes its samples and MTEB's reranking tasks hold them (AskUbuntuDupQuestions, SciDocsRR, StackOverflowDupQuestions):
JSON lines, a JSON array, Parquet, or a saved dataset (its `split`). Each distinct text is held once; a row without a
positive or without a negative is left out, as the evaluator leaves it out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.tables import column_rows
from titan_contrastive.datasets.vl_rows import as_list

__all__ = ["COLUMNS", "RerankSet", "read_reranking"]

COLUMNS = ("query", "positive", "negative")


@dataclass(frozen=True)
class RerankSet:
    """The distinct queries and candidate texts, and per row its query's index, its candidates' (int32, the positives
    first) and how many are positives."""

    queries: list[str]
    documents: list[str]
    rows: list[tuple[int, np.ndarray, int]]


def read_reranking(path: str, split: str = "test", key: str = "eval.reranking_path") -> RerankSet:
    """The set in `path`; a DataError, one line naming `key`, for a path that is not such a file, rows without the
    three columns, or no row with a positive and a negative."""
    table = column_rows(Path(path).expanduser(), COLUMNS, split, f"{key}={path!r}")
    queries: dict[str, int] = {}
    documents: dict[str, int] = {}
    rows = []
    for row in table:
        positives, negatives = ([t for t in as_list(row[c]) if isinstance(t, str)] for c in COLUMNS[1:])
        if not (isinstance(row["query"], str) and positives and negatives):
            continue
        own = [documents.setdefault(text, len(documents)) for text in (*positives, *negatives)]
        rows.append((queries.setdefault(row["query"], len(queries)), np.array(own, dtype=np.int32), len(positives)))
    if not rows:
        raise DataError(f"{key}={path!r}: no row with a query, a positive and a negative; give rows of {COLUMNS}")
    return RerankSet(list(queries), list(documents), rows)
