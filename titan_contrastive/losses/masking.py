"""False-negative masking: which columns are not negatives of a query, decided without gradient.

For query i with positive column i (cosine c_ii = <q_i, d_i>), a column j != i is masked, that
is removed from query i's problem (out of the softmax denominator; out of the sigmoid sum), when
- `duplicates`: its id equals the positive's, `ids[j] == ids[i]` (the same document twice in the
  batch: a second positive, not a negative);
- `margin` (absolute): c_ij > c_ii + margin;
- `relative` (NV-Retriever's "percentage of positive"): c_ij > relative * c_ii.
The positive itself is never masked, and neither is a column that ties the threshold within
rounding (an exact duplicate of the positive under margin 0: the duplicate rule decides it). In
the symmetric softmax loss the document -> query direction uses the same mask, transposed:
query i is left out of positive j's denominator when column j is masked for query i. The margin
needs only c_ii, known before any block is formed, so the streamed forms apply the mask block
by block (`FalseNegatives.for_rows`) and stay exact. With a guide (`losses/guide.py`, GISTEmbed) the
margin and relative rules read the guide's cosines instead of the model's, the same in every form.

A query of a source without in-batch negatives (`data.in_batch_negatives`, FlagEmbedding's
`no_in_batch_neg`: classification and clustering data, whose other rows' documents are often of its own
class) is scored against its own documents only: every column but its positive and its hard negatives is
masked for it (`FalseNegatives.own_only`, the problem's flags, bound per problem by
`base.own_documents_only`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import row_dots
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.streaming import BlockMask


@dataclass(frozen=True)
class FalseNegatives:
    """Which false negatives are masked; all off is no mask."""

    duplicates: bool = False
    margin: float | None = None
    relative: float | None = None
    guide: Guide | None = dataclasses.field(default=None, compare=False, repr=False)
    """The guide's embeddings of this problem (`guided`); None: the rules read the model's cosines."""
    own_only: Tensor | None = dataclasses.field(default=None, compare=False, repr=False)
    """bool [N], one per query of this problem (`grouped`): True where the query is scored against its own
    documents only (its positive and hard negatives); None: every query against every column."""

    def guided(self, guide: Guide | None) -> FalseNegatives:
        """The same rules on the guide's cosines of one problem (None: the model's)."""
        return dataclasses.replace(self, guide=guide)

    def grouped(self, own_only: Tensor | None) -> FalseNegatives:
        """The same rules, and the flagged queries of one problem (bool [N]) against their own documents only."""
        return dataclasses.replace(self, own_only=own_only)

    @property
    def enabled(self) -> bool:
        return self.duplicates or self.margin is not None or self.relative is not None or self.own_only is not None

    def describe(self) -> str:
        parts = ["duplicate ids"] if self.duplicates else []
        if self.margin is not None:
            parts.append(f"cos > positive + {self.margin:g}")
        if self.relative is not None:
            parts.append(f"cos > {self.relative:g} x positive")
        if self.own_only is not None:
            parts.append("another query's document, for queries without in-batch negatives")
        return " or ".join(parts)

    def dense(self, q: Tensor, docs: Tensor, ids: Tensor | None, first_row: int = 0) -> Tensor | None:
        """bool [len(q), M], True where masked, for the queries `q` (global rows first_row, ...;
        default all) against all columns `docs`; None when nothing is masked."""
        if not self.enabled:
            return None
        return self.for_rows(q, docs, 1.0, first_row, ids)(q.detach() @ docs.detach().T, 0)

    def for_rows(self, q_own: Tensor, docs: Tensor, scale: float, first_row: int, ids: Tensor | None) -> BlockMask:
        """The mask of the rows `q_own` (global rows first_row, ...) as a `BlockMask`: it reads a block
        of logits s * <q, d> of own rows start, start + 1, ... against all columns."""
        with torch.no_grad():
            positive = scale * (q_own * docs[first_row : first_row + len(q_own)]).sum(1).to(torch.float64)
        return self.for_keys(positive, scale, first_row, docs.shape[1], ids, ids)

    def for_keys(
        self,
        positive: Tensor,
        scale: float,
        first_row: int,
        dim: int,
        key_ids: Tensor | None,
        ids: Tensor | None,
        sides: tuple[str, str] = ("q", "d"),
    ) -> BlockMask:
        """The mask of own rows first_row, ... whose positive logits s * <q_i, p_i> are `positive`,
        against any keys (the columns, or the queries of a joint direction, `losses/directions.py`)
        whose ids are `key_ids`; `ids`: the columns' ids (the rows' positives are ids[first_row...]).
        The key at index first_row + r of row r is its positive (or its own query), never masked.
        `sides`: what the rows and keys are (`directions.SIDES`), for the guide's cosines."""
        if self.duplicates and (ids is None or key_ids is None):
            raise ValueError(
                "loss.mask_duplicates needs an id per document: call the loss with ids= (e.g. "
                "titan_contrastive.batching.document_ids of the documents' token ids)"
            )
        similarity = None  # the block's own logits
        if self.guide is not None and (self.margin is not None or self.relative is not None):
            rows_at = slice(first_row, first_row + len(positive))
            guide_rows, guide_keys = self.guide.side(sides[0])[rows_at], self.guide.side(sides[1])
            with torch.no_grad():
                positive = row_dots(self.guide.queries[rows_at], self.guide.columns[rows_at], torch.float64)
            scale, dim = 1.0, guide_keys.shape[1]

            def similarity(block: Tensor, start: int) -> Tensor:
                with torch.no_grad():
                    return guide_rows[start : start + len(block)] @ guide_keys.T

        thresholds = []
        if self.margin is not None:
            thresholds.append(positive + scale * self.margin)
        if self.relative is not None:
            thresholds.append(positive * self.relative)
        threshold = torch.minimum(*thresholds) if len(thresholds) == 2 else (thresholds[0] if thresholds else None)
        pos_ids = ids[first_row : first_row + len(positive)] if self.duplicates else None
        own_only = self.own_only

        def mask(block: Tensor, start: int) -> Tensor | None:
            rows = slice(start, start + len(block))
            masked = None
            if threshold is not None:
                cosines = block if similarity is None else similarity(block, start)
                # above the threshold by more than rounding: an exact duplicate of the positive (a tie) is
                # never masked by the margin, whichever summation order computed the block
                tie = 4 * dim**0.5 * torch.finfo(cosines.dtype).eps * max(scale, 1.0)
                masked = cosines > threshold[rows, None].to(cosines.dtype) + tie
            if pos_ids is not None:
                same = key_ids[None, :] == pos_ids[rows, None]
                masked = same if masked is None else masked | same
            r = torch.arange(len(block), device=block.device)
            if own_only is not None:
                row = first_row + start + r
                others = own_only[row, None] & (
                    owners(len(own_only), block.shape[1], block.device)[None, :] != row[:, None]
                )
                masked = others if masked is None else masked | others
            if masked is not None:
                masked[r, first_row + start + r] = False  # the positive stays
            return masked

        return mask


def owners(num_queries: int, num_keys: int, device: torch.device) -> Tensor:
    """int64 [num_keys]: the query whose document each key is, in the layout of `base.columns` (positive i is
    query i's, hard negative N + i k + t too); keys that are the queries themselves are their own."""
    k = max((num_keys - num_queries) // num_queries, 1)
    j = torch.arange(num_keys, device=device)
    return torch.where(j < num_queries, j, (j - num_queries) // k)
