"""Adaptive layers: the objective on the last layer's embeddings and on earlier layers' (`[loss] adaptive_layers`).

In training, a model with earlier exits (the bi_encoder: each listed layer's hidden states pooled, through the
folder's Dense layers and normalized as the last layer's are) gives each text its embeddings side by side,
[x_L | x_k1 | x_k2 ...], each d wide. With the inner objective L (Matryoshka's prefixes too) and K exits,

    loss = L(x_L) + sum_k w_k L(x_k) + a T sum_k 1/R sum over the R texts of KL(softmax(x_L / T) || softmax(x_k / T))

over the problem's R = N + M texts (queries, positives, hard negatives), the last layer's softmax held without
gradient (it teaches). This is sentence-transformers' AdaptiveLayerLoss with every listed layer at every step
(its `n_layers_per_step` draws one at random per step, here the layers are chosen: Starbucks' fixed sizes), weights
w_k (default 1/K, its "uniform"), a = `adaptive_kl_weight` and T = `adaptive_kl_temperature` (0: no KL term);
Matryoshka inside it is its Matryoshka2dLoss.

Each exit is its own problem of the inner objective; a text's KL reads its own embeddings alone. So every form is
exact as the inner one is: the dense and microbatch forms by autograd, the streamed form the inner's per exit and
each text's KL in closed form on the rank that owns its row (`own_columns`): d/dx_k = a (softmax(x_k / T) -
softmax(x_L / T)) / R. Evaluation embeds with the last layer alone, and its loss is the inner objective's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import Objective, Ranks, StreamResult, Wrapping, gathered_problem, own_columns
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

    def __post_init__(self) -> None:
        if not self.weights or self.width <= 0:
            raise ValueError(f"adaptive layers: {len(self.weights)} exits of width {self.width}; need at least one")

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
        return f"{self.inner.describe()}, at the last layer and {len(self.weights)} earlier (x {exits}){kl}"

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

    def _pairs(self) -> list[tuple[int, float]]:
        return [(0, 1.0), *((k + 1, w) for k, w in enumerate(self.weights))]

    def _kl_term(self, rows: Tensor) -> Tensor:
        """a T sum_k 1/R sum over `rows` [R, (1 + K) d] of KL(softmax(x_L / T) || softmax(x_k / T)) (autograd)."""
        last, *earlier = self._blocks(rows)
        t = self.kl_temperature
        target = torch.softmax(last.detach() / t, -1)
        total = sum(
            torch.nn.functional.kl_div(torch.log_softmax(x / t, -1), target, reduction="batchmean") for x in earlier
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
        parts = [
            self.inner.streamed(
                qs[i], ds[i], scale, bias,
                first_row=first_row, num_queries=num_queries, chunk=chunk, ranks=ranks, kernel=kernel, ids=ids,
            )
            for i, _ in self._pairs()
        ]  # fmt: skip
        weights = [w for _, w in self._pairs()]
        loss = sum(w * p.loss for w, p in zip(weights, parts))
        grad_rows = torch.cat([w * p.grad_rows for w, p in zip(weights, parts)], -1)
        grad_cols = torch.cat([w * p.grad_cols for w, p in zip(weights, parts)], -1)
        scale_rows = sum(w * p.scale_rows for w, p in zip(weights, parts))
        has_bias = parts[0].bias_rows is not None
        bias_rows = sum(w * p.bias_rows for w, p in zip(weights, parts)) if has_bias else None
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
        loss, grads = texts.new_zeros((), dtype=acc), [torch.zeros_like(last)]
        for x in earlier:
            log_q = torch.log_softmax(x / t, -1)
            loss = loss + (target * (target.clamp_min(1e-45).log() - log_q)).sum() * factor * t
            grads.append((log_q.exp() - target) * factor)
        return loss, torch.cat(grads, -1)
