"""Triplet accuracy as sentence-transformers' TripletEvaluator computes it (its NLI and retrieval training scripts'
dev sets, `sentence-transformers/all-nli`'s triplets): the share of rows whose anchor's cosine with its positive is
above its cosine with its negative (`triplet/cosine_accuracy`). Rows hold `anchor`, `positive` and `negative` texts;
anchors go through the query side, positives and negatives through the document side (the evaluator's
`encode_query` and `encode_document`), each distinct text embedded once per side across the ranks
(`beir_eval.embed_texts`). Used by the trainer (`[eval] triplet_path`) and by `python -m titan_contrastive.evaluate
--triplets`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from titan_contrastive.components.beir_eval import embed_texts
from titan_contrastive.components.evaluate import dim_cuts
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.tables import column_rows

__all__ = ["COLUMNS", "TripletSet", "evaluate_triplets", "load_triplets"]

COLUMNS = ("anchor", "positive", "negative")


@dataclass(frozen=True)
class TripletSet:
    """The distinct anchors and documents, and each row's anchor, positive and negative by index (int64, [n, 3])."""

    anchors: list[str]
    documents: list[str]
    rows: np.ndarray


def load_triplets(path: str, split: str = "test", key: str = "eval.triplet_path") -> TripletSet:
    """The triplets of `path` (.jsonl, .json, .parquet, a saved dataset's `split`); a DataError, one line naming
    `key`, for a missing file, rows without the three columns or with a value that is not a text, or no row."""
    where = f"{key}={path!r}"
    anchors: dict[str, int] = {}
    documents: dict[str, int] = {}
    rows = []
    for n, row in enumerate(column_rows(Path(path).expanduser(), COLUMNS, split, where)):
        if not all(isinstance(row[c], str) for c in COLUMNS):
            raise DataError(f"{where}: row {n} holds {[type(row[c]).__name__ for c in COLUMNS]}; give three texts")
        positive, negative = (documents.setdefault(row[c], len(documents)) for c in COLUMNS[1:])
        rows.append((anchors.setdefault(row["anchor"], len(anchors)), positive, negative))
    if not rows:
        raise DataError(f"{where}: no row; give rows of {', '.join(COLUMNS)}")
    return TripletSet(list(anchors), list(documents), np.array(rows, dtype=np.int64))


def evaluate_triplets(
    task: TripletSet,
    embed_queries: Callable[[list[str]], torch.Tensor],
    embed_docs: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    prefix: str = "triplet/",
) -> dict[str, float]:
    """`{prefix}cosine_accuracy`; with `dims`, also of the embeddings' first m dims (`dim{m}/...`, the evaluator's
    `truncate_dim`)."""
    sizes = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    anchors = embed_texts(embed_queries, task.anchors, **sizes)
    documents = embed_texts(embed_docs, task.documents, **sizes)
    index = torch.as_tensor(task.rows)
    out: dict[str, float] = {}
    for m, cut in dim_cuts(anchors.shape[-1], dims):
        a, d = (F.normalize(x[..., :m].double(), dim=-1) for x in (anchors, documents))
        a = a[index[:, 0]]
        above = (a * d[index[:, 1]]).sum(-1) > (a * d[index[:, 2]]).sum(-1)
        out[f"{cut}{prefix}cosine_accuracy"] = above.double().mean().item()
    return out
