"""Clustering as MTEB measures it (mteb 2's `AbsTaskClusteringLegacy` and its ClusteringEvaluator): each row of a
clustering set holds `sentences` and their `labels` (MTEB's clustering tasks: ArxivClusteringS2S, RedditClustering,
TwentyNewsgroupsClustering, ...); a row's embeddings are clustered by scikit-learn's MiniBatchKMeans into as many
clusters as it has labels (batches of 500, seeded with 42, as mteb), and the V-measure of the clusters against the
labels is averaged over the rows, a row of one label counting 1.0 unclustered, as mteb counts it
(`clustering/v_measure`). Every distinct sentence is embedded once across the ranks
(`beir_eval.embed_texts`), through the query side (its prompt, as MTEB's instruction). Used by the trainer
(`[eval] clustering_path`) and by `python -m titan_contrastive.evaluate --clustering`."""

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

__all__ = ["COLUMNS", "ClusteringSet", "evaluate_clustering", "load_clustering"]

COLUMNS = ("sentences", "labels")
BATCH = 500
"""MiniBatchKMeans' batch size (MTEB's `clustering_batch_size`)."""
SEED = 42
"""mteb's evaluators' seed."""


@dataclass(frozen=True)
class ClusteringSet:
    """The distinct sentences, and per row its sentences' indices (int32) and their labels (a row of one label: no
    indices, its V-measure 1.0)."""

    sentences: list[str]
    rows: list[tuple[np.ndarray, list[str]]]


def load_clustering(path: str, split: str = "test", key: str = "eval.clustering_path") -> ClusteringSet:
    """The set in `path` (.jsonl, .json, .parquet, a saved dataset's `split`); a DataError, one line naming `key`, for
    a missing file, rows without the two columns or with lists of different lengths, or no row of two labels."""
    table = column_rows(Path(path).expanduser(), COLUMNS, split, f"{key}={path!r}")
    sentences: dict[str, int] = {}
    rows = []
    for n, row in enumerate(table):
        texts, labels = list(row["sentences"]), [str(label) for label in row["labels"]]
        if len(texts) != len(labels) or not all(isinstance(t, str) for t in texts):
            raise DataError(
                f"{key}={path!r}: row {n} holds {len(texts)} sentence(s) and {len(labels)} label(s); give a text and a "
                "label for each"
            )
        if len(set(labels)) > 1:
            own = [sentences.setdefault(text, len(sentences)) for text in texts]
            rows.append((np.array(own, dtype=np.int32), labels))
        else:  # one cluster: mteb counts 1.0 and embeds nothing
            rows.append((np.zeros(0, dtype=np.int32), labels))
    if not sentences:
        raise DataError(f"{key}={path!r}: no row with two labels or more; give rows of sentences of several labels")
    return ClusteringSet(list(sentences), rows)


def evaluate_clustering(
    task: ClusteringSet,
    embed: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    prefix: str = "clustering/",
) -> dict[str, float]:
    """`{prefix}v_measure`, the mean over the rows; with `dims`, also of the embeddings' first m dims normalized
    again (`dim{m}/...`)."""
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import v_measure_score

    embedded = embed_texts(embed, task.sentences, batch_size=batch_size, rank=rank, world_size=world_size)
    out = {}
    for m, cut in dim_cuts(embedded.shape[-1], dims):
        vectors = F.normalize(embedded[..., :m], dim=-1) if cut else embedded
        vectors = vectors.to(torch.float64 if vectors.dtype == torch.float64 else torch.float32).numpy()  # as given
        scores = []
        for own, labels in task.rows:
            if not len(own):
                scores.append(1.0)
                continue
            kmeans = MiniBatchKMeans(n_clusters=len(set(labels)), batch_size=BATCH, n_init="auto", random_state=SEED)
            scores.append(v_measure_score(labels, kmeans.fit(vectors[own]).labels_))
        out[f"{cut}{prefix}v_measure"] = float(np.mean(scores))
    return out
