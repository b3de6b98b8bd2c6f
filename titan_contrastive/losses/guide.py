"""A guide model's embeddings of a contrastive problem (GISTEmbed, Solatorio 2024): with a guide, the
margin and relative false-negative masks (`losses/masking.py`) compare the guide's cosines, not the
model's, so a strong frozen embedder decides which in-batch candidates are too close to a query's
positive to be its negatives while a smaller model trains.

The guide's embeddings carry no gradient and the loss is the model's, so every form of an objective
stays exact with the same mask: the dense and microbatch forms read the guide's block of the whole
problem, the streamed forms the guide's rows of each block. The steps compute them per batch with
the run's frozen model (`StepContext.guide_of`) and hand them to the loss as `guide=`; the same
embeddings of a teacher model (`[loss] teacher_model`) are a distillation's targets (`teacher=`,
`losses/distill.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_contrastive.losses.base import Ranks, columns, split_documents


@dataclass(frozen=True)
class Guide:
    """The guide's unit embeddings of a whole problem: `queries` [N, dg] and `columns` [M, dg], the
    positives then the hard negatives in the problem's column order (`base.columns`)."""

    queries: Tensor
    columns: Tensor
    _targets: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def gathered(cls, queries: Tensor, docs: Tensor, ranks: Ranks) -> Guide:
        """The problem over all ranks of the local `queries` [b, dg] and documents `docs` [b, dg] (or
        [b, 1 + k, dg] with hard negatives), laid out like the model's gathered columns."""
        positives, negatives = split_documents(docs)
        gathered = columns(ranks.gather(positives), None if negatives is None else ranks.gather(negatives))
        return cls(ranks.gather(queries), gathered)

    def side(self, name: str) -> Tensor:
        """The queries ("q") or the columns ("p", "d": the positives are the first N columns)."""
        return self.queries if name == "q" else self.columns

    def targets(self, temperature: float, dtype: torch.dtype, transposed: bool = False) -> Tensor:
        """[N, M]: softmax(G_q G_c^T / temperature) over each row in `dtype`, a teacher's distribution over every
        column of the whole problem; `transposed`: [N, N], each positive column's over the queries,
        softmax(G_c[:N] G_q^T / temperature). Computed once per (temperature, dtype, direction), as Matryoshka's
        prefixes each read it."""
        key = (temperature, dtype, transposed)
        if key not in self._targets:
            scores = self.columns[: len(self.queries)] @ self.queries.T if transposed else self.queries @ self.columns.T
            self._targets[key] = torch.softmax(scores.to(dtype) / temperature, 1)
        return self._targets[key]
