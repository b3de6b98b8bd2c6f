"""Hardness weighting: harder negatives weigh more in the query -> document softmax.

For query i and a negative column j of the chosen kind, the logit S_ij = t <q_i, d_j> becomes
S_ij + alpha * sg(<q_i, d_j>) (sg: no gradient flows through it), so a negative the model already
scores close to the query takes a larger share of the softmax (Lan et al. 2025, LLaVE, Eq. 5;
EmbeddingGemma). `mode` says which negatives (sentence-transformers' `hardness_mode`):
- `in_batch_negatives`: every column that is not one of query i's documents (its positive and
  its own hard negatives);
- `hard_negatives`: query i's own hard negatives only;
- `all_negatives`: every column but the positive.
Only the query -> document candidates take it (not a symmetric loss's second direction nor a
joint direction's, as in sentence-transformers). Masked columns stay masked: the mask reads the
unweighted cosine. In a block of logits s <q, d> the weighted entries are s <q, d> (1 + alpha / s),
so the streamed forms apply it block by block, in the forward and in the recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import own_columns
from titan_contrastive.losses.streaming import BlockWeight

MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")


@dataclass(frozen=True)
class Hardness:
    """Which negatives are weighted, and by how much (strength 0: off)."""

    mode: str = "in_batch_negatives"
    strength: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"loss.hardness_mode={self.mode!r}: use one of {', '.join(MODES)}")
        if not self.strength >= 0:
            raise ValueError(f"loss.hardness_strength={self.strength}: use a number >= 0 (0: off)")

    @property
    def enabled(self) -> bool:
        return self.strength > 0

    def check(self, symmetric: bool) -> None:
        """ValueError for a weighting of a symmetric softmax loss, whose logits the document -> query direction
        shares."""
        if self.enabled and symmetric:
            raise ValueError(
                f"loss.hardness_strength={self.strength} weighs the query -> document softmax, and the symmetric loss "
                "shares its logits with the document -> query one: set loss.symmetric=false"
            )

    def describe(self) -> str:
        return f"hardness {self.strength:g} x cos on {self.mode.replace('_', ' ')}"

    def selected(self, rows: int, first_row: int, num_queries: int, num_columns: int, device) -> Tensor:
        """bool [rows, M]: the weighted columns of global rows first_row, first_row + 1, ..."""
        cols = own_columns(first_row, rows, num_queries, num_columns, device)
        if self.mode == "in_batch_negatives":
            return torch.ones(rows, num_columns, dtype=torch.bool, device=device).scatter_(1, cols, False)
        if self.mode == "hard_negatives":
            return torch.zeros(rows, num_columns, dtype=torch.bool, device=device).scatter_(1, cols[:, 1:], True)
        return torch.ones(rows, num_columns, dtype=torch.bool, device=device).scatter_(1, cols[:, :1], False)

    def dense(self, logits: Tensor, cosines: Tensor, first_row: int, num_queries: int) -> Tensor:
        """`logits` [rows, M] with alpha * sg(cos) added on the weighted columns."""
        chosen = self.selected(len(logits), first_row, num_queries, logits.shape[1], logits.device)
        return logits + self.strength * cosines.detach() * chosen

    def for_rows(self, first_row: int, num_queries: int, scale: float) -> BlockWeight:
        """The weighting of own rows first_row, ... as a `BlockWeight` on blocks of logits s <q, d>:
        the query's own 1 + k entries by index, and at most one multiply of the whole block."""
        factor = 1.0 + self.strength / scale

        def weight(block: Tensor, start: int) -> None:
            own = own_columns(first_row + start, len(block), num_queries, block.shape[1], block.device)
            if self.mode == "hard_negatives":
                block.scatter_(1, own[:, 1:], block.gather(1, own[:, 1:]).mul_(factor))
                return
            unweighted = own[:, :1] if self.mode == "all_negatives" else own
            kept = block.gather(1, unweighted)  # put back unchanged
            block.mul_(factor).scatter_(1, unweighted, kept)

        return weight
