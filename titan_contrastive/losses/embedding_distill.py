"""Embedding distillation: the model's embeddings regressed onto a frozen teacher's (`[loss] distill = "mse"`).

With the teacher's unit embeddings g (a teacher model's, `teacher_model`, or written ahead, `teacher_embeddings`;
`losses/guide.py`'s `Guide`) of the problem's N queries and M columns (positives, then hard negatives), of the
model's width d, and the model's embeddings x of the same N + M texts,

    L_d = 1/((N + M) d) sum over the N + M texts of |x - g|^2

the mean squared error over every number, sentence-transformers' MSELoss (which compares each column of a row with
the row's label: the same when a file gives a translation the embedding of its source, as multilingual
distillation does). The run's loss is contrastive_weight x the contrastive objective + distill_weight x L_d.

Each text's term reads only its own embedding, so every form is exact as it stands: the dense and microbatch forms
on the gathered problem by autograd, the streamed form on a rank's own rows and their own documents' columns
(`own_columns`), each column counted by the one rank whose row it belongs to, in closed form:
dL/dx = 2 w (x - g) / ((N + M) d). The term does not read the temperature or the bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import Ranks, own_columns
from titan_contrastive.losses.distill import TeacherTerm
from titan_contrastive.losses.guide import Guide


@dataclass(frozen=True)
class EmbeddingDistilled(TeacherTerm):
    """A contrastive objective plus the embedding MSE to a teacher's (`TeacherTerm`, `distillation` of kind "mse");
    see the module docstring. `teacher`: the teacher's embeddings of the problem, a `Guide`."""

    def describe(self) -> str:
        term = f"{self.distillation.weight:g} x the MSE of the embeddings to the teacher's ({self.distillation.model})"
        if not self.contrastive_weight:
            return f"{term}, without the contrastive objective"
        return f"{self.contrastive_weight:g} x {self.inner.describe()} + {term}"

    def _teacher(self, num_queries: int, num_columns: int, width: int) -> Guide:
        """The bound teacher, checked against the problem's shape and the model's width."""
        teacher, key = self.teacher, self.distillation.model
        if not isinstance(teacher, Guide):
            raise ValueError(
                "loss.distill=mse: no teacher for this problem; the step must bind the teacher's embeddings"
            )
        if (len(teacher.queries), len(teacher.columns)) != (num_queries, num_columns):
            raise ValueError(
                f"{key}: embeddings of {len(teacher.queries)} queries and {len(teacher.columns)} columns for a "
                f"problem of {num_queries} and {num_columns}"
            )
        if teacher.queries.shape[-1] != width:
            raise ValueError(
                f"{key}: {teacher.queries.shape[-1]}-wide embeddings, and the model's are {width}-wide; "
                "loss.distill=mse compares them number by number: use a teacher of the model's width, or "
                "loss.distill=kl"
            )
        return teacher

    def _term(self, q: Tensor, docs: Tensor, scale: Tensor) -> Tensor:
        """weight x L_d of a whole problem (autograd)."""
        g = self._teacher(len(q), len(docs), q.shape[-1])
        diff = torch.cat([q - g.queries.to(q.dtype), docs - g.columns.to(docs.dtype)])
        return self.distillation.weight * diff.square().mean()

    def _share(
        self, q_own: Tensor, docs: Tensor, scale: Tensor, first_row: int, num_queries: int, chunk: int, ranks: Ranks
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The own rows' and their own documents' terms and gradients, in closed form."""
        n, c, acc = num_queries, len(q_own), torch.promote_types(q_own.dtype, torch.float32)
        g = self._teacher(n, len(docs), docs.shape[-1])
        idx = own_columns(first_row, c, n, len(docs), docs.device)
        factor = self.distillation.weight / ((n + len(docs)) * docs.shape[-1])
        rows = q_own.detach().to(acc) - g.queries[first_row : first_row + c].to(acc)
        own_docs = docs[idx].detach().to(acc) - g.columns[idx].to(acc)
        loss = ranks.sum((rows.square().sum() + own_docs.square().sum()) * factor)
        grad_cols = torch.zeros(docs.shape, dtype=acc, device=docs.device)
        grad_cols.index_put_((idx.flatten(),), own_docs.mul_(2 * factor).flatten(0, 1))
        return loss, rows.mul_(2 * factor), grad_cols, torch.zeros(c, dtype=acc, device=q_own.device)
