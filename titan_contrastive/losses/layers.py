"""Adaptive layers: the objective on the last layer's embeddings and on earlier layers' (`[loss] adaptive_layers`).

In training, a model with earlier exits (the bi_encoder: each listed layer's hidden states, through a decoder's
final norm with `adaptive_final_norm`, pooled, through the folder's Dense layers and normalized as the last layer's
are) gives each text its embeddings side by side,
[x_L | x_k1 | x_k2 ...], each d wide. With the inner objective L (Matryoshka's prefixes too) and K exits,

    loss = L(x_L) + sum_k w_k L(x_k) + a T sum_k 1/R sum over the R texts of KL(softmax(x_L / T) || softmax(x_k / T))

over the problem's R = N + M texts (queries, positives, hard negatives), the last layer's softmax held without
gradient (it teaches). This is sentence-transformers' AdaptiveLayerLoss, weights w_k (default 1/K, its "uniform"),
a = `adaptive_kl_weight` and T = `adaptive_kl_temperature` (0: no KL term); Matryoshka inside it is its
Matryoshka2dLoss. By default every listed layer trains at every step (Starbucks' fixed sizes; its
`n_layers_per_step=-1`); with `per_step` = n, n of the K are drawn at each optimizer step (`at_step`, from the
seed and the step: the same on every rank and in every pass), each sum and KL term over the drawn alone, each
weighted K / n times its w_k (its `n_layers_per_step=n`).

Each exit is its own problem of the inner objective; a text's KL reads its own embeddings alone. So every form is
exact as the inner one is: the dense and microbatch forms by autograd, the streamed form the inner's per exit and
each text's KL in closed form on the rank that owns its row (`own_columns`): d/dx_k = a (softmax(x_k / T) -
softmax(x_L / T)) / R. Evaluation embeds with the last layer alone, and its loss is the inner objective's.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import (
    Objective,
    Ranks,
    StreamResult,
    Wrapping,
    at_step,
    gathered_problem,
    own_columns,
)
from titan_contrastive.losses.guide import Guide


@dataclass(frozen=True)
class AdaptiveLayers(Wrapping):
    inner: Objective
    width: int
    """d: one exit's embedding width (the model's)."""
    weights: tuple[float, ...]
    """w_k, one per earlier exit."""
    kl_weight: float = 1.0
    kl_temperature: float = 0.3
    per_step: int = 0
    """Earlier exits drawn at each optimizer step (`at_step`), each weighted K / per_step times its weight; 0: all."""
    seed: int = 0
    """The draws' seed (`[training] seed`): the same draw on every rank and in every pass of a step."""
    drawn: tuple[int, ...] | None = None
    """The earlier exits (0-based) this copy trains (`at_step`); None: all."""

    def __post_init__(self) -> None:
        if not self.weights or self.width <= 0:
            raise ValueError(f"adaptive layers: {len(self.weights)} exits of width {self.width}; need at least one")
        if not 0 <= self.per_step <= len(self.weights):
            raise ValueError(
                f"loss.adaptive_layers_per_step={self.per_step}: draws from {len(self.weights)} layers; give 0 (all) "
                f"to {len(self.weights)}"
            )

    def at_step(self, step: int) -> AdaptiveLayers:
        """Itself at optimizer step `step`: its inner objective's, and with `per_step` the exits drawn for the step
        (uniformly without replacement, from `seed` and `step` alone)."""
        inner = at_step(self.inner, step)
        if not self.per_step or self.per_step == len(self.weights):
            return dataclasses.replace(self, inner=inner)
        draw = random.Random(f"{self.seed}:{step}").sample(range(len(self.weights)), self.per_step)
        return dataclasses.replace(self, inner=inner, drawn=tuple(sorted(draw)))

    def with_guide(self, guide: Guide | None) -> AdaptiveLayers:
        return dataclasses.replace(self, inner=self.inner.with_guide(guide))

    def with_teacher(self, teacher: Tensor) -> AdaptiveLayers:
        """The teacher's scores (or embeddings), the same at every exit."""
        return dataclasses.replace(self, inner=self.inner.with_teacher(teacher))

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return self.inner.fused(num_queries, num_columns)

    def describe(self) -> str:
        exits = ", ".join(f"{w:g}" for w in self.weights)
        kl = f", KL to the last at T {self.kl_temperature:g} x {self.kl_weight:g}" if self._kl else ""
        drawn = f", {self.per_step} of them drawn per step" if self.per_step else ""
        return f"{self.inner.describe()}, at the last layer and {len(self.weights)} earlier (x {exits}){drawn}{kl}"

    @property
    def _kl(self) -> bool:
        return bool(self.kl_weight and self.kl_temperature)

    def _blocks(self, z: Tensor) -> list[Tensor]:
        """The exits' embeddings of `z` [rows, (1 + K) d]: the last layer's first."""
        count = 1 + len(self.weights)
        if z.shape[-1] != count * self.width:
            raise ValueError(
                f"loss.adaptive_layers: embeddings of {z.shape[-1]} dims, and the model's last layer and "
                f"{count - 1} earlier ones give {count} x {self.width}; the model must embed at every exit in training"
            )
        return list(z.split(self.width, -1))

    def _active(self) -> list[int]:
        """The earlier exits (0-based) this copy trains."""
        return list(range(len(self.weights))) if self.drawn is None else list(self.drawn)

    def _pairs(self) -> list[tuple[int, float]]:
        """(block, weight) of the last layer and of each trained earlier exit (drawn: K / per_step times its own)."""
        share = len(self.weights) / len(self._active())
        return [(0, 1.0), *((k + 1, self.weights[k] * share) for k in self._active())]

    def _kl_term(self, rows: Tensor) -> Tensor:
        """a T sum_k 1/R sum over `rows` [R, (1 + K) d] of KL(softmax(x_L / T) || softmax(x_k / T)) (autograd)."""
        last, *earlier = self._blocks(rows)
        t = self.kl_temperature
        target = torch.softmax(last.detach() / t, -1)
        total = sum(
            torch.nn.functional.kl_div(torch.log_softmax(earlier[k] / t, -1), target, reduction="batchmean")
            for k in self._active()
        )
        return self.kl_weight * t * total

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        qs, ds = self._blocks(q), self._blocks(docs)
        loss = sum(w * self.inner.dense(qs[i], ds[i], scale, bias, ids) for i, w in self._pairs())
        return loss + self._kl_term(torch.cat([q, docs])) if self._kl else loss

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        positives, negatives = docs
        qs, ps = self._blocks(q), self._blocks(positives)
        ns = [None] * len(qs) if negatives is None else self._blocks(negatives)
        loss = sum(w * self.inner.microbatch(qs[i], (ps[i], ns[i]), scale, bias, ids, ranks) for i, w in self._pairs())
        if not self._kl:
            return loss
        queries, cols, _ = gathered_problem(q, docs, None, ranks)  # the term on the whole problem, on every rank
        return loss + self._kl_term(torch.cat([queries, cols]))

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
        """The inner objective's streamed form per exit, weighted, side by side; then each own text's KL."""
        qs, ds = self._blocks(q_own), self._blocks(docs)
        parts = {
            i: (w, self.inner.streamed(
                qs[i], ds[i], scale, bias,
                first_row=first_row, num_queries=num_queries, chunk=chunk, ranks=ranks, kernel=kernel, ids=ids,
            ))
            for i, w in self._pairs()
        }  # fmt: skip
        last = parts[0][1]
        loss = sum(w * p.loss for w, p in parts.values())
        blocks = range(1 + len(self.weights))
        grad_rows = torch.cat([_weighted(parts, i, "grad_rows") for i in blocks], -1)
        grad_cols = torch.cat([_weighted(parts, i, "grad_cols") for i in blocks], -1)
        scale_rows = sum(w * p.scale_rows for w, p in parts.values())
        bias_rows = None if last.bias_rows is None else sum(w * p.bias_rows for w, p in parts.values())
        if self._kl:
            idx = own_columns(first_row, len(q_own), num_queries, len(docs), docs.device).flatten()
            count = num_queries + len(docs)
            rows_loss, rows_grad = self._kl_share(q_own, count)
            cols_loss, cols_grad = self._kl_share(docs[idx], count)
            loss = loss + ranks.sum(rows_loss + cols_loss).to(loss.dtype)
            grad_rows = grad_rows + rows_grad.to(grad_rows.dtype)
            grad_cols = grad_cols.index_add(0, idx, cols_grad.to(grad_cols.dtype))
        return StreamResult(loss, grad_rows, grad_cols, scale_rows, bias_rows)

    def _kl_share(self, texts: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """The KL term of `texts` [r, (1 + K) d] over a problem of `count` texts, and its gradient (none at the last
        layer's block), in the accumulation dtype."""
        acc = torch.promote_types(texts.dtype, torch.float32)
        last, *earlier = self._blocks(texts.detach().to(acc))
        t, factor = self.kl_temperature, self.kl_weight / count
        target = torch.softmax(last / t, -1)
        loss, grads = texts.new_zeros((), dtype=acc), [torch.zeros_like(last) for _ in range(1 + len(earlier))]
        for k in self._active():
            log_q = torch.log_softmax(earlier[k] / t, -1)
            loss = loss + (target * (target.clamp_min(1e-45).log() - log_q)).sum() * factor * t
            grads[k + 1] = (log_q.exp() - target) * factor
        return loss, torch.cat(grads, -1)


def _weighted(parts: dict[int, tuple[float, StreamResult]], block: int, field: str) -> Tensor:
    """`field` of `block`'s streamed result times its weight; zeros for an exit not trained at this step."""
    if block in parts:
        weight, part = parts[block]
        return weight * getattr(part, field)
    return torch.zeros_like(getattr(parts[0][1], field))
