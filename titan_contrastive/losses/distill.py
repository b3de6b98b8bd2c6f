"""Knowledge distillation from a teacher's scores: each query's own documents ranked as the teacher ranks them.

The data serves, per query i, a teacher's scores T_i0 of its positive and T_i1..T_ik of its k hard
negatives (`datasets/pairs.py`: a `label` or `score` column, or `labels` / `scores`; e.g. a
cross-encoder's logits). The student's scores are the objective's logits over the same documents,
S_ij = t <q_i, d_ij>, and the term is

    kl:          L_d = 1/N sum_i sum_j p_ij (log p_ij - log softmax(S_i)_j),   p_i = softmax(T_i / tau)
    margin_mse:  L_d = 1/(N k) sum_i sum_{j >= 1} ((S_i0 - S_ij) - (T_i0 - T_ij))^2

(sentence-transformers' DistillKLDivLoss, without its tau^2 factor, and MarginMSELoss). The run's
loss is contrastive_weight x the contrastive objective + weight x L_d (`Distilled`). A query's term
reads only its own row, so each form is exact as it stands: the microbatch form on the gathered
problem, the streamed form on a rank's own rows (their gradients, their documents' columns and
their shares of dL/dt). The teacher's scores of the whole problem are bound per step
(`with_teacher`), in the order of its queries, like a guide's embeddings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_contrastive.losses.base import (
    Objective,
    Ranks,
    StreamResult,
    gathered_problem,
    own_columns,
    row_scale_shares,
)
from titan_contrastive.losses.guide import Guide

KINDS = ("kl", "margin_mse")


@dataclass(frozen=True)
class Distillation:
    """Which term (`kind`), its weight, and the teacher's temperature tau (kl)."""

    kind: str
    weight: float = 1.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.distill={self.kind!r} is not a distillation term; valid: {', '.join(KINDS)}")
        if self.kind != "kl" and self.temperature != 1.0:
            raise ValueError(
                f"loss.distill_temperature={self.temperature}: only loss.distill=kl has a temperature; leave it at 1"
            )

    def rows(self, logits: Tensor, teacher: Tensor) -> Tensor:
        """The term of each row [c], from the student's logits and the teacher's scores [c, 1 + k]."""
        teacher = teacher.to(logits.dtype)
        if self.kind == "kl":
            p = torch.softmax(teacher / self.temperature, 1)
            return (torch.xlogy(p, p) - p * torch.log_softmax(logits, 1)).sum(1)
        return ((logits[:, :1] - logits[:, 1:]) - (teacher[:, :1] - teacher[:, 1:])).square().mean(1)

    def describe(self) -> str:
        what = f"KL to the teacher's softmax at tau {self.temperature:g}" if self.kind == "kl" else "margin MSE"
        return f"{self.weight:g} x distillation ({what}) over each query's own documents"


def own_logits(q: Tensor, docs: Tensor, scale: Tensor, first_row: int, num_queries: int) -> Tensor:
    """[c, 1 + k]: t <q_i, d> for the rows first_row.. of `q` and their own documents in `docs`."""
    idx = own_columns(first_row, len(q), num_queries, len(docs), q.device)
    return scale * torch.einsum("cd,ckd->ck", q, docs[idx])


@dataclass(frozen=True)
class Distilled:
    """A contrastive objective (weighted by `contrastive_weight`; 0 leaves it out) plus a
    distillation term; see the module docstring. `teacher`: the scores [N, 1 + k] of the problem
    the next call computes (`with_teacher`)."""

    inner: Objective
    distillation: Distillation
    contrastive_weight: float = 1.0
    teacher: Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def has_bias(self) -> bool:
        return self.inner.has_bias

    @property
    def needs_ids(self) -> bool:
        return self.inner.needs_ids

    @property
    def kernel_kind(self) -> str:
        return self.inner.kernel_kind

    @property
    def init_logit_scale(self) -> float:
        return self.inner.init_logit_scale

    @property
    def init_logit_bias(self) -> float | None:
        return self.inner.init_logit_bias

    def with_guide(self, guide: Guide | None) -> Distilled:
        return dataclasses.replace(self, inner=self.inner.with_guide(guide))

    def with_teacher(self, teacher: Tensor) -> Distilled:
        return dataclasses.replace(self, teacher=teacher)

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return self.inner.fused(num_queries, num_columns)

    def describe(self) -> str:
        if not self.contrastive_weight:
            return f"{self.distillation.describe()}, without the contrastive objective"
        return f"{self.contrastive_weight:g} x {self.inner.describe()} + {self.distillation.describe()}"

    def _teacher(self, num_queries: int, num_columns: int) -> Tensor:
        """The bound scores, checked against the problem's shape."""
        if self.teacher is None:
            raise ValueError("loss.distill: no teacher scores for this problem; the batches must carry them")
        k = (num_columns - num_queries) // max(num_queries, 1)
        if k < 1 or tuple(self.teacher.shape) != (num_queries, 1 + k):
            raise ValueError(
                f"loss.distill: teacher scores {tuple(self.teacher.shape)} for {num_queries} queries and "
                f"{num_columns} columns; it needs [{num_queries}, 1 + k] with k >= 1 hard negatives per query"
            )
        return self.teacher

    def _term(self, q: Tensor, docs: Tensor, scale: Tensor) -> Tensor:
        """weight x L_d of a whole problem (autograd)."""
        teacher = self._teacher(len(q), len(docs))
        return self.distillation.weight * self.distillation.rows(own_logits(q, docs, scale, 0, len(q)), teacher).mean()

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        term = self._term(q, docs, scale)
        if not self.contrastive_weight:
            return term
        return self.contrastive_weight * self.inner.dense(q, docs, scale, bias, ids) + term

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The term on the problem gathered with gradient (the inner objective's convention: the
        same loss on every rank)."""
        queries, cols, _ = gathered_problem(q, docs, None, ranks)
        term = self._term(queries, cols, scale)
        if not self.contrastive_weight:
            return term
        return self.contrastive_weight * self.inner.microbatch(q, docs, scale, bias, ids, ranks) + term

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
        """The own rows' terms by autograd on [c, 1 + k] logits; their documents' gradients land
        in their columns of this rank's share."""
        c, n = len(q_own), num_queries
        teacher = self._teacher(n, len(docs))[first_row : first_row + c]
        acc = torch.promote_types(q_own.dtype, torch.float32)
        idx = own_columns(first_row, c, n, len(docs), docs.device)
        with torch.enable_grad():
            q_leaf = q_own.detach().to(acc).requires_grad_()
            d_leaf = docs[idx].detach().to(acc).requires_grad_()
            logits = scale.detach().to(acc) * torch.einsum("cd,ckd->ck", q_leaf, d_leaf)
            term = self.distillation.rows(logits, teacher).sum() * (self.distillation.weight / n)
            grad_rows, grad_own = torch.autograd.grad(term, (q_leaf, d_leaf))
        grad_cols = torch.zeros(docs.shape, dtype=acc, device=docs.device)
        grad_cols.index_put_((idx.flatten(),), grad_own.flatten(0, 1))
        loss = ranks.sum(term.detach().clone())
        scale_rows = row_scale_shares(q_leaf.detach(), grad_rows, scale)
        bias_rows = torch.zeros(c, dtype=acc, device=q_own.device) if self.has_bias else None
        if not self.contrastive_weight:
            return StreamResult(loss, grad_rows, grad_cols, scale_rows, bias_rows)
        w = self.contrastive_weight
        part = self.inner.streamed(
            q_own, docs, scale, bias,
            first_row=first_row, num_queries=n, chunk=chunk, ranks=ranks, kernel=kernel, ids=ids,
        )  # fmt: skip
        return StreamResult(
            w * part.loss + loss.to(part.loss.dtype),
            w * part.grad_rows + grad_rows.to(part.grad_rows.dtype),
            w * part.grad_cols + grad_cols.to(part.grad_cols.dtype),
            w * part.scale_rows + scale_rows.to(part.scale_rows.dtype),
            None if part.bias_rows is None else w * part.bias_rows,
        )
