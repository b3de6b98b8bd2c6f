"""Pair classification as sentence-transformers' BinaryClassificationEvaluator computes it (MTEB's pair
classification tasks: SprintDuplicateQuestions, TwitterSemEval2015, TwitterURLCorpus; Quora duplicates, NLI
entailment): each pair's cosine, then the best accuracy and the best F1 (with its precision and recall) over the
thresholds between the sorted scores, the average precision of the scores, and the Matthews correlation at the F1's
threshold (`pair_classification/cosine_accuracy`, `..._f1`, `..._ap`, ...). The threshold searches are the
evaluator's own (its static `find_best_acc_and_threshold` and `find_best_f1_and_threshold`), AP and MCC
scikit-learn's. Rows hold `sentence1`, `sentence2` and a 0/1 `label` each, or lists of them (MTEB's one row of
`sentence1`, `sentence2`, `labels`). Both sentences go through the query side (its prompt, as MTEB's instruction),
each distinct one embedded once across the ranks (`beir_eval.embed_texts`). Used by the trainer
(`[eval] pair_classification_path`) and by `python -m titan_contrastive.evaluate --pair-classification`."""

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
from titan_contrastive.datasets.vl_rows import as_list
from titan_contrastive.extras import import_failure

__all__ = ["COLUMNS", "PairSet", "evaluate_pair_classification", "load_pair_classification"]

COLUMNS = ("sentence1", "sentence2")
LABELS = ("label", "labels")
"""A row's labels: `label` (sentence-transformers' pairs) or `labels` (MTEB's rows)."""


@dataclass(frozen=True)
class PairSet:
    """The distinct sentences, and each pair's two indices (int64, [n, 2]) and 0/1 label."""

    sentences: list[str]
    pairs: np.ndarray
    labels: np.ndarray


def load_pair_classification(path: str, split: str = "test", key: str = "eval.pair_classification_path") -> PairSet:
    """The pairs of `path` (.jsonl, .json, .parquet, a saved dataset's `split`); a DataError, one line naming `key`,
    for a missing file, rows without the columns, a label other than 0 or 1, lists of different lengths, or pairs of
    one label only."""
    where = f"{key}={path!r}"
    rows = column_rows(Path(path).expanduser(), COLUMNS, split, where)
    sentences: dict[str, int] = {}
    pairs, labels = [], []
    for n, row in enumerate(rows):
        label = next((row[c] for c in LABELS if c in row), None)
        firsts, seconds, marks = as_list(row["sentence1"]), as_list(row["sentence2"]), as_list(label)
        if not len(firsts) == len(seconds) == len(marks) or not all(m in (0, 1) for m in marks):
            raise DataError(
                f"{where}: row {n} holds {len(firsts)} sentence1, {len(seconds)} sentence2 and labels {marks[:4]}; "
                "give each pair a label of 0 or 1 (column label, or labels)"
            )
        for first, second, mark in zip(firsts, seconds, marks):
            pairs.append([sentences.setdefault(str(t), len(sentences)) for t in (first, second)])
            labels.append(int(mark))
    if len(set(labels)) < 2:
        raise DataError(f"{where}: {len(labels)} pair(s) of label(s) {sorted(set(labels))}; give pairs of both labels")
    return PairSet(list(sentences), np.array(pairs, dtype=np.int64), np.array(labels, dtype=np.int64))


def evaluate_pair_classification(
    task: PairSet,
    embed: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    prefix: str = "pair_classification/",
) -> dict[str, float]:
    """`{prefix}cosine_{accuracy, accuracy_threshold, f1, f1_threshold, precision, recall, ap, mcc}`; with `dims`,
    also of the embeddings' first m dims (`dim{m}/...`, the evaluator's `truncate_dim`)."""
    try:
        from sentence_transformers.sentence_transformer.evaluation import BinaryClassificationEvaluator as Theirs
        from sklearn.metrics import average_precision_score, matthews_corrcoef
    except ImportError as e:
        raise ImportError(import_failure(e, "eval.pair_classification_path", "hf")) from None

    embeddings = embed_texts(embed, task.sentences, batch_size=batch_size, rank=rank, world_size=world_size)
    first, second, labels = torch.as_tensor(task.pairs[:, 0]), torch.as_tensor(task.pairs[:, 1]), task.labels
    out: dict[str, float] = {}
    for m, cut in dim_cuts(embeddings.shape[-1], dims):
        unit = F.normalize(embeddings[..., :m].double(), dim=-1)
        scores = (unit[first] * unit[second]).sum(-1).numpy()
        accuracy, accuracy_threshold = Theirs.find_best_acc_and_threshold(scores, labels, True)
        f1, precision, recall, f1_threshold = Theirs.find_best_f1_and_threshold(scores, labels, True)
        figures = {
            "accuracy": accuracy,
            "accuracy_threshold": accuracy_threshold,
            "f1": f1,
            "f1_threshold": f1_threshold,
            "precision": precision,
            "recall": recall,
            "ap": average_precision_score(labels, scores),
            "mcc": matthews_corrcoef(labels, scores >= f1_threshold),
        }
        out |= {f"{cut}{prefix}cosine_{name}": float(value) for name, value in figures.items()}
    return out
