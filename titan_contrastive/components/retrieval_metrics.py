"""Retrieval metrics as embedding users measure them: top-k search and IR metrics.

People compare embedders by nDCG@10 (visual document retrieval: nDCG@5), MRR@10, MAP@100 and recall@k on
BEIR-format sets (`beir_folder.read_beir`), mostly through sentence-transformers' `InformationRetrievalEvaluator`.
`top_k` ranks the corpus for every query chunk by chunk (never a queries x corpus matrix), and `ir_metrics`
scores the rankings with that evaluator's definitions, so the figures are comparable with the ones users report:

- relevance is binary: a qrels row with a score above 0 is relevant and its grade is not used
  (the evaluator takes a set of relevant ids); `graded=True` gives nDCG with the grade as the
  gain instead, as pytrec_eval does for BEIR's own tables, MTEB and ViDoRe;
- queries without a relevant document are read but left out of every average;
- equal scores rank by ascending corpus id. `read_beir` orders the corpus by id, so `top_k`'s
  rule (lower corpus index first) is the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from titan_contrastive.datasets.base import DataError


def _select(scores: torch.Tensor, indices: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates of each row by (score descending, index ascending), in that order."""
    threshold = scores.topk(k, dim=1).values[:, -1:]
    # every score above the k-th comes first, then the ties at the k-th with the lowest indices
    key = torch.where(scores > threshold, indices, torch.where(scores == threshold, indices + n, 2 * n))
    pick = key.topk(k, dim=1, largest=False).indices
    s, i = scores.gather(1, pick), indices.gather(1, pick)
    by_index = i.argsort(dim=1, stable=True)
    s, i = s.gather(1, by_index), i.gather(1, by_index)
    by_score = s.argsort(dim=1, descending=True, stable=True)
    return s.gather(1, by_score), i.gather(1, by_score)


def top_k(
    query_emb: torch.Tensor,
    corpus_emb: torch.Tensor,
    k: int,
    chunk: int = 50_000,
    normalize: bool = False,
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and corpus indices [Q, min(k, N)] of each query's best documents by dot product
    (cosine with `normalize=True` or normalized embeddings; `similarity`'s scores where given: late interaction's),
    best first, ties to the lower index.

    The corpus is scored `chunk` rows at a time and merged into a running top-k, so memory is
    Q x (k + chunk) whatever the corpus size. Equal embeddings tie exactly only when the matrix
    products give them equal scores, which a BLAS need not do across chunks of different shapes."""
    if k < 1 or chunk < 1:
        raise ValueError(f"top_k needs k >= 1 and chunk >= 1, got k={k}, chunk={chunk}")
    q, c = query_emb.float(), corpus_emb.float()
    if normalize:
        q, c = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(c, dim=-1)
    n = c.shape[0]
    k = min(k, n)
    best_s = q.new_empty((q.shape[0], 0))
    best_i = torch.empty((q.shape[0], 0), dtype=torch.long, device=q.device)
    for start in range(0, n, chunk):
        s = q @ c[start : start + chunk].T if similarity is None else similarity(q, c[start : start + chunk])
        i = torch.arange(start, start + s.shape[1], device=q.device).expand_as(s)
        cand_s, cand_i = torch.cat([best_s, s], dim=1), torch.cat([best_i, i], dim=1)
        best_s, best_i = _select(cand_s, cand_i, min(k, cand_s.shape[1]), n)
    return best_s, best_i


def _dcg(gains: Sequence[float]) -> float:
    return sum(g / math.log2(r + 2) for r, g in enumerate(gains))


def ir_metrics(
    top_scores: torch.Tensor,
    top_indices: torch.Tensor,
    query_ids: Sequence[str],
    corpus_ids: Sequence[str],
    qrels: dict[str, dict[str, int]],
    ndcg_at: Sequence[int] = (10,),
    mrr_at: Sequence[int] = (10,),
    map_at: Sequence[int] = (100,),
    recall_at: Sequence[int] = (1, 10, 100),
    precision_at: Sequence[int] = (),
    accuracy_at: Sequence[int] = (),
    graded: bool = False,
) -> dict[str, float]:
    """`ndcg@k`, `mrr@k`, `map@k`, `recall@k`, `precision@k`, `accuracy@k` averaged over the
    queries with a relevant document, as sentence-transformers' InformationRetrievalEvaluator
    computes them from `top_k`'s output (row r is query `query_ids[r]`)."""
    ks = [*ndcg_at, *mrr_at, *map_at, *recall_at, *precision_at, *accuracy_at]
    need = min(max(ks, default=0), len(corpus_ids))
    if top_indices.shape[1] < need:
        raise ValueError(f"ir_metrics needs {need} hits per query, top_k gave {top_indices.shape[1]}; raise its k")
    sums: dict[str, float] = {}
    count = 0
    for scores, indices, qid in zip(top_scores.tolist(), top_indices.tolist(), query_ids):
        relevant = {d: g for d, g in qrels.get(qid, {}).items() if g > 0}
        if not relevant:
            continue
        count += 1
        hits = sorted(((s, corpus_ids[i]) for s, i in zip(scores, indices)), key=lambda h: (-h[0], h[1]))
        ranked = [d for _, d in hits]
        values: dict[str, float] = {}
        for k in accuracy_at:
            values[f"accuracy@{k}"] = float(any(d in relevant for d in ranked[:k]))
        for k in precision_at:
            values[f"precision@{k}"] = sum(d in relevant for d in ranked[:k]) / k
        for k in recall_at:
            values[f"recall@{k}"] = sum(d in relevant for d in ranked[:k]) / len(relevant)
        for k in mrr_at:
            values[f"mrr@{k}"] = next((1 / (r + 1) for r, d in enumerate(ranked[:k]) if d in relevant), 0.0)
        for k in ndcg_at:
            gains = [relevant.get(d, 0) if graded else float(d in relevant) for d in ranked[:k]]
            ideal = sorted(relevant.values(), reverse=True) if graded else [1] * len(relevant)
            values[f"ndcg@{k}"] = _dcg(gains) / _dcg(ideal[:k])
        for k in map_at:
            found, total = 0, 0.0
            for r, d in enumerate(ranked[:k]):
                if d in relevant:
                    found += 1
                    total += found / (r + 1)
            values[f"map@{k}"] = total / min(k, len(relevant))
        for name, v in values.items():
            sums[name] = sums.get(name, 0.0) + v
    if count == 0:
        raise DataError("qrels: no query in query_ids has a document with a score above 0; check the qrels split")
    return {name: total / count for name, total in sums.items()}
