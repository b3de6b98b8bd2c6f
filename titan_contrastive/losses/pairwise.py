"""The pairwise loss of ColPali and colpali-engine: each query's positive against its hardest in-batch negative, and
each of its hard negatives.

With S_ij = t sim(q_i, d_j) (t = exp(t'), the temperature's multiplier; sim the dot product, or MaxSim for token sets,
`late_interaction.LatePairwise`) over N queries and the columns D (positives, then k hard negatives per query, in the
layout of `base.py`):

    B = 1/N sum_i softplus(max_{j < N, j != i} S_ij - S_ii)                  the hardest other query's positive
    E = 1/(N k) sum_i sum_{c: i's hard negatives} softplus(S_ic - S_ii)       each of the data's hard negatives
    L = B without hard negatives; (1 - w) E + w B with them                  (w: `in_batch_weight`)

B is colpali-engine's BiPairwiseCELoss and ColbertPairwiseCELoss (the loss ColPali and ColQwen2 were trained with), L
with hard negatives its BiPairwiseNegativeCELoss and ColbertPairwiseNegativeCELoss (w its `in_batch_term_weight`);
their temperature is 1 / t. As there, the in-batch term reads the other queries' positives, not their hard negatives.
A problem of one query has no in-batch negative: its B is 0. With `in_batch = "infonce"` the in-batch term is
one-way InfoNCE over the positives instead,

    I = 1/N sum_i (log sum_{j < N} exp S_ij - S_ii),    L = (1 - w) E + w I   (I alone without hard negatives)

colpali-engine's BiNegativeCELoss and ColbertNegativeCELoss; its rows are independent, so it streams by rows too.

Every form but `dense` finds each row's hardest column without gradient, then scores the row's own columns again with
autograd (its positive, that column, its hard negatives): max's gradient is its arg-max's, so the loss and gradients
are the definition's, and only (2 + k) scores per row keep a graph, for dot products and token sets alike. The loss
reads t only through t sim and sim is positively homogeneous in q, so dL/dt per row is <q, dL/dq> / t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.base import Ranks, StreamResult, gathered_problem, own_columns, row_scale_shares
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.streaming import accumulation_dtype


@dataclass(frozen=True)
class Pairwise:
    """softplus of each query's hardest negative's score minus its positive's; see the module docstring."""

    in_batch_weight: float = 0.5
    """w: the in-batch term's weight beside the hard negatives' (colpali-engine's in_batch_term_weight)."""
    in_batch: str = "hardest"
    """The in-batch term: "hardest" (softplus against the hardest other positive) or "infonce" (one-way InfoNCE over
    the positives: colpali-engine's NegativeCELoss)."""
    name: str = "pairwise"
    has_bias = False
    needs_ids = False
    kernel_kind = "pairwise"
    init_logit_scale = 0.0  # t = 1: ColbertPairwiseCELoss's temperature
    init_logit_bias = None

    def __post_init__(self) -> None:
        if not 0 <= self.in_batch_weight <= 1:
            raise ValueError(f"loss.pairwise_in_batch_weight={self.in_batch_weight}: expected a number in [0, 1]")
        if self.in_batch not in ("hardest", "infonce"):
            raise ValueError(f"loss.pairwise_in_batch={self.in_batch!r}: expected 'hardest' or 'infonce'")

    def with_guide(self, guide: Guide | None) -> Pairwise:
        if guide is not None:
            raise ValueError(
                "loss.name=pairwise takes each query's hardest negative; a guide's masks are not supported"
            )
        return self

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return False

    def describe(self) -> str:
        w = self.in_batch_weight
        term = (
            "softplus of the hardest in-batch negative's score minus the positive's, colpali-engine's PairwiseCELoss"
            if self.in_batch == "hardest"
            else "one-way InfoNCE over the positives beside each hard negative's softplus, "
            "colpali-engine's NegativeCELoss"
        )
        return f"{self.name} loss ({term}, {self._scored_by()}; beside hard negatives weighted {w:g}, theirs {1 - w:g})"

    def _scored_by(self) -> str:
        return "dot products"

    # ---- the similarity: dot products here, MaxSim in late_interaction.LatePairwise

    def _every_score(self, q: Tensor, docs: Tensor) -> Tensor:
        """sim of every row of q with every row of docs [n, m], with autograd (the definition's)."""
        return q @ docs.T

    def _scores_without_grad(self, q: Tensor, docs: Tensor) -> Tensor:
        """`_every_score` without autograd, in the accumulation dtype."""
        acc = accumulation_dtype(q)
        with torch.no_grad():
            return q.to(acc) @ docs.to(acc).T

    def _own_scores(self, q: Tensor, docs: Tensor) -> Tensor:
        """sim of each row of q [c, D] with its own documents [c, j, D]: [c, j], with autograd."""
        acc = accumulation_dtype(q)
        return torch.einsum("cd,cjd->cj", q.to(acc), docs.to(acc))

    def _row_scores(self, q: Tensor, docs: Tensor) -> Tensor:
        """sim of every row of q with every row of docs [c, m] in the accumulation dtype, with autograd, keeping as
        little as the similarity allows (the InfoNCE term's rows)."""
        acc = accumulation_dtype(q)
        return q.to(acc) @ docs.to(acc).T

    # ---- the forms

    def _in_batch_on(self, num_queries: int, num_columns: int) -> bool:
        return num_queries > 1 and (num_columns == num_queries or self.in_batch_weight > 0)

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        """The definition on whole tensors (autograd; every score at once)."""
        n = len(q)
        k = (len(docs) - n) // n
        logits = scale * self._every_score(q, docs)
        positive = logits[:, :n].diagonal()
        if self.in_batch == "infonce" and self._in_batch_on(n, len(docs)):
            in_batch = (logits[:, :n].logsumexp(1) - positive).mean()
        elif self._in_batch_on(n, len(docs)):
            eye = torch.eye(n, dtype=torch.bool, device=q.device)
            hardest = logits[:, :n].masked_fill(eye, -math.inf).amax(1)
            in_batch = F.softplus(hardest - positive).mean()
        else:
            in_batch = 0 * positive.sum()
        if not k:
            return in_batch
        rows = torch.arange(n, device=q.device)
        negatives = logits[:, n:].view(n, n, k)[rows, rows]  # [n, k]: query i's own columns N + i k, ...
        term = F.softplus(negatives - positive[:, None]).mean()
        return (1 - self.in_batch_weight) * term + self.in_batch_weight * in_batch

    def _columns(self, rows: Tensor, docs: Tensor, first_row: int, num_queries: int) -> Tensor:
        """[c, j] column indices of rows first_row, ...: the positive, the hardest other positive (where the in-batch
        term is on), then the row's hard negatives; chosen without gradient."""
        n, c = num_queries, len(rows)
        own = own_columns(first_row, c, n, len(docs), rows.device)
        if self.in_batch == "infonce" or not self._in_batch_on(n, len(docs)):
            return own
        others = self._scores_without_grad(rows, docs[:n])
        r = torch.arange(c, device=rows.device)
        others[r, first_row + r] = -math.inf
        return torch.cat([own[:, :1], others.argmax(1, keepdim=True), own[:, 1:]], 1)

    def _terms(self, rows: Tensor, picked: Tensor, scale: Tensor, num_queries: int, num_columns: int) -> Tensor:
        """The sum of the loss's terms of `rows` [c, D], with autograd, from their columns `picked` [c, j, D] in the
        order of `_columns`."""
        n = num_queries
        k = (num_columns - n) // n
        logits = scale.to(accumulation_dtype(rows)) * self._own_scores(rows, picked)
        positive = logits[:, 0]
        total = 0 * positive.sum()
        if self.in_batch == "hardest" and self._in_batch_on(n, num_columns):
            weight = self.in_batch_weight if k else 1.0
            total = total + weight / n * F.softplus(logits[:, 1] - positive).sum()
        if k:
            negatives = logits[:, logits.shape[1] - k :]
            total = total + (1 - self.in_batch_weight) / (n * k) * F.softplus(negatives - positive[:, None]).sum()
        return total

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The loss over all ranks' embeddings gathered with gradient, the same on every rank (as
        `InfoNCE.microbatch`)."""
        queries, cols, _ = gathered_problem(q, docs, None, ranks)
        n = len(queries)
        picked = cols[self._columns(queries.detach(), cols.detach(), 0, n)]
        return self._terms(queries, picked, scale, n, len(cols)) + self._infonce(queries, cols[:n], scale, 0, len(cols))

    def _infonce(self, rows: Tensor, positives: Tensor, scale: Tensor, first_row: int, num_columns: int) -> Tensor:
        """The InfoNCE in-batch term's share of the rows first_row, ... (`in_batch = "infonce"`; else 0), weighted,
        with autograd through the rows and every positive."""
        n = len(positives)
        if self.in_batch != "infonce" or not self._in_batch_on(n, num_columns):
            return rows.new_zeros((), dtype=accumulation_dtype(rows))
        logits = scale.to(accumulation_dtype(rows)) * self._row_scores(rows, positives)
        own = logits.diagonal(first_row)
        weight = self.in_batch_weight if num_columns > n else 1.0
        return weight / n * (logits.logsumexp(1) - own).sum()

    def streamed(
        self,
        q_own: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor | None = None,
        *,
        first_row: int,
        num_queries: int,
        chunk: int,
        ranks: Ranks,
        kernel: str = "pytorch",
        ids: Tensor | None = None,
    ) -> StreamResult:
        """The own rows, `chunk` at a time: each row's columns chosen, its terms and their gradients (of the row and of
        the chosen columns, added into this rank's share)."""
        acc, s = accumulation_dtype(q_own), scale.detach()
        total = torch.zeros((), dtype=acc, device=q_own.device)
        grad_rows = torch.empty(q_own.shape, dtype=acc, device=q_own.device)
        grad_cols = torch.zeros(docs.shape, dtype=acc, device=q_own.device)
        for start in range(0, len(q_own), chunk):
            rows = q_own[start : start + chunk].detach().to(acc, copy=True)
            cols = self._columns(rows, docs, first_row + start, num_queries)
            with torch.enable_grad():
                leaf_rows, picked = rows.requires_grad_(), docs.detach()[cols].to(acc).requires_grad_()
                leaves = [leaf_rows, picked]
                terms = self._terms(leaf_rows, picked, s, num_queries, len(docs))
                if self.in_batch == "infonce":  # every positive's gradient too
                    leaves.append(docs.detach()[:num_queries].to(acc).requires_grad_())
                    terms = terms + self._infonce(leaf_rows, leaves[2], s, first_row + start, len(docs))
                grad_r, grad_p, *grad_pos = torch.autograd.grad(terms, leaves, allow_unused=True)
            total += terms.detach()
            grad_rows[start : start + len(rows)] = grad_r
            grad_cols.index_add_(0, cols.flatten(), grad_p.flatten(0, 1))
            if grad_pos and grad_pos[0] is not None:
                grad_cols[:num_queries] += grad_pos[0]
        loss = ranks.sum(total)
        return StreamResult(loss, grad_rows, grad_cols, row_scale_shares(q_own, grad_rows, scale), None)
