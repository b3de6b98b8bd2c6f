"""Global orthogonal regularization (GOR; Zhang et al. 2017), EmbeddingGemma's spread-out term: embeddings of
unrelated inputs pushed to spread over the sphere as random unit vectors do.

For each column of the problem (the queries, the positives, and each hard-negative position j: the rows
N + i k + j) of n embeddings x_i in d dimensions, over its n(n - 1) ordered pairs i != j:

    mean term    m_1^2             m_1 = 1/(n(n-1)) sum x_i . x_j
    second term  relu(m_2 - 1/d)   m_2 = 1/(n(n-1)) sum (x_i . x_j)^2

summed (EmbeddingGemma) or averaged over the columns, each weighted (sentence-transformers'
GlobalOrthogonalRegularizationLoss; the embeddings are the towers' unit vectors, so x_i . x_j is their cosine).

Both come from sums over the rows, s = sum x_i, G = sum x_i x_i^T, a = sum |x_i|^2 and b = sum |x_i|^4:
sum_{i != j} x_i . x_j = |s|^2 - a and sum_{i != j} (x_i . x_j)^2 = |G|_F^2 - b. So the term costs O(n d^2)
and O(d^2) memory at any batch, never an n x n block, and the streamed form sums the own queries' statistics
over the ranks (every rank holds every column) and carries the term's gradient back to each row in closed
form: dL/dx_i = dL/ds + (dL/dG + dL/dG^T) x_i + 2 dL/da x_i + 4 dL/db |x_i|^2 x_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import EmbeddingTerm, Objective, Ranks

AGGREGATIONS = ("sum", "mean")


def statistics(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(s, G, a, b) of the rows of `x` (see the module)."""
    norms = x.square().sum(1)
    return x.sum(0), x.T @ x, norms.sum(), norms.square().sum()


def column_groups(docs: Tensor, num_queries: int) -> list[Tensor]:
    """The columns D [N(1 + k), d] as the positives and each hard-negative position: 1 + k groups of N rows."""
    k = (len(docs) - num_queries) // max(num_queries, 1)
    negatives = docs[num_queries:].view(num_queries, k, docs.shape[-1])
    return [docs[:num_queries], *(negatives[:, j] for j in range(k))]


@dataclass(frozen=True)
class Spread(EmbeddingTerm):
    """An objective plus the GOR term (see the module) over its problem's columns."""

    inner: Objective
    mean_weight: float = 0.0
    second_weight: float = 1.0
    aggregation: str = "sum"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.gor_aggregation={self.aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
        if not (self.mean_weight or self.second_weight):
            raise ValueError("loss.gor_weight and loss.gor_mean_weight are both 0: set one, or leave GOR out")

    def describe(self) -> str:
        weights = ((self.mean_weight, "mean"), (self.second_weight, "second moment"))
        terms = ", ".join(f"{w:g} x its {name}" for w, name in weights if w)
        return f"{self.inner.describe()} + GOR ({terms}, {self.aggregation} over the columns)"

    def term(self, stats: list[tuple[Tensor, Tensor, Tensor, Tensor]], n: int, dim: int) -> Tensor:
        """The weighted term from each column's statistics, `n` rows each, in `dim` dimensions."""
        pairs = max(n * (n - 1), 1)
        means = torch.stack([((s @ s - a) / pairs).square() for s, _, a, _ in stats])
        seconds = torch.stack([torch.relu((g.square().sum() - b) / pairs - 1.0 / dim) for _, g, _, b in stats])
        reduce = torch.sum if self.aggregation == "sum" else torch.mean
        return self.mean_weight * reduce(means) + self.second_weight * reduce(seconds)

    def whole(self, q: Tensor, docs: Tensor) -> Tensor:
        """The weighted term of a whole problem: queries [N, d], columns D [N(1 + k), d] (autograd)."""
        return self.term([statistics(x) for x in (q, *column_groups(docs, len(q)))], len(q), q.shape[-1])

    def own_share(self, rows: Tensor, docs: Tensor, num_queries: int, ranks: Ranks) -> tuple[Tensor, Tensor, Tensor]:
        """The queries' statistics summed over the ranks, the columns' taken whole; the rows' gradients in closed
        form from the statistics' (the module)."""
        own = [ranks.sum(t) for t in statistics(rows)]  # the whole problem's query statistics
        with torch.enable_grad():
            q_stats = [t.requires_grad_() for t in own]
            cols = docs.detach().to(rows.dtype).requires_grad_()
            stats = [tuple(q_stats), *(statistics(x) for x in column_groups(cols, num_queries))]
            term = self.term(stats, num_queries, docs.shape[-1])
            gs, gg, ga, gb, grad_cols = torch.autograd.grad(term, [*q_stats, cols])
        norms = rows.square().sum(1, keepdim=True)
        grad_rows = gs + rows @ (gg + gg.T) + (2 * ga + 4 * gb * norms) * rows
        return term, grad_rows, grad_cols
