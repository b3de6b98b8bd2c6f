"""Matryoshka embeddings: one objective at several leading-dimension prefixes, weighted.

L = sum_m w_m L(normalize(q[:, :m]), normalize(D[:, :m])) for `dims` m (e.g. 384, 256, 128, 64)
and `weights` w_m, as sentence-transformers' MatryoshkaLoss (which truncates the embeddings and
lets the cosine similarity renormalize them). Each prefix is its own problem, false-negative
margins included (a guide's masks, `losses/guide.py`, are the same at every prefix). Under
GradCache and the streamed step the cached gradient is the sum over the prefixes, so each sample
is still re-forwarded once. Under late interaction (an inner objective with a `token_dim`) the prefix is each
token's: every token cut to its first m components and normalized again, a zero token staying zero, and
scored by MaxSim of m-wide tokens (Jina-ColBERT-v2; sentence-transformers' MultiVectorMatryoshkaLoss).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.base import Objective, Ranks, StreamResult, Wrapping
from titan_contrastive.losses.guide import Guide


def prefix(z: Tensor, dim: int, token_dim: int = 0) -> Tensor:
    """The first `dim` components of each embedding, L2-normalized again; of each `token_dim`-wide token of it where
    given, a zero token (left out) staying zero with a zero gradient (F.normalize's would be 1 / eps times the
    scores' gradient, harmless in float64 and an overflow in bfloat16)."""
    if token_dim:
        tokens = z.unflatten(-1, (-1, token_dim))[..., :dim]
        norm = tokens.norm(dim=-1, keepdim=True)
        kept = norm > 0
        return torch.where(kept, tokens / torch.where(kept, norm, 1), 0).flatten(-2)
    return F.normalize(z[..., :dim], dim=-1)


def at_width(objective: Objective, dim: int) -> Objective:
    """A late-interaction objective (or one wrapping it) scoring `dim`-wide tokens."""
    if isinstance(objective, Wrapping):
        return dataclasses.replace(objective, inner=at_width(objective.inner, dim))  # type: ignore[type-var]
    return dataclasses.replace(objective, token_dim=dim)  # type: ignore[type-var]


@dataclass(frozen=True)
class Matryoshka(Wrapping):
    inner: Objective
    dims: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.weights) or not self.dims:
            raise ValueError(f"matryoshka dims {self.dims} and weights {self.weights} must be as many, at least one")

    def with_guide(self, guide: Guide | None) -> Matryoshka:
        return dataclasses.replace(self, inner=self.inner.with_guide(guide))

    def with_teacher(self, teacher: Tensor) -> Matryoshka:
        """The teacher's scores (`losses/distill.py`), the same at every prefix."""
        return dataclasses.replace(self, inner=self.inner.with_teacher(teacher))

    def describe(self) -> str:
        dims = ", ".join(f"{m} x {w:g}" for m, w in zip(self.dims, self.weights))
        over = "each token's dims" if self.token_dim else "dims"
        return f"{self.inner.describe()}, Matryoshka over {over} {dims}"

    def check_dim(self, dim: int) -> None:
        """ValueError when a prefix is longer than the embeddings (the tokens, under late interaction: `dim` is
        then ignored)."""
        what, dim = ("tokens", self.token_dim) if self.token_dim else ("embeddings", dim)
        if max(self.dims) > dim:
            raise ValueError(
                f"loss.matryoshka_dims={list(self.dims)}: the {what} have {dim} dimensions; use dims <= {dim}"
            )

    def _at(self, m: int) -> Objective:
        """The inner objective at prefix m."""
        return at_width(self.inner, m) if self.token_dim else self.inner

    def _cut(self, z: Tensor, m: int) -> Tensor:
        return prefix(z, m, self.token_dim)

    def dense(
        self, q: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None = None, ids: Tensor | None = None
    ) -> Tensor:
        self.check_dim(q.shape[-1])
        return sum(
            w * self._at(m).dense(self._cut(q, m), self._cut(docs, m), scale, bias, ids) for m, w in self._pairs()
        )

    def microbatch(
        self,
        q: Tensor,
        docs: tuple[Tensor, Tensor | None],
        scale: Tensor,
        bias: Tensor | None,
        ids: tuple[Tensor, Tensor | None] | None,
        ranks: Ranks,
    ) -> Tensor:
        self.check_dim(q.shape[-1])
        positives, negatives = docs
        return sum(
            w
            * self._at(m).microbatch(
                self._cut(q, m),
                (self._cut(positives, m), None if negatives is None else self._cut(negatives, m)),
                scale,
                bias,
                ids,
                ranks,
            )
            for m, w in self._pairs()
        )

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return self.inner.fused(num_queries, num_columns)

    def streamed(self, q_own: Tensor, docs: Tensor, scale: Tensor, bias: Tensor | None, **kwargs) -> StreamResult:
        """The inner objective's streamed form per prefix; its gradients are carried back through
        the prefix and the renormalization (autograd on the [rows, d] and [M, d] embeddings only)."""
        self.check_dim(q_own.shape[-1])
        q_leaf, d_leaf = q_own.detach().requires_grad_(), docs.detach().requires_grad_()
        loss = grad_rows = grad_cols = scale_rows = bias_rows = None
        for m, w in self._pairs():
            with torch.enable_grad():
                qm, dm = self._cut(q_leaf, m), self._cut(d_leaf, m)
            part = self._at(m).streamed(qm.detach(), dm.detach(), scale, bias, **kwargs)
            gq, gd = torch.autograd.grad(
                (qm, dm), (q_leaf, d_leaf), (part.grad_rows.to(qm.dtype) * w, part.grad_cols.to(dm.dtype) * w)
            )
            loss = _add(loss, w * part.loss)
            grad_rows, grad_cols = _add(grad_rows, gq), _add(grad_cols, gd)
            scale_rows = _add(scale_rows, w * part.scale_rows)
            bias_rows = None if part.bias_rows is None else _add(bias_rows, w * part.bias_rows)
        return StreamResult(loss, grad_rows, grad_cols, scale_rows, bias_rows)

    def _pairs(self) -> list[tuple[int, float]]:
        return list(zip(self.dims, self.weights))


def _add(total: Tensor | None, value: Tensor) -> Tensor:
    return value if total is None else total + value
