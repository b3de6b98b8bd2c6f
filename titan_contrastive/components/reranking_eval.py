"""Reranking evaluation as sentence-transformers' RerankingEvaluator computes it: each query against its own
candidates (`datasets/reranking_sets.py`) by the cosine of their embeddings, the positives relevant: mean average
precision (scikit-learn's `average_precision_score`), MRR@k and nDCG@k (its `ndcg_score`), over the rows. Each
distinct query and candidate is embedded once across the ranks (`beir_eval.embed_texts`), queries through the query
side and candidates through the document side. Used by the trainer (`[eval] reranking_path`) and by
`python -m titan_contrastive.evaluate --reranking`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from titan_contrastive.components.beir_eval import embed_texts
from titan_contrastive.components.evaluate import dim_cuts
from titan_contrastive.datasets.reranking_sets import RerankSet

__all__ = ["evaluate_reranking"]


def evaluate_reranking(
    task: RerankSet,
    embed_queries: Callable[[list[str]], torch.Tensor],
    embed_docs: Callable[[list[str]], torch.Tensor],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    dims: Sequence[int] = (),
    at_k: int = 10,
    prefix: str = "reranking/",
) -> dict[str, float]:
    """`{prefix}map`, `{prefix}mrr@{at_k}` and `{prefix}ndcg@{at_k}`; with `dims`, also of the embeddings' first m
    dims (`dim{m}/...`, the evaluator's `truncate_dim`)."""
    from sklearn.metrics import average_precision_score, ndcg_score

    sizes = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    queries = embed_texts(embed_queries, task.queries, **sizes)
    documents = embed_texts(embed_docs, task.documents, **sizes)
    out: dict[str, float] = {}
    for m, cut in dim_cuts(queries.shape[-1], dims):
        q, d = (F.normalize(x[..., :m].double(), dim=-1) for x in (queries, documents))
        ap, mrr, ndcg = [], [], []
        for query, own, positives in task.rows:
            scores = (d[torch.as_tensor(own, dtype=torch.long)] @ q[query]).numpy()
            relevant = np.arange(len(own)) < positives
            ap.append(average_precision_score(relevant, scores))
            ndcg.append(ndcg_score([relevant], [scores], k=at_k))
            first = next((r for r, i in enumerate(np.argsort(-scores, kind="stable")[:at_k]) if relevant[i]), None)
            mrr.append(0.0 if first is None else 1 / (first + 1))
        out |= {f"{cut}{prefix}map": float(np.mean(ap)), f"{cut}{prefix}mrr@{at_k}": float(np.mean(mrr))}
        out[f"{cut}{prefix}ndcg@{at_k}"] = float(np.mean(ndcg))
    return out
