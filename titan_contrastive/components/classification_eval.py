"""Classification as MTEB measures it (its classification tasks: Banking77Classification, EmotionClassification,
AmazonCounterfactualClassification, ...; `AbsTaskClassification` of mteb 2): a set holds `text` and `label` rows in a
train and a test split; in each of 10 experiments the train rows' order is shuffled again (by a generator seeded
anew with 42, as MTEB's undersampling) and the first `per_label` rows of each label kept, scikit-learn's
LogisticRegression (100 iterations, seeded) is fit on their embeddings and predicts the test rows' labels: accuracy,
F1, precision and recall (macro and weighted) and, where the test rows hold two labels, the average precision of the
predictions (macro and weighted), each the mean over the experiments (`classification/accuracy`, ...). Every
distinct text is embedded once across the ranks (`beir_eval.embed_texts`), through the query side (its prompt, as
MTEB's instruction). Used by the trainer (`[eval] classification_path`) and by `python -m titan_contrastive.evaluate
--classification`."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from titan_contrastive.components.beir_eval import embed_texts
from titan_contrastive.components.evaluate import dim_cuts
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix
from titan_contrastive.datasets.tables import column_rows

__all__ = ["COLUMNS", "ClassificationSet", "evaluate_classification", "load_classification"]

COLUMNS = ("text", "label")
TRAIN = "train"
"""The split the classifier is fit on (MTEB's `train_split`)."""
EXPERIMENTS = 10
"""MTEB's `n_experiments`."""
SEED = 42
"""MTEB's seed: of the undersampling's shuffles and of the classifier."""
MAX_ITER = 100
"""LogisticRegression's iterations (MTEB's `max_iter`)."""
TABLES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
"""The files a folder's split may be."""


@dataclass(frozen=True)
class ClassificationSet:
    """The distinct texts; the train and the test rows' text indices (int64) and label indices (the labels sorted,
    numbers by value: 0/1 labels stay 0/1, the second the positive class of a two-label set's AP, as in MTEB)."""

    texts: list[str]
    train: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]


def split_table(folder: Path, split: str, key: str) -> Path:
    """The table of `split` in `folder`: the folder itself where it is a saved DatasetDict (read by split), else its
    file named `{split}.<a table suffix>` (`.jsonl`, `.json`, `.csv`, `.tsv`, `.parquet`, compressed too)."""
    if not folder.is_dir():
        raise DataError(
            f"{key}={str(folder)!r} is not a folder; give a folder of train and test tables (train.jsonl, test.jsonl, "
            ".csv or .parquet) or a saved DatasetDict"
        )
    if (folder / "dataset_dict.json").is_file():
        return folder
    tables = sorted(
        p for p in folder.iterdir() if p.is_file() and p.name.split(".")[0] == split and data_suffix(p) in TABLES
    )
    if not tables:
        raise DataError(
            f"{key}={str(folder)!r} holds no {split} table; give {split}.jsonl (or .json, .csv, .parquet) beside the "
            "other split's, or a saved DatasetDict"
        )
    return tables[0]


def load_classification(path: str, split: str = "test", key: str = "eval.classification_path") -> ClassificationSet:
    """The set in the folder `path` (its `train` split and `split`; `split_table`); a DataError, one line naming `key`,
    for a missing split, rows without the two columns or whose text is not one, or a train split of one label."""
    folder, texts, labels = Path(path).expanduser(), {}, {}
    rows = {}
    for name in (TRAIN, split):
        table = split_table(folder, name, key)
        rows[name] = column_rows(table, COLUMNS, name, f"{key}={path!r} ({name})")
        for n, row in enumerate(rows[name]):
            if not isinstance(row["text"], str) or not isinstance(row["label"], int | float | str):
                raise DataError(
                    f"{key}={path!r} ({name}): row {n} holds no text and label; give a text and its label (a number "
                    "or a string)"
                )
            texts.setdefault(row["text"], len(texts))
            labels.setdefault(row["label"], None)
    if len({row["label"] for row in rows[TRAIN]}) < 2 or not rows[split]:
        raise DataError(
            f"{key}={path!r}: its {TRAIN} rows hold fewer than two labels or its {split} rows none; give both splits, "
            "the train rows of two labels or more"
        )
    numbers = all(isinstance(label, int | float) and not isinstance(label, bool) for label in labels)
    index = {label: i for i, label in enumerate(sorted(labels, key=None if numbers else str))}

    def arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
        own = np.array([texts[row["text"]] for row in rows[name]], dtype=np.int64)
        return own, np.array([index[row["label"]] for row in rows[name]], dtype=np.int64)

    return ClassificationSet(list(texts), arrays(TRAIN), arrays(split))


def undersampled(labels: np.ndarray, per_label: int) -> list[np.ndarray]:
    """Each experiment's train rows: MTEB's undersampling, one order shuffled again by each experiment (by a
    generator seeded anew with SEED each time), then the first `per_label` rows of each label in that order."""
    order, picks = np.arange(len(labels)), []
    for _ in range(EXPERIMENTS):
        np.random.RandomState(SEED).shuffle(order)
        counts: Counter[int] = Counter()
        pick = []
        for i in order:
            if counts[labels[i]] < per_label:
                pick.append(i)
                counts[labels[i]] += 1
        picks.append(np.array(pick, dtype=np.int64))
    return picks


def evaluate_classification(
    task: ClassificationSet,
    embed: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    per_label: int = 8,
    prefix: str = "classification/",
) -> dict[str, float]:
    """`{prefix}accuracy`, `f1`, `f1_weighted`, `precision`, `precision_weighted`, `recall`, `recall_weighted` (and
    `ap`, `ap_weighted` with two test labels), the means over the experiments; with `dims`, also of the embeddings'
    first m dims normalized again (`dim{m}/...`)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    embedded = embed_texts(embed, task.texts, batch_size=batch_size, rank=rank, world_size=world_size)
    (train, y_train), (test, y_test) = task.train, task.test
    picks = undersampled(y_train, per_label)
    out = {}
    for m, cut in dim_cuts(embedded.shape[-1], dims):
        vectors = (F.normalize(embedded[..., :m], dim=-1) if cut else embedded).double().numpy()
        scores: dict[str, list[float]] = {}
        for pick in picks:
            classifier = LogisticRegression(random_state=SEED, max_iter=MAX_ITER)
            with warnings.catch_warnings():  # MTEB's 100 iterations are the measure, converged or not
                warnings.simplefilter("ignore", ConvergenceWarning)
                classifier.fit(vectors[train[pick]], y_train[pick])
            for name, value in label_scores(y_test, classifier.predict(vectors[test])).items():
                scores.setdefault(name, []).append(value)
        out |= {f"{cut}{prefix}{name}": float(np.mean(values)) for name, values in scores.items()}
    return out


def label_scores(truth: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """One experiment's scores of the predicted labels, MTEB's `_calculate_scores` (AP where `truth` holds two)."""
    from sklearn.metrics import accuracy_score, average_precision_score, f1_score, precision_score, recall_score

    scores = {"accuracy": accuracy_score(truth, predicted)}
    for name, score in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
        scores[name] = score(truth, predicted, average="macro")
        scores[f"{name}_weighted"] = score(truth, predicted, average="weighted")
    if len(np.unique(truth)) == 2:
        scores["ap"] = average_precision_score(truth, predicted, average="macro")
        scores["ap_weighted"] = average_precision_score(truth, predicted, average="weighted")
    return {name: float(value) for name, value in scores.items()}
