"""InfoNCE (softmax) over N queries and the columns D (positives, then hard negatives).

With S_ij = t <q_i, d_j> (t = exp(t'), the model's learnable temperature multiplier) and the
false-negative mask M (`losses/masking.py`; masked entries leave the denominator):

    L = -1/N sum_i log softmax_{j not in M_i}(S_i)[i]                             (one-way)
    L = 1/2 (that + -1/N sum_j log softmax_{i not in M^T_j}(S_{:, j})[j], j < N)   (symmetric)

The symmetric form's second direction runs from each positive document to the N queries; with
no hard negatives and no mask it is CLIP's loss. `symmetric = false` is sentence-transformers'
MultipleNegativesRankingLoss; `directions` add the other queries and documents to its one softmax
(GTE's improved contrastive loss, `losses/directions.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses import fused
from titan_contrastive.losses.base import Ranks, StreamResult, gathered_problem, row_dots, row_scale_shares
from titan_contrastive.losses.directions import check_directions, dense_joint, streamed_joint
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.hardness import Hardness
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.streaming import KeptBlock, streamed_row_col_lse, streamed_softmax_grads

logger = logging.getLogger("titan_contrastive")


@dataclass(frozen=True)
class InfoNCE:
    symmetric: bool = True
    false_negatives: FalseNegatives = field(default_factory=FalseNegatives)
    directions: tuple[str, ...] = ()
    """Joint directions (`losses/directions.py`): query_to_query, doc_to_query, doc_to_doc."""
    hardness: Hardness = field(default_factory=Hardness)
    """Hardness weighting of the query -> document negatives (`losses/hardness.py`)."""
    name: str = "clip"
    has_bias = False
    kernel_kind = "softmax"
    init_logit_scale = math.log(1 / 0.07)
    init_logit_bias = None

    def __post_init__(self) -> None:
        check_directions(tuple(self.directions), self.symmetric)
        self.hardness.check(self.symmetric)

    @property
    def needs_ids(self) -> bool:
        return self.false_negatives.duplicates

    def with_guide(self, guide: Guide | None) -> InfoNCE:
        return dataclasses.replace(self, false_negatives=self.false_negatives.guided(guide))

    def describe(self) -> str:
        options = ["symmetric" if self.symmetric else "one-way"]
        if self.directions:
            options.append(f"joint with {', '.join(self.directions)}")
        if self.hardness.enabled:
            options.append(self.hardness.describe())
        if self.false_negatives.enabled:
            options.append(f"false negatives masked ({self.false_negatives.describe()})")
        return f"{self.name} loss (InfoNCE, {', '.join(options)})"

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        """The definition on whole tensors (autograd; materialises N x M logits)."""
        if self.directions:
            return dense_joint(self.directions, self.false_negatives, self.hardness, q, docs, scale, ids)
        n = len(q)
        cosines = q @ docs.T
        logits = scale * cosines
        if self.hardness.enabled:
            logits = self.hardness.dense(logits, cosines, 0, n)
        masked = self.false_negatives.dense(q, docs, ids)
        if masked is not None:
            logits = logits.masked_fill(masked, -math.inf)
        labels = torch.arange(n, device=q.device)
        loss = F.cross_entropy(logits, labels)
        if self.symmetric:
            loss = 0.5 * (loss + F.cross_entropy(logits[:, :n].T, labels))
        return loss

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The loss over all ranks' embeddings gathered with gradient, the same on every rank (the
        gather's backward sums every rank's gradient into the local rows: P times dL/dz, which the
        data-parallel average over P ranks turns into dL/dtheta of the gathered problem)."""
        queries, cols, col_ids = gathered_problem(q, docs, ids, ranks)
        return self.dense(queries, cols, scale, ids=col_ids)

    def fused(self, num_queries: int, num_columns: int) -> bool:
        plain = not self.false_negatives.enabled and not self.directions and not self.hardness.enabled
        return self.symmetric and num_columns == num_queries and plain

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
        """The own rows against all columns: forward once (row LSEs, and for the symmetric form the
        positives' partial column LSEs, merged over ranks), then one recompute for the gradients.
        `kernel` other than "pytorch": the fused kernels (only where `fused` holds)."""
        if self.directions:
            return streamed_joint(
                self.directions, self.false_negatives, self.hardness, q_own, docs, scale,
                first_row=first_row, num_queries=num_queries, chunk=chunk, ranks=ranks, ids=ids,
            )  # fmt: skip
        n, c, s = num_queries, len(q_own), float(scale)  # the step's one host read of the scale (kernels take floats)
        mask = self.false_negatives.for_rows(q_own, docs, s, first_row, ids) if self.false_negatives.enabled else None
        weight = self.hardness.for_rows(first_row, n, s) if self.hardness.enabled else None
        if kernel == "pytorch":
            keep = KeptBlock()
            row_own, col_part = streamed_row_col_lse(
                q_own, docs, s, chunk, keep, lse_columns=n if self.symmetric else 0, mask=mask, weight=weight
            )
        else:
            row_own, col_part = fused.fused_lse(q_own, docs, s, kernel)
        col_lse = ranks.merge_lse(col_part) if self.symmetric else None
        acc = row_own.dtype
        positive = row_dots(q_own, docs[first_row : first_row + c], acc) * scale.to(acc)
        terms = (row_own - positive).sum()
        if self.symmetric:
            terms = terms + (col_lse[first_row : first_row + c] - positive).sum()
        loss = ranks.sum(terms.detach().clone()) / (2 * n if self.symmetric else n)
        if kernel == "pytorch":
            grads = functools.partial(
                streamed_softmax_grads, chunk=chunk, keep=keep, num_queries=n, mask=mask, weight=weight
            )
        else:
            grads = functools.partial(fused.fused_embedding_grads, kernel=kernel)
        grad_rows, grad_cols = grads(q_own, docs, row_own, col_lse, s, first_row)
        return StreamResult(loss, grad_rows, grad_cols, row_scale_shares(q_own, grad_rows, scale), None)
