"""SigLIP's sigmoid loss over late interaction: `sigmoid.py`'s definition with MaxSim (`maxsim.py`) in the place of
the dot product,

    L = -1/N sum_i sum_{j not in M_i} log sigmoid(z_ij (t S_ij + b)),   S_ij = MaxSim(q_i, d_j)

(over query i's token count where `normalize`), z_ij = +1 for the positive and -1 for every other column, hard
negatives included; M_i the false negatives masked by MaxSim as in `late_interaction.py`. colpali-engine's
ColbertSigmoidLoss is this loss with b = 0 fixed and divided by N more (its mean over the N^2 pairs).

A sum over pairs, each pair's gradient its own score's: the streamed form forms each tile of a block of rows once,
with autograd, and takes its backward at once (`maxsim.swept_grads`), where InfoNCE scores every block twice; the
microbatch form runs that sweep in its forward and keeps the gradients (`_Swept`). MaxSim is positively homogeneous
in q, so dL/dt = <q, dL/dq> / t per row, as for the dot product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from titan_contrastive.losses.base import Ranks, StreamResult, row_scale_shares
from titan_contrastive.losses.maxsim import MaxSimScored, maxsim_mask, swept_grads, token_products
from titan_contrastive.losses.sigmoid import Sigmoid
from titan_contrastive.losses.streaming import accumulation_dtype, sigmoid_block


@dataclass(frozen=True)
class LateSigmoid(Sigmoid, MaxSimScored):
    """The sigmoid loss over MaxSim of tokens `token_dim` wide; see the module docstring."""

    token_dim: int = 0
    normalize: bool = False

    def describe(self) -> str:
        masked = f", false negatives masked ({self.false_negatives.describe()})" if self.false_negatives.enabled else ""
        per = ", over each query's tokens" if self.normalize else ""
        return f"{self.name} loss (sigmoid over late interaction, MaxSim of {self.token_dim}-wide tokens{per}{masked})"

    def fused(self, num_queries: int, num_columns: int) -> bool:
        return False

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
        """`Sigmoid.rows`; `tiled` (the microbatch form): the streamed form's one sweep over tiles run in the forward,
        its gradients kept for the backward (`_Swept`), so no token product is kept and none formed twice."""
        if not tiled:
            return super().rows(q, docs, scale, bias, ids, first_row, normalizer)
        return _Swept.apply(q, docs, scale, bias, self, ids, first_row, normalizer or len(q))

    def _scores(self, q: Tensor, docs: Tensor) -> Tensor:
        return token_products(q, docs, self.token_dim, self.normalize)

    def _masked(self, q: Tensor, docs: Tensor, ids: Tensor | None, first_row: int, products: Tensor) -> Tensor | None:
        mask = maxsim_mask(self.false_negatives, q, docs, self.token_dim, self.normalize, 1.0, first_row, ids)
        return None if mask is None else mask(products.detach(), 0)

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
        """One pass over the own rows, `chunk` at a time, against all columns: their loss terms (summed over ranks),
        both embedding gradients and the rows' shares of dL/db."""
        if bias is None:
            raise ValueError("the sigmoid loss needs a bias (the model's logit_bias)")
        n, dim, norm, acc = num_queries, self.token_dim, self.normalize, accumulation_dtype(q_own)
        s, b = (x.detach().reshape(()).to(acc) for x in (scale, bias))  # kept on the device: no host sync
        mask = maxsim_mask(self.false_negatives, q_own, docs, dim, norm, 1.0, first_row, ids)  # on MaxSim itself
        loss = torch.zeros((), dtype=acc, device=q_own.device)
        grad_rows = torch.empty(q_own.shape, dtype=acc, device=q_own.device)
        grad_cols = torch.zeros(docs.shape, dtype=acc, device=q_own.device)
        bias_rows = torch.zeros(len(q_own), dtype=acc, device=q_own.device)
        for start in range(0, len(q_own), chunk):
            rows = q_own[start : start + chunk]
            full = torch.zeros(len(rows), len(docs), dtype=acc, device=q_own.device) if mask is not None else None

            def grad_of(tile: Tensor, j: int, start: int = start, full: Tensor | None = full) -> Tensor:
                """dL/dS of the rows at the columns j, ...: the terms added up, W scaled (a mask reads the tile
                where it would sit in the block's row)."""
                masked = None
                if full is not None:
                    full[:, j : j + tile.shape[1]] = tile
                    whole = mask(full, start)
                    masked = None if whole is None else whole[:, j : j + tile.shape[1]]
                part, w = sigmoid_block(tile.mul_(s), b, first_row + start - j, masked)
                loss.add_(part)
                bias_rows[start : start + len(tile)] += w.sum(1)
                return w.mul_(s / n)

            gq, gd = swept_grads(rows, docs, dim, grad_of, norm)
            grad_rows[start : start + len(rows)] = gq
            grad_cols += gd
        loss = ranks.sum(loss / n)
        return StreamResult(loss, grad_rows, grad_cols, row_scale_shares(q_own, grad_rows, scale), bias_rows.div_(n))


class _Swept(torch.autograd.Function):
    """The rows' share of the loss with its gradients taken in the forward by `LateSigmoid.streamed` (one block of
    all the rows, one process), kept, and scaled by the incoming gradient in the backward."""

    @staticmethod
    def forward(ctx, q, docs, scale, bias, objective, ids, first_row, normalizer):  # noqa: ANN001, ANN205
        out = objective.streamed(
            q.detach(), docs.detach(), scale.detach(), bias.detach(), first_row=first_row, num_queries=normalizer,
            chunk=len(q), ranks=Ranks(None), ids=ids,
        )  # fmt: skip
        ctx.save_for_backward(out.grad_rows, out.grad_cols, out.scale_rows.sum(), out.bias_rows.sum())
        ctx.like = [(x.dtype, x.shape) for x in (q, docs, scale, bias)]  # not the tensors: they need not stay alive
        return out.loss  # in the accumulation dtype, as `Sigmoid.rows`' over scores accumulated there

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grads = (g * grad for g in ctx.saved_tensors)
        return (*(g.to(dtype).reshape(shape) for g, (dtype, shape) in zip(grads, ctx.like)), None, None, None, None)
