"""SigLIP's sigmoid loss over N queries and the columns D (positives, then hard negatives).

With l_ij = t <q_i, d_j> + b (t = exp(t'), b the learnable bias), z_ij = +1 for the positive
(j = i) and -1 for every other column, hard negatives included, and the false-negative mask M:

    L = -1/N sum_i sum_{j not in M_i} log sigmoid(z_ij l_ij)

A sum over pairs: no normalizer couples the rows, so a rank's rows need only the columns, and
the streamed form is one pass.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses import fused
from titan_contrastive.losses.base import Ranks, StreamResult, gathered_problem, row_scale_shares
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.streaming import streamed_sigmoid


@dataclass(frozen=True)
class Sigmoid:
    false_negatives: FalseNegatives = field(default_factory=FalseNegatives)
    name: str = "siglip"
    has_bias = True
    kernel_kind = "sigmoid"
    init_logit_scale = math.log(10.0)  # SigLIP's initialization
    init_logit_bias = -10.0

    @property
    def needs_ids(self) -> bool:
        return self.false_negatives.duplicates

    def with_guide(self, guide: Guide | None) -> Sigmoid:
        return dataclasses.replace(self, false_negatives=self.false_negatives.guided(guide))

    def describe(self) -> str:
        masked = f", false negatives masked ({self.false_negatives.describe()})" if self.false_negatives.enabled else ""
        return f"{self.name} loss (sigmoid{masked})"

    def rows(
        self,
        q: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor,
        ids: Tensor | None = None,
        first_row: int = 0,
        normalizer: int | None = None,
        tiled: bool = False,
    ) -> Tensor:
        """The loss terms of the rows `q` (global rows first_row, ...) against all columns, summed
        and divided by `normalizer` (default len(q)); autograd, materialises len(q) x M logits
        (`tiled`: the microbatch form's, which an objective over another score may compute otherwise)."""
        products = self._scores(q, docs)
        logits = scale * products + bias
        rows = torch.arange(first_row, first_row + len(q), device=q.device)
        signs = torch.where(rows[:, None] == torch.arange(len(docs), device=q.device), 1.0, -1.0).to(logits.dtype)
        terms = -F.logsigmoid(signs * logits)
        masked = self._masked(q, docs, ids, first_row, products)
        if masked is not None:
            terms = terms.masked_fill(masked, 0.0)
        return terms.sum() / (normalizer or len(q))

    def _scores(self, q: Tensor, docs: Tensor) -> Tensor:
        """The score of every row with every column, with autograd: the dot product."""
        return q @ docs.T

    def _masked(self, q: Tensor, docs: Tensor, ids: Tensor | None, first_row: int, products: Tensor) -> Tensor | None:
        """bool [len(q), M], True where a false negative is masked; None for none."""
        return self.false_negatives.dense(q, docs, ids, first_row)

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        if bias is None:
            raise ValueError("the sigmoid loss needs a bias (the model's logit_bias)")
        return self.rows(q, docs, scale, bias, ids)

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """This rank's rows against every rank's columns (gathered with gradient), never the whole
        problem on one rank. Each rank divides its rows' sum by its own batch; the gather's backward
        sums every rank's gradient into the local columns, and the data-parallel average over P
        ranks gives dL/dtheta of the gathered problem. The value returned is the mean over ranks
        (one scalar all-reduce), so every rank logs L; its gradient is this rank's share."""
        if bias is None:
            raise ValueError("the sigmoid loss needs a bias (the model's logit_bias)")
        rows, cols, col_ids = gathered_problem(q, docs, ids, ranks, with_rows=False)
        local = self.rows(rows, cols, scale, bias, col_ids, first_row=ranks.rank * len(q), tiled=True)
        if ranks.world == 1:
            return local
        mean = ranks.sum(local.detach().clone()) / ranks.world
        return local + (mean - local.detach())  # value: L on every rank; gradient: this rank's share

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return num_columns == num_queries and not self.false_negatives.enabled

    def streamed(
        self,
        q_own: Tensor,
        docs: Tensor,
        scale: Tensor,
        bias: Tensor | None,
        *,
        first_row: int,
        num_queries: int,
        chunk: int,
        ranks: Ranks,
        kernel: str = "pytorch",
        ids: Tensor | None = None,
    ) -> StreamResult:
        """One pass over the own rows against all columns: their loss terms (summed over ranks),
        both embedding gradients and the rows' shares of dL/db."""
        if bias is None:
            raise ValueError("the sigmoid loss needs a bias (the model's logit_bias)")
        s, b = torch.stack([scale.detach().reshape(()), bias.detach().reshape(()).to(scale.dtype)]).tolist()  # one read
        if kernel == "pytorch":
            mask = (
                self.false_negatives.for_rows(q_own, docs, s, first_row, ids) if self.false_negatives.enabled else None
            )
            loss, gx, gy, bias_rows = streamed_sigmoid(
                q_own, docs, s, b, first_row, chunk, num_pairs=num_queries, mask=mask
            )
        else:
            loss, gx, gy, bias_rows = fused.fused_sigmoid(q_own, docs, s, b, first_row, kernel)
        return StreamResult(ranks.sum(loss.detach()), gx, gy, row_scale_shares(q_own, gx, scale), bias_rows)
