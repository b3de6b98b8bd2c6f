"""The FLOPS regularizer (Paria et al. 2020), SPLADE's sparsity term: an objective plus

    L_f = w_q sum_j (1/N sum_i q_ij)^2 + w_d sum_j (1/M sum_c d_cj)^2

over the N queries and the M = N(1 + k) documents of the problem (positives and hard negatives together, as
sentence-transformers' SpladeLoss regularizes them), j running over the embedding's dimensions (SPLADE's
vocabulary). The square of a dimension's mean activation is the expected cost of that term in an inverted
index, so the term spreads the few active dimensions over the vocabulary and silences the rest. It needs
only the sums s_q = sum_i q_i and s_d = sum_c d_c, additive over the ranks: the streamed form sums the own
queries' over the ranks (every rank holds every column) and gives each row the same gradient,
dL/dq_i = 2 w_q s_q / N^2 (and 2 w_d s_d / M^2 to each column). With `warmup_steps` W both weights are
scaled by (s / W)^2 at optimizer step s < W (SPLADE's quadratic warmup; `at_step`). With a threshold T a side's
sum runs over its rows with more than T non-zero dimensions only (FLOPS with l0 masking, still divided by all N or
M rows), and the rows at or under it get no gradient from the term; whether a row counts is its own property, so
the forms stay exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import EmbeddingTerm, Objective, Ranks, at_step


@dataclass(frozen=True)
class Flops(EmbeddingTerm):
    """An objective plus the FLOPS term (see the module) of its queries (`query_weight`) and its columns
    (`doc_weight`)."""

    inner: Objective
    query_weight: float = 0.0
    doc_weight: float = 0.0
    warmup_steps: int = 0
    """Both weights rise as (step / warmup_steps)^2 from 0 at step 0 to full at this step (SPLADE's quadratic
    warmup, sentence-transformers' SpladeRegularizerWeightSchedulerCallback); 0 = full from the start."""
    factor: float = 1.0
    """The weights' share at the step this copy is for (`at_step`)."""
    query_threshold: int = 0
    """Only queries with more than this many non-zero dimensions count (sentence-transformers' FlopsLoss
    `threshold`); 0 = all."""
    doc_threshold: int = 0
    """The same for the columns."""

    def __post_init__(self) -> None:
        if not (self.query_weight or self.doc_weight):
            raise ValueError("loss.flops_query_weight and flops_doc_weight are both 0: set one, or leave FLOPS out")

    def at_step(self, step: int) -> Flops:
        """Itself at optimizer step `step` (0-based): its weights' share (`warmup_steps`), its inner objective's."""
        share = 1.0 if step >= self.warmup_steps else (step / self.warmup_steps) ** 2
        return dataclasses.replace(self, inner=at_step(self.inner, step), factor=share)

    def describe(self) -> str:
        weights = f"{self.query_weight:g} x the queries', {self.doc_weight:g} x the documents'"
        warmup = f", rising quadratically over {self.warmup_steps} steps" if self.warmup_steps else ""
        kept = [
            f"{side} over {t} non-zero"
            for side, t in (("queries", self.query_threshold), ("documents", self.doc_threshold))
            if t
        ]
        counted = f", counting {' and '.join(kept)} only" if kept else ""
        return f"{self.inner.describe()} + FLOPS ({weights}{warmup}{counted})"

    def term(self, query_sum: Tensor, doc_sum: Tensor, num_queries: int, num_columns: int) -> Tensor:
        """The weighted term from the queries' and the columns' sums over the rows."""
        queries = (query_sum / num_queries).square().sum()
        docs = (doc_sum / num_columns).square().sum()
        return self.factor * (self.query_weight * queries + self.doc_weight * docs)

    def whole(self, q: Tensor, docs: Tensor) -> Tensor:
        """The weighted term of a whole problem: queries [N, V], columns D [M, V] (autograd)."""
        q_kept, docs_kept = _kept(q, self.query_threshold), _kept(docs, self.doc_threshold)
        return self.term(_masked(q, q_kept).sum(0), _masked(docs, docs_kept).sum(0), len(q), len(docs))

    def own_share(self, rows: Tensor, docs: Tensor, num_queries: int, ranks: Ranks) -> tuple[Tensor, Tensor, Tensor]:
        """The queries' sum over the ranks, the columns' taken whole; every counted row's gradient the same, so
        without a threshold each is returned as one [V] vector that broadcasts over the rows (no [M, V] copy of it
        on the hot path), and with one masked per row."""
        docs = docs.detach().to(rows.dtype)
        q_kept, docs_kept = _kept(rows, self.query_threshold), _kept(docs, self.doc_threshold)
        query_sum, doc_sum, m = ranks.sum(_masked(rows, q_kept).sum(0)), _masked(docs, docs_kept).sum(0), len(docs)
        term = self.term(query_sum, doc_sum, num_queries, m)
        grad_row = (2 * self.factor * self.query_weight / num_queries**2) * query_sum
        grad_col = (2 * self.factor * self.doc_weight / m**2) * doc_sum
        return term, _masked(grad_row, q_kept), _masked(grad_col, docs_kept)


def _kept(x: Tensor, threshold: int) -> Tensor | None:
    """Which rows of `x` have more than `threshold` non-zero entries (None: no threshold, every row)."""
    return torch.count_nonzero(x.detach(), dim=1) > threshold if threshold else None


def _masked(x: Tensor, kept: Tensor | None) -> Tensor:
    """`x` [n, V] with the rows not `kept` zeroed, or one row [V] spread over the kept rows; `x` without a mask."""
    return x if kept is None else kept[:, None].to(x.dtype) * x


__all__ = ["Flops"]
