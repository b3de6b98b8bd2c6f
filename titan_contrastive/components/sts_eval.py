"""Semantic textual similarity as embedding users measure it: sentence-transformers' EmbeddingSimilarityEvaluator.

A file of scored sentence pairs (STS-B's layout: `sentence1`, `sentence2`, `score`; or any three columns in
that order) is embedded once across the ranks (`beir_eval.embed_texts`), and the cosine of each pair's two
embeddings is correlated with its score: Pearson's r and Spearman's rho (scipy's, as the evaluator computes
them; the score's scale does not matter). Used by the trainer (`[eval] sts_path`) and by `python -m
titan_contrastive.evaluate --sts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_contrastive.components.beir_eval import embed_texts
from titan_contrastive.components.evaluate import dim_cuts
from titan_contrastive.datasets.base import DataError
from titan_contrastive.datasets.formats import data_suffix, formats_named
from titan_contrastive.datasets.pair_rows import TABLE_FORMATS as FORMATS
from titan_contrastive.datasets.tables import read_table
from titan_contrastive.extras import import_failure

__all__ = ["COLUMNS", "StsSet", "evaluate_sts", "load_sts"]

COLUMNS = ("sentence1", "sentence2", "score")


@dataclass(frozen=True)
class StsSet:
    sentences1: list[str]
    sentences2: list[str]
    scores: list[float]


def load_sts(path: str, split: str = "test") -> StsSet:
    """The scored pairs of `path` (`.jsonl`, `.json`, `.csv`, `.tsv`, `.parquet`, or a saved Hugging Face dataset: its
    `split`); a DataError (one line: the file, the row, the fix) for anything else."""
    file = Path(path).expanduser()
    fix = f"give a {formats_named(FORMATS)} file or a saved dataset of {', '.join(COLUMNS)} rows"
    if not file.exists() or not (file.is_dir() or data_suffix(file) in FORMATS):
        raise DataError(f"eval.sts_path={path!r} is not such a file: {fix}")
    _, rows = read_table(file, COLUMNS, split)  # CSV and TSV with a header line
    pairs: tuple[list[str], list[str], list[float]] = ([], [], [])
    for n, row in enumerate(rows, 1):
        if isinstance(row, dict):  # by name, else the first three in order
            values = [row.get(c) for c in COLUMNS] if set(COLUMNS) <= row.keys() else list(row.values())
        else:
            values = list(row)
        try:
            first, second, score = str(values[0]), str(values[1]), float(values[2])
        except (IndexError, TypeError, ValueError):
            raise DataError(f"{file}: row {n} is not two sentences and a score ({values!r:.80}); {fix}") from None
        if not (first.strip() and second.strip() and math.isfinite(score)):
            raise DataError(f"{file}: row {n} has an empty sentence or a score that is not a number; repair it")
        pairs[0].append(first)
        pairs[1].append(second)
        pairs[2].append(score)
    if len(pairs[0]) < 2:
        raise DataError(f"{file}: {len(pairs[0])} scored pair(s); a correlation needs at least 2")
    return StsSet(*pairs)


@torch.profiler.record_function("evaluate_sts")  # a named span in [profiling] traces
def evaluate_sts(
    sts: StsSet,
    embed: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    prefix: str = "sts/",
    dims: Sequence[int] = (),
) -> dict[str, float]:
    """Pearson and Spearman correlations of the pairs' cosines with their scores (`pearson_cosine`,
    `spearman_cosine`, the evaluator's names), and of their first m dims' cosines for each m of `dims`
    (`evaluate.dim_cuts`); each text embedded once."""
    try:
        from scipy.stats import pearsonr, spearmanr
    except ImportError as e:
        raise ImportError(import_failure(e, "eval.sts_path", "hf")) from None
    common = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    first, second = (embed_texts(embed, texts, **common) for texts in (sts.sentences1, sts.sentences2))
    results = {}
    for m, cut in dim_cuts(first.shape[-1], dims):
        cosines = F.cosine_similarity(first[:, :m].double(), second[:, :m].double()).cpu().numpy()
        results[f"{cut}{prefix}pearson_cosine"] = float(pearsonr(sts.scores, cosines)[0])
        results[f"{cut}{prefix}spearman_cosine"] = float(spearmanr(sts.scores, cosines)[0])
    return results
