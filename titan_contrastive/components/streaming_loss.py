"""Symmetric InfoNCE over N pairs without an N x N matrix: streamed log-sum-exps and gradients.

Notation (seed 001): S = s * Zx Zy^T with s = exp(logit_scale) = 1/tau, row LSE a_i =
logsumexp_j S_ij, column LSE b_j = logsumexp_i S_ij, P = exp(S - a 1^T) (row softmax),
Q = exp(S - 1 b^T) (column softmax).

    L    = 1/(2N) * sum_i (a_i + b_i - 2 S_ii)
    dL/dZx = s/(2N) * (P + Q - 2I) Zy          dL/dZy = s/(2N) * (P + Q - 2I)^T Zx
    dL/dlog(s) = <Zx, dL/dZx>                  (= <Zy, dL/dZy>)

Every function here touches S only in blocks of `chunk` rows (or columns) by N, so the extra
memory is O(chunk * N + N * d); the logits are formed in at least float32 (float64 stays
float64). The functions take *global* embedding matrices and a range of rows, so each rank
computes only its own rows: the distributed step (`titan_contrastive.distributed_clip`)
splits the work instead of repeating it on every rank as the seed does.

`kernel="triton"` / `"triton_exact"` (IEEE fp32 dot products) runs the same two loops as fused
Triton kernels (`titan_contrastive.kernels.streaming_triton`; S stays in registers, `chunk` is
unused); `"pytorch"` (the default, and the reference) is the code below.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

KERNELS = ("pytorch", "triton", "triton_exact")


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """float32 for low-precision embeddings, else their own dtype (float32 / float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _logits(queries: Tensor, keys: Tensor, scale: Tensor) -> Tensor:
    """scale * queries @ keys^T, in the accumulation dtype: one [len(queries), len(keys)] block."""
    return (queries @ keys.T).to(accumulation_dtype(queries)).mul_(scale)


def require_kernel(kernel: str) -> None:
    """Check that `kernel` can run: a known name, and triton importable for the fused ones."""
    if kernel not in KERNELS:
        raise ValueError(f"loss.kernel={kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel != "pytorch":
        try:
            importlib.import_module("titan_contrastive.kernels.streaming_triton")
        except ImportError as e:
            raise ImportError(f"loss.kernel={kernel} needs triton ({e}); pip install triton, or set loss.kernel=pytorch") from None


def _triton(kernel: str):  # noqa: ANN202 - the module, imported only when asked for
    require_kernel(kernel)
    return importlib.import_module("titan_contrastive.kernels.streaming_triton")


def streamed_lse(queries: Tensor, keys: Tensor, scale: Tensor, chunk: int, kernel: str = "pytorch") -> Tensor:
    """[len(queries)]: logsumexp_j(scale * q_i . k_j), `chunk` queries at a time.

    Row LSE of S for rows `queries` of Zx when keys = Zy; column LSE when queries are rows of
    Zy and keys = Zx (S^T = s * Zy Zx^T).
    """
    if kernel != "pytorch":
        return _triton(kernel).lse(queries.contiguous(), keys.contiguous(), float(scale), exact=kernel == "triton_exact")
    out = torch.empty(len(queries), dtype=accumulation_dtype(queries), device=queries.device)
    for start in range(0, len(queries), chunk):
        out[start : start + chunk] = torch.logsumexp(_logits(queries[start : start + chunk], keys, scale), dim=1)
    return out


def infonce_loss_from_lse(zx: Tensor, zy: Tensor, row_lse: Tensor, col_lse: Tensor, scale: Tensor) -> Tensor:
    """L from the global LSEs and the diagonal only: O(N * d)."""
    diag = (zx.to(row_lse.dtype) * zy.to(row_lse.dtype)).sum(1) * scale
    return (row_lse.sum() + col_lse.sum() - 2 * diag.sum()) / (2 * len(zx))


def _softmax_sum_times(block: Tensor, row_shift: Tensor, col_shift: Tensor, values: Tensor) -> Tensor:
    """(exp(block - row_shift) + exp(block - col_shift)) @ values, with `block` consumed in place."""
    weights = (block - row_shift).exp_()
    weights += block.sub_(col_shift).exp_()
    return (weights.to(values.dtype) @ values).to(block.dtype)


def streamed_embedding_grads(zx: Tensor, zy: Tensor, rows: range, row_lse: Tensor, col_lse: Tensor, scale: Tensor,
                             chunk: int, kernel: str = "pytorch") -> tuple[Tensor, Tensor]:
    """(dL/dZx[rows], dL/dZy[rows]) of the global loss, `chunk` rows at a time.

    zx, zy: the global [N, d] embeddings (detached); row_lse, col_lse: the global LSEs (a, b).
    For dZx the blocks are rows of S (P and Q restricted to those rows); for dZy they are
    columns of S, formed as rows of S^T = s * Zy Zx^T.
    """
    n = len(zx)
    coef = scale / (2 * n)
    acc = accumulation_dtype(zx)
    if kernel != "pytorch":
        fused, own = _triton(kernel), slice(rows.start, rows.stop)
        zx, zy, exact, s = zx.contiguous(), zy.contiguous(), kernel == "triton_exact", float(scale)
        gx = fused.softmax_pair_times(zx[own], zy, row_lse[own], col_lse, s, exact=exact)
        gy = fused.softmax_pair_times(zy[own], zx, col_lse[own], row_lse, s, exact=exact)
        return coef * (gx - 2 * zy[own].to(acc)), coef * (gy - 2 * zx[own].to(acc))
    gx = torch.empty(len(rows), zx.shape[1], dtype=acc, device=zx.device)
    gy = torch.empty_like(gx)
    for start in range(rows.start, rows.stop, chunk):
        stop = min(start + chunk, rows.stop)
        out = slice(start - rows.start, stop - rows.start)
        # rows of S: P[i, :] = exp(S_i: - a_i), Q[i, :] = exp(S_i: - b)
        block = _logits(zx[start:stop], zy, scale)
        gx[out] = coef * (_softmax_sum_times(block, row_lse[start:stop, None], col_lse[None, :], zy) - 2 * zy[start:stop].to(acc))
        # columns of S as rows of S^T: P[:, j]^T = exp(S_:j - a), Q[:, j]^T = exp(S_:j - b_j)
        block = _logits(zy[start:stop], zx, scale)
        gy[out] = coef * (_softmax_sum_times(block, row_lse[None, :], col_lse[start:stop, None], zx) - 2 * zx[start:stop].to(acc))
    return gx, gy
