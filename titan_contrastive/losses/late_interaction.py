"""Late interaction (ColBERT's MaxSim): InfoNCE over a score that reads every token of both sides.

A multi-vector embedding is one row [L * d]: L token vectors of width d (`token_dim`) laid end to end,
a token that does not count (padding, a skipped punctuation mark) being the zero vector. The score of
query i and document j is

    S_ij = t sum_a max_b <q_ia, d_jb>        (b over the document's tokens that are not zero)

(t = exp(t'), the model's temperature multiplier), divided by query i's token count (those not zero) where
`normalize` (ColPali's `normalize_scores`), and the loss is InfoNCE over S as in `infonce.py`:
one-way, -1/N sum_i log softmax_j(S_i)[i] (PyLate's Contrastive), or symmetric. A zero query token adds
nothing (its products are all 0). MaxSim is positively homogeneous in q, so dL/dt = <q, dL/dq> / t per
row, as for the dot product (`base.row_scale_shares`); the token count does not depend on q's values.

The false-negative masks (`masking.py`: duplicate ids, margin, relative; colpali-engine's positive-aware
negative filtering removes rather than halves) and hardness weighting (`hardness.py`) apply as for the dot
product, with MaxSim (over the token count where `normalize`) in the place of the cosine: a column whose
MaxSim exceeds the positive's by the margin, or `relative` times it, leaves the query's problem; a guide
(`guide.py`) decides by its own cosines instead. Each query's positive MaxSim is computed first, without
gradient, so the streamed form masks block by block as the dot product's does.

The scores are formed in tiles that the backward recomputes (`maxsim.py`), never all at once, so the
streamed form keeps O(chunk x M) logits, as every other objective's, and the microbatch form keeps only
its inputs (`MaxSimScores`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.base import Objective, Ranks, StreamResult, gathered_problem, row_scale_shares
from titan_contrastive.losses.distill import Distilled
from titan_contrastive.losses.guide import Guide
from titan_contrastive.losses.hardness import Hardness
from titan_contrastive.losses.late_sigmoid import LateSigmoid
from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.matryoshka import Matryoshka
from titan_contrastive.losses.maxsim import (
    MaxSimScored,
    MaxSimScores,
    maxsim_mask,
    pair_products,
    scores,
    tile_grads,
    token_products,
)
from titan_contrastive.losses.pairwise import Pairwise
from titan_contrastive.losses.sigmoid import Sigmoid
from titan_contrastive.losses.streaming import BlockMask, BlockWeight, accumulation_dtype


@dataclass(frozen=True)
class LateInteraction(MaxSimScored):
    """InfoNCE over MaxSim scores of multi-vector embeddings `token_dim` wide per token; see the module docstring."""

    token_dim: int
    symmetric: bool = False
    normalize: bool = False
    false_negatives: FalseNegatives = field(default_factory=FalseNegatives)
    hardness: Hardness = field(default_factory=Hardness)
    """Hardness weighting of the query -> document negatives, by MaxSim (`hardness.py`)."""
    name: str = "clip"
    has_bias = False
    kernel_kind = "softmax"
    init_logit_scale = 0.0  # t = 1: PyLate's temperature
    init_logit_bias = None

    def __post_init__(self) -> None:
        self.hardness.check(self.symmetric)

    @property
    def needs_ids(self) -> bool:
        return self.false_negatives.duplicates

    def with_guide(self, guide: Guide | None) -> LateInteraction:
        return dataclasses.replace(self, false_negatives=self.false_negatives.guided(guide))

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return False

    def describe(self) -> str:
        options = ["symmetric" if self.symmetric else "one-way"]
        if self.hardness.enabled:
            options.append(self.hardness.describe().replace("cos", "MaxSim"))
        if self.false_negatives.enabled:
            options.append(f"false negatives masked ({self.false_negatives.describe().replace('cos', 'MaxSim')})")
        per = ", over each query's tokens" if self.normalize else ""
        return (
            f"{self.name} loss (InfoNCE over late interaction, MaxSim of {self.token_dim}-wide tokens{per}, "
            f"{', '.join(options)})"
        )

    def _mask(self, q_own: Tensor, docs: Tensor, scale: float, first_row: int, ids: Tensor | None) -> BlockMask | None:
        return maxsim_mask(self.false_negatives, q_own, docs, self.token_dim, self.normalize, scale, first_row, ids)

    def _weighed(self, logits: Tensor, mask: BlockMask | None, weight: BlockWeight | None, start: int) -> Tensor:
        """A block of logits (own rows start, ...), masked entries -inf and the hardness weight applied, in place."""
        if mask is not None and (masked := mask(logits, start)) is not None:
            logits.masked_fill_(masked, -math.inf)
        if weight is not None:
            weight(logits, start)
        return logits

    def _logits(self, q: Tensor, docs: Tensor, scale: Tensor, products: Tensor, ids: Tensor | None) -> Tensor:
        """The whole problem's logits from its MaxSim `products` (with autograd): scaled, weighted and masked."""
        logits = scale.to(products.dtype) * products
        if self.hardness.enabled:
            logits = self.hardness.dense(logits, products, 0, len(q))
        mask = self._mask(q, docs, 1.0, 0, ids)
        if mask is not None and (masked := mask(products.detach(), 0)) is not None:
            logits = logits.masked_fill(masked, -math.inf)
        return logits

    def _loss(self, logits: Tensor) -> Tensor:
        n = len(logits)
        labels = torch.arange(n, device=logits.device)
        loss = F.cross_entropy(logits, labels)
        return 0.5 * (loss + F.cross_entropy(logits[:, :n].T, labels)) if self.symmetric else loss

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        """The definition on whole tensors (autograd; materialises every token product)."""
        return self._loss(self._logits(q, docs, scale, token_products(q, docs, self.token_dim, self.normalize), ids))

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        """The loss over all ranks' embeddings gathered with gradient (as `InfoNCE.microbatch`), the scores in
        tiles that the backward recomputes."""
        queries, cols, col_ids = gathered_problem(q, docs, ids, ranks)
        products = MaxSimScores.apply(queries, cols, self.token_dim, self.normalize)
        return self._loss(self._logits(queries, cols, scale, products, col_ids))

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
        """The own rows against all columns, `chunk` rows at a time: the row (and, symmetric, the positives'
        column) log-sum-exps in one pass, merged over ranks; then each block again for dL/dS and its tiles'
        gradients. Masks and weights apply to each block in both passes."""
        n, c, dim, s, norm = num_queries, len(q_own), self.token_dim, float(scale), self.normalize
        mask = self._mask(q_own, docs, s, first_row, ids)
        weight = self.hardness.for_rows(first_row, n, s) if self.hardness.enabled else None

        def block(start: int) -> Tensor:
            return self._weighed(scores(q_own[start : start + chunk], docs, dim, norm).mul_(s), mask, weight, start)

        acc = accumulation_dtype(q_own)
        row_lse = torch.empty(c, dtype=acc, device=q_own.device)
        positive = torch.empty(c, dtype=acc, device=q_own.device)
        col_part = torch.full((n,), -math.inf, dtype=acc, device=q_own.device)
        blocks = range(0, c, chunk)
        for start in blocks:
            logits = block(start)
            row_lse[start : start + chunk] = logits.logsumexp(1)
            positive[start : start + chunk] = logits.diagonal(first_row + start)  # each row's own column
            if self.symmetric:
                col_part = torch.logaddexp(col_part, logits[:, :n].logsumexp(0))
        col_lse = ranks.merge_lse(col_part) if self.symmetric else None
        terms = (row_lse - positive).sum()
        if col_lse is not None:
            terms = terms + (col_lse[first_row : first_row + c] - positive).sum()
        loss = ranks.sum(terms.clone()) / (2 * n if self.symmetric else n)
        grad_rows = torch.empty(q_own.shape, dtype=acc, device=q_own.device)
        grad_cols = torch.zeros(docs.shape, dtype=acc, device=q_own.device)
        coef = s / (2 * n) if self.symmetric else s / n
        for start in blocks:
            rows = q_own[start : start + chunk]
            w = block(start)
            p = (w - row_lse[start : start + len(rows), None]).exp()
            if col_lse is not None:
                p[:, :n] += (w[:, :n] - col_lse[None, :]).exp()
            p.diagonal(first_row + start).sub_(2 if self.symmetric else 1)
            gq, gd = tile_grads(rows, docs, dim, p.mul_(coef), norm)
            grad_rows[start : start + len(rows)] = gq
            grad_cols += gd
        return StreamResult(loss, grad_rows, grad_cols, row_scale_shares(q_own, grad_rows, scale), None)


@dataclass(frozen=True)
class LatePairwise(Pairwise, MaxSimScored):
    """The pairwise loss (`pairwise.py`) over MaxSim scores of tokens `token_dim` wide: colpali-engine's
    ColbertPairwiseCELoss (ColPali's and ColQwen2's training loss), ColbertPairwiseNegativeCELoss and
    ColbertNegativeCELoss."""

    token_dim: int = 0
    normalize: bool = False

    def _scored_by(self) -> str:
        per = ", over each query's tokens" if self.normalize else ""
        return f"MaxSim of {self.token_dim}-wide tokens{per}"

    def _every_score(self, q: Tensor, docs: Tensor) -> Tensor:
        return token_products(q, docs, self.token_dim, self.normalize)

    def _scores_without_grad(self, q: Tensor, docs: Tensor) -> Tensor:
        return scores(q, docs, self.token_dim, self.normalize)

    def _own_scores(self, q: Tensor, docs: Tensor) -> Tensor:
        return pair_products(q, docs, self.token_dim, self.normalize)

    def _row_scores(self, q: Tensor, docs: Tensor) -> Tensor:
        return MaxSimScores.apply(q, docs, self.token_dim, self.normalize)

    def _judged_by(self) -> str:
        return "MaxSim"

    def _mask_of(self, rows: Tensor, docs: Tensor, first_row: int, ids: Tensor | None) -> BlockMask:
        mask = maxsim_mask(self.false_negatives, rows, docs, self.token_dim, self.normalize, 1.0, first_row, ids)
        assert mask is not None  # called only with a rule on
        return mask


def late_interaction(objective: object, token_dim: int, normalize: bool = False) -> Objective:
    """The late-interaction twin of a run's objective for multi-vector embeddings `token_dim` wide per token
    (`[model] pooling = "colbert"`; `normalize`: `[loss] maxsim_normalize`): plain InfoNCE, one-way or symmetric,
    the sigmoid loss or the pairwise loss, with or without a distillation term on the data's scores (its logits
    MaxSim over each query's own documents, PyLate's Distillation), at Matryoshka prefixes of each token or not;
    ValueError naming what else it holds."""
    from titan_contrastive.losses.infonce import InfoNCE

    if isinstance(objective, Matryoshka):  # each token's prefixes
        late = dataclasses.replace(objective, inner=late_interaction(objective.inner, token_dim, normalize))
        late.check_dim(token_dim)
        return late
    if isinstance(objective, Distilled):
        distillation = objective.distillation
        if distillation.model:
            raise ValueError(
                f"{distillation.model} scores every column by one vector per text, and model.pooling=colbert gives "
                f"tokens: distill from the data's scores (a scores column) and leave {distillation.model} empty"
            )
        if distillation.similarity != "cosine":
            raise ValueError(
                f"loss.cosent_similarity={distillation.similarity} reads one vector per text, and "
                "model.pooling=colbert scores pairs by MaxSim: leave it at cosine"
            )
        return dataclasses.replace(objective, inner=late_interaction(objective.inner, token_dim, normalize))
    if isinstance(objective, Pairwise):
        return LatePairwise(
            objective.in_batch_weight,
            objective.in_batch,
            objective.false_negatives,
            token_dim=token_dim,
            normalize=normalize,
        )
    if isinstance(objective, Sigmoid):
        return LateSigmoid(objective.false_negatives, token_dim=token_dim, normalize=normalize)
    if not isinstance(objective, InfoNCE) or objective.name != "clip":
        raise ValueError(
            f"model.pooling=colbert scores by late interaction, which InfoNCE (loss.name=clip), the sigmoid loss "
            f"(siglip) and the pairwise loss (pairwise) take, not {objective.describe()}: set loss.name=clip, siglip "  # type: ignore[attr-defined]
            "or pairwise and remove the terms around it"
        )
    if objective.directions:
        raise ValueError(
            f"model.pooling=colbert scores by late interaction, and loss.joint_directions={list(objective.directions)} "
            "scores queries against queries and documents against documents by dot products: remove "
            "loss.joint_directions"
        )
    return LateInteraction(token_dim, objective.symmetric, normalize, objective.false_negatives, objective.hardness)
