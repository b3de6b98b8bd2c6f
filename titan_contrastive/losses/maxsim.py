"""MaxSim, ColBERT's late-interaction score, and its tiles: every query's token against every document's, without
holding the [rows, L_q, columns, L_d] products of a batch.

A multi-vector embedding is one row [L * d]: L token vectors of width d laid end to end, a token that does not count
(padding, a skipped punctuation mark) being the zero vector. MaxSim(q_i, d_j) = sum_a max_b <q_ia, d_jb> (b over
the document's tokens that are not zero), divided by query i's token count (those not zero) where `normalize`. The
scores are formed in tiles of rows x columns whose token products stay under `TILE_ELEMENTS`; a tile's backward
recomputes it (`tile_grads`), so an objective over MaxSim keeps O(rows x columns) scores (`MaxSimScores`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from titan_contrastive.losses.masking import FalseNegatives
from titan_contrastive.losses.streaming import BlockMask, accumulation_dtype

TILE_ELEMENTS = 1 << 24  # token products per tile: 64 MiB in float32


def tokens(x: Tensor, dim: int) -> Tensor:
    """Rows [n, L * dim] as [n, L, dim]."""
    return x.view(len(x), -1, dim)


def token_products(q: Tensor, docs: Tensor, dim: int, normalize: bool = False) -> Tensor:
    """MaxSim of every row of `q` with every row of `docs` [n, m], with autograd: all token products at once;
    `normalize`: each row's divided by its token count."""
    qt, dt = tokens(q, dim), tokens(docs, dim)
    products = torch.einsum("iad,jbd->iajb", qt, dt)
    real = (dt != 0).any(-1)  # [m, L_d]: the document tokens that count
    products = products.masked_fill(~real[None, None], -math.inf)
    out = products.amax(-1).to(accumulation_dtype(q)).sum(1)
    return out / (qt != 0).any(-1).sum(1, keepdim=True).clamp_min(1) if normalize else out


def pair_products(q: Tensor, docs: Tensor, dim: int, normalize: bool = False) -> Tensor:
    """MaxSim of each row of `q` [c, L_q * dim] with its own documents `docs` [c, k, L_d * dim]: [c, k], with
    autograd (the same operations as `token_products`, one row's documents at a time)."""
    qt, dt = tokens(q, dim), docs.view(len(docs), docs.shape[1], -1, dim)
    products = torch.einsum("cad,ckbd->ckab", qt, dt)
    real = (dt != 0).any(-1)  # [c, k, L_d]
    products = products.masked_fill(~real[:, :, None], -math.inf)
    out = products.amax(-1).to(accumulation_dtype(q)).sum(2)
    return out / (qt != 0).any(-1).sum(1, keepdim=True).clamp_min(1) if normalize else out


def _column_tile(rows: int, q_len: int, d_len: int, columns: int) -> int:
    return max(1, min(columns, TILE_ELEMENTS // max(1, rows * q_len * d_len)))


def scores(q: Tensor, docs: Tensor, dim: int, normalize: bool = False) -> Tensor:
    """MaxSim [n, m] in the accumulation dtype, without autograd, in tiles of columns (`token_products`)."""
    out = torch.empty(len(q), len(docs), dtype=accumulation_dtype(q), device=q.device)
    step = _column_tile(len(q), q.shape[1] // dim, docs.shape[1] // dim, len(docs))
    with torch.no_grad():
        for j in range(0, len(docs), step):
            out[:, j : j + step] = token_products(q, docs[j : j + step], dim, normalize)
    return out


def tile_grads(q: Tensor, docs: Tensor, dim: int, grad: Tensor, normalize: bool = False) -> tuple[Tensor, Tensor]:
    """(dL/dq [n, Lq d], dL/ddocs [m, Ld d]) from dL/dS `grad` [n, m] of scores formed before (`scores`): each tile
    formed again with autograd (the same operations as `token_products`, so the same arg-max and the same gradient as
    its autograd) and its backward taken (`swept_grads`)."""
    return swept_grads(q, docs, dim, lambda tile, j: grad[:, j : j + tile.shape[1]], normalize)


def swept_grads(
    q: Tensor, docs: Tensor, dim: int, grad_of: Callable[[Tensor, int], Tensor], normalize: bool = False
) -> tuple[Tensor, Tensor]:
    """(dL/dq, dL/ddocs) where dL/dS at a tile of columns j, ... is `grad_of(the tile's MaxSim [n, w] without graph,
    j)`: each tile formed with autograd and its backward taken at once. A loss whose dL/dS there reads that tile alone
    (the sigmoid loss) forms no tile twice."""
    gq = torch.zeros(q.shape, dtype=accumulation_dtype(q), device=q.device)
    gd = torch.empty(docs.shape, dtype=gq.dtype, device=q.device)
    step = _column_tile(len(q), q.shape[1] // dim, docs.shape[1] // dim, len(docs))
    for j in range(0, len(docs), step):
        with torch.enable_grad():
            qt, dt = q.detach().requires_grad_(), docs[j : j + step].detach().requires_grad_()
            products = token_products(qt, dt, dim, normalize)
            tile_q, tile_d = torch.autograd.grad(products, (qt, dt), grad_of(products.detach().clone(), j))
        gq += tile_q
        gd[j : j + step] = tile_d
    return gq, gd


class MaxSimScores(torch.autograd.Function):
    """`scores` with a backward that recomputes each tile (`tile_grads`): keeps only q and docs."""

    @staticmethod
    def forward(ctx, q: Tensor, docs: Tensor, dim: int, normalize: bool) -> Tensor:  # noqa: ANN001
        ctx.save_for_backward(q, docs)
        ctx.dim, ctx.normalize = dim, normalize
        return scores(q, docs, dim, normalize)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        q, docs = ctx.saved_tensors
        gq, gd = tile_grads(q, docs, ctx.dim, grad, ctx.normalize)
        return gq.to(q.dtype), gd.to(docs.dtype), None, None


def maxsim_mask(
    false_negatives: FalseNegatives,
    q_own: Tensor,
    docs: Tensor,
    dim: int,
    normalize: bool,
    scale: float,
    first_row: int,
    ids: Tensor | None,
) -> BlockMask | None:
    """The false-negative mask of the rows `q_own` (global rows first_row, ...) on blocks of logits scale * MaxSim
    against all columns `docs`, from their positives' MaxSim (no gradient); None without one."""
    if not false_negatives.enabled:
        return None
    with torch.no_grad():
        own = docs[first_row : first_row + len(q_own)]
        positive = pair_products(q_own, own[:, None], dim, normalize)[:, 0]
    summed = q_own.shape[1]  # products a MaxSim sums: its rounding, for the masks' tie rule
    return false_negatives.for_keys(positive.to(torch.float64) * scale, scale, first_row, summed, ids, ids)


class MaxSimScored:
    """What an objective over MaxSim gives evaluation and a distillation term; for a dataclass with `token_dim` (a
    token's width) and `normalize` (each query's MaxSim over its token count)."""

    token_dim: int
    normalize: bool

    def similarity(self, q: Tensor, docs: Tensor) -> Tensor:
        """MaxSim of every query with every document [n, m] (evaluation's scores; no autograd)."""
        return scores(q, docs, self.token_dim, self.normalize)

    def pair_scores(self, q: Tensor, docs: Tensor) -> Tensor:
        """MaxSim of each query [c, L_q d] with its own documents [c, k, L_d d] (a distillation term's logits over
        them, `losses/distill.py`; autograd)."""
        return pair_products(q, docs, self.token_dim, self.normalize)
