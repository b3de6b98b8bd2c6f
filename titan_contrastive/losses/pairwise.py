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

The false-negative masks (`masking.py`: duplicate ids, margin, relative; by MaxSim for token sets) remove a column from
the row's terms, decided without gradient on the row's scores of the positives and of its own hard negatives: the
hardest in-batch negative is the hardest column left (none left: the row's B term is 0), a masked hard negative's E
term is 0 (the normalizer N k stays, as a masked pair's term in the sigmoid loss), and I's softmax leaves it out.
colpali-engine's positive-aware negative filtering halves such a score instead.

Every form but `dense` finds each row's hardest column without gradient, then scores the row's own columns again with
autograd (its positive, that column, its hard negatives): max's gradient is its arg-max's, so the loss and gradients
are the definition's, and only (2 + k) scores per row keep a graph, for dot products and token sets alike. The loss
reads t only through t sim and sim is positively homogeneous in q, so dL/dt per row is <q, dL/dq> / t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.base import Ranks, StreamResult, gathered_problem, own_columns, row_scale_shares
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.streaming import BlockMask, accumulation_dtype


@dataclass(frozen=True)
class Pairwise:
    """softplus of each query's hardest negative's score minus its positive's; see the module docstring."""

    in_batch_weight: float = 0.5
    """w: the in-batch term's weight beside the hard negatives' (colpali-engine's in_batch_term_weight)."""
    in_batch: str = "hardest"
    """The in-batch term: "hardest" (softplus against the hardest other positive) or "infonce" (one-way InfoNCE over
    the positives: colpali-engine's NegativeCELoss)."""
    false_negatives: FalseNegatives = field(default_factory=FalseNegatives)
    name: str = "pairwise"
    has_bias = False
    kernel_kind = "pairwise"
    init_logit_scale = 0.0  # t = 1: ColbertPairwiseCELoss's temperature
    init_logit_bias = None

    def __post_init__(self) -> None:
        if not 0 <= self.in_batch_weight <= 1:
            raise ValueError(f"loss.pairwise_in_batch_weight={self.in_batch_weight}: expected a number in [0, 1]")
        if self.in_batch not in ("hardest", "infonce"):
            raise ValueError(f"loss.pairwise_in_batch={self.in_batch!r}: expected 'hardest' or 'infonce'")

    @property
    def needs_ids(self) -> bool:
        return self.false_negatives.duplicates

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
        masked = (
            f"; false negatives masked ({self.false_negatives.describe().replace('cos', self._judged_by())})"
            if self.false_negatives.enabled
            else ""
        )
        return (
            f"{self.name} loss ({term}, {self._scored_by()}; beside hard negatives weighted {w:g}, theirs {1 - w:g}"
            f"{masked})"
        )

    def _scored_by(self) -> str:
        return "dot products"

    def _judged_by(self) -> str:
        return "cos"

    def _mask_of(self, rows: Tensor, docs: Tensor, first_row: int, ids: Tensor | None) -> BlockMask:
        """The false-negative mask of the rows (global rows first_row, ...) on blocks of their scores against all
        columns (unscaled)."""
        return self.false_negatives.for_rows(rows, docs, 1.0, first_row, ids)

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
        every = self._every_score(q, docs)
        logits = scale * every
        masked = torch.zeros(logits.shape, dtype=torch.bool, device=q.device)
        if self.false_negatives.enabled:
            masked = self._mask_of(q, docs, 0, ids)(every.detach(), 0)
        positive = logits[:, :n].diagonal()
        if self.in_batch == "infonce" and self._in_batch_on(n, len(docs)):
            in_batch = (logits[:, :n].masked_fill(masked[:, :n], -math.inf).logsumexp(1) - positive).mean()
        elif self._in_batch_on(n, len(docs)):
            eye = torch.eye(n, dtype=torch.bool, device=q.device)
            hardest = logits[:, :n].masked_fill(eye | masked[:, :n], -math.inf).amax(1)
            left = hardest > -math.inf  # a row whose every other positive is masked has no in-batch term
            in_batch = (F.softplus(torch.where(left, hardest, positive) - positive) * left).mean()
        else:
            in_batch = 0 * positive.sum()
        if not k:
            return in_batch
        rows = torch.arange(n, device=q.device)
        negatives = logits[:, n:].view(n, n, k)[rows, rows]  # [n, k]: query i's own columns N + i k, ...
        gone = masked[:, n:].view(n, n, k)[rows, rows]
        term = F.softplus(negatives - positive[:, None]).masked_fill(gone, 0.0).mean()
        return (1 - self.in_batch_weight) * term + self.in_batch_weight * in_batch

    def _columns(
        self, rows: Tensor, docs: Tensor, first_row: int, num_queries: int, ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """([c, j] column indices of rows first_row, ...: the positive, the hardest other positive left (where the
        in-batch term is on), then the row's hard negatives; [c, j] whether each term is kept; [c, N] the positives
        masked for each row, or None), chosen without gradient."""
        n, c, m = num_queries, len(rows), len(docs)
        own = own_columns(first_row, c, n, m, rows.device)
        kept, masked = torch.ones(own.shape, dtype=torch.bool, device=rows.device), None
        hardest_on = self.in_batch == "hardest" and self._in_batch_on(n, m)
        others = self._scores_without_grad(rows, docs[:n]) if hardest_on or self.false_negatives.enabled else None
        if self.false_negatives.enabled:
            block = torch.full((c, m), -math.inf, dtype=others.dtype, device=rows.device)
            block[:, :n] = others
            if m > n:  # the row's own hard negatives; the other rows' are not its candidates
                with torch.no_grad():
                    block.scatter_(1, own[:, 1:], self._own_scores(rows, docs[own[:, 1:]]).to(block.dtype))
            masked = self._mask_of(rows, docs, first_row, ids)(block, 0)
            kept = ~masked.gather(1, own)
        if not hardest_on:
            return own, kept, None if masked is None else masked[:, :n]
        r = torch.arange(c, device=rows.device)
        others[r, first_row + r] = -math.inf
        if masked is not None:
            others.masked_fill_(masked[:, :n], -math.inf)
        hardest = others.argmax(1, keepdim=True)
        left = others.gather(1, hardest) > -math.inf  # none left: the row's B term is 0
        return torch.cat([own[:, :1], hardest, own[:, 1:]], 1), torch.cat([kept[:, :1], left, kept[:, 1:]], 1), None

    def _terms(
        self, rows: Tensor, picked: Tensor, kept: Tensor, scale: Tensor, num_queries: int, num_columns: int
    ) -> Tensor:
        """The sum of the loss's terms of `rows` [c, D], with autograd, from their columns `picked` [c, j, D] in the
        order of `_columns`, a term whose column is not `kept` left out."""
        n = num_queries
        k = (num_columns - n) // n
        logits = scale.to(accumulation_dtype(rows)) * self._own_scores(rows, picked)
        positive = logits[:, 0]
        total = 0 * positive.sum()
        if self.in_batch == "hardest" and self._in_batch_on(n, num_columns):
            weight = self.in_batch_weight if k else 1.0
            total = total + weight / n * (F.softplus(logits[:, 1] - positive) * kept[:, 1]).sum()
        if k:
            negatives = logits[:, logits.shape[1] - k :]
            terms = F.softplus(negatives - positive[:, None]) * kept[:, kept.shape[1] - k :]
            total = total + (1 - self.in_batch_weight) / (n * k) * terms.sum()
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
        queries, cols, col_ids = gathered_problem(q, docs, ids, ranks)
        n = len(queries)
        columns, kept, masked = self._columns(queries.detach(), cols.detach(), 0, n, col_ids)
        infonce = self._infonce(queries, cols[:n], scale, 0, len(cols), masked)
        return self._terms(queries, cols[columns], kept, scale, n, len(cols)) + infonce

    def _infonce(
        self, rows: Tensor, positives: Tensor, scale: Tensor, first_row: int, num_columns: int, masked: Tensor | None
    ) -> Tensor:
        """The InfoNCE in-batch term's share of the rows first_row, ... (`in_batch = "infonce"`; else 0), weighted,
        with autograd through the rows and every positive, the `masked` positives [c, N] left out."""
        n = len(positives)
        if self.in_batch != "infonce" or not self._in_batch_on(n, num_columns):
            return rows.new_zeros((), dtype=accumulation_dtype(rows))
        logits = scale.to(accumulation_dtype(rows)) * self._row_scores(rows, positives)
        if masked is not None:
            logits = logits.masked_fill(masked, -math.inf)
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
            cols, kept, masked = self._columns(rows, docs, first_row + start, num_queries, ids)
            with torch.enable_grad():
                leaf_rows, picked = rows.requires_grad_(), docs.detach()[cols].to(acc).requires_grad_()
                leaves = [leaf_rows, picked]
                terms = self._terms(leaf_rows, picked, kept, s, num_queries, len(docs))
                if self.in_batch == "infonce":  # every positive's gradient too
                    leaves.append(docs.detach()[:num_queries].to(acc).requires_grad_())
                    terms = terms + self._infonce(leaf_rows, leaves[2], s, first_row + start, len(docs), masked)
                grad_r, grad_p, *grad_pos = torch.autograd.grad(terms, leaves, allow_unused=True)
            total += terms.detach()
            grad_rows[start : start + len(rows)] = grad_r
            grad_cols.index_add_(0, cols.flatten(), grad_p.flatten(0, 1))
            if grad_pos and grad_pos[0] is not None:
                grad_cols[:num_queries] += grad_pos[0]
        loss = ranks.sum(total)
        return StreamResult(loss, grad_rows, grad_cols, row_scale_shares(q_own, grad_rows, scale), None)
