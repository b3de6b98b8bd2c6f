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

`kernel="triton"` / `"triton_exact"` (IEEE fp32 dot products) computes the same quantities with
the fused Triton kernels (`titan_contrastive.kernels.streaming_triton`), organised differently:
a rank takes its rows of S against all N columns, once forward (`fused_lse`: its row LSEs and
its partial column LSEs, merged over ranks by the caller) and once backward
(`fused_embedding_grads`: W = P + Q - 2I per panel, then dZx[own] = W Zy and this rank's share
of dZy = W^T Zx as GEMMs, summed over ranks by the caller): 8 N^2 d FLOPs instead of 12.
`streamed_sigmoid` is the same for SigLIP's sigmoid loss, a sum over pairs: one pass, no
log-sum-exp; `fused_sigmoid` does it with the fused kernel (W = N dL/dl per panel, then GEMMs).

`"auto"` (the default) takes the kernels on CUDA for bf16 / fp16 (`triton`) and fp32
(`triton_exact`) once a self-check on the device agrees with the PyTorch path, and the PyTorch
path everywhere else (CPU, float64, no triton).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("auto", "pytorch", "triton", "triton_exact")
FUSED_PANEL = 8192  # rows x columns of W per backward panel: 128 MiB in bf16, 256 MiB in fp32


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
    if kernel not in ("auto", "pytorch"):
        try:
            importlib.import_module("titan_contrastive.kernels.streaming_triton")
        except ImportError as e:
            raise ImportError(f"loss.kernel={kernel} needs triton ({e}); pip install triton, or set loss.kernel=pytorch") from None


def _triton(kernel: str):  # noqa: ANN202 - the module, imported only when asked for
    require_kernel(kernel)
    return importlib.import_module("titan_contrastive.kernels.streaming_triton")


def streamed_lse(queries: Tensor, keys: Tensor, scale: Tensor, chunk: int) -> Tensor:
    """[len(queries)]: logsumexp_j(scale * q_i . k_j), `chunk` queries at a time.

    Row LSE of S for rows `queries` of Zx when keys = Zy; column LSE when queries are rows of
    Zy and keys = Zx (S^T = s * Zy Zx^T).
    """
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
                             chunk: int) -> tuple[Tensor, Tensor]:
    """(dL/dZx[rows], dL/dZy[rows]) of the global loss, `chunk` rows at a time.

    zx, zy: the global [N, d] embeddings (detached); row_lse, col_lse: the global LSEs (a, b).
    For dZx the blocks are rows of S (P and Q restricted to those rows); for dZy they are
    columns of S, formed as rows of S^T = s * Zy Zx^T.
    """
    n = len(zx)
    coef = scale / (2 * n)
    acc = accumulation_dtype(zx)
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


def streamed_sigmoid(zx_own: Tensor, zy: Tensor, scale: Tensor, bias: Tensor, first_row: int, chunk: int,
                     num_pairs: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SigLIP's loss over the rows `zx_own` (global rows first_row, ...) against all columns `zy`,
    and its gradients, in one pass over blocks of `chunk` rows x N (N = `num_pairs`, default len(zy)).

    l = s Zx Zy^T + b, z = +1 on the global diagonal, -1 elsewhere, L = -(1/N) sum log sigmoid(z l);
    W = dL/dl = -z sigmoid(-z l) / N. Returns (these rows' part of L, dL/dZx[own] = s W Zy, this
    rank's share of dL/dZy = s W^T Zx[own] for all N columns (the caller sums the shares over ranks),
    dL/db per own row = W summed over columns). A sum over pairs needs no normalizer, so unlike the
    softmax loss there is no log-sum-exp pass: one block of logits per step of the loop, ~3 chunk x N
    x d multiply-adds each (the softmax path forms its blocks 4 times, two of them with products).
    """
    n = num_pairs or len(zy)
    acc = accumulation_dtype(zx_own)
    gx = torch.empty(len(zx_own), zx_own.shape[1], dtype=acc, device=zx_own.device)
    gy = torch.zeros(len(zy), zy.shape[1], dtype=acc, device=zy.device)
    bias_rows = torch.empty(len(zx_own), dtype=acc, device=zx_own.device)
    loss = torch.zeros((), dtype=acc, device=zx_own.device)
    for start in range(0, len(zx_own), chunk):
        rows = slice(start, start + chunk)
        signed = _logits(zx_own[rows], zy, scale).add_(bias).neg_()  # z l, built in place: -l, then +l on the diagonal
        r = torch.arange(len(signed), device=signed.device)
        diag = (r, first_row + start + r)
        signed[diag] = -signed[diag]
        loss -= F.logsigmoid(signed).sum()
        w = signed.neg_().sigmoid_()  # sigmoid(-z l)
        w[diag] *= -1  # -z sigmoid(-z l) = N dL/dl
        gx[rows] = w.to(zy.dtype) @ zy
        gy += w.T.to(zx_own.dtype) @ zx_own[rows]
        bias_rows[rows] = w.sum(1)
    return loss / n, gx.mul_(scale / n), gy.mul_(scale / n), bias_rows.div_(n)


# ------------------------------------------------------------------ the fused Triton path

def fused_lse(zx_own: Tensor, zy: Tensor, scale: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """(row LSE of this rank's rows [c], their partial column LSE [N]) in one pass over S[own, :].

    The global column LSE is the logsumexp of the partials over ranks (the caller's all-gather).
    """
    return _triton(kernel).row_col_lse(zx_own.contiguous(), zy.contiguous(), float(scale), exact=kernel == "triton_exact")


def fused_embedding_grads(zx_own: Tensor, zy: Tensor, row_lse_own: Tensor, col_lse: Tensor, scale: Tensor, first_row: int,
                          kernel: str, panel: int = FUSED_PANEL) -> tuple[Tensor, Tensor]:
    """(dL/dZx[own] [c, d], this rank's share of dL/dZy [N, d]), float32, from one recompute of S[own, :].

    first_row: the global index of zx_own[0] (its positive is column first_row). Per panel of
    at most `panel` x `panel`: the kernel writes W = P + Q - 2I, then dZx[rows] += W Zy[cols]
    and dZy[cols] += W^T Zx[rows] (cuBLAS; bf16 inputs give bf16 products, each added once to
    the float32 sums). The shares of dZy sum to the gradient over ranks.
    """
    fused, exact = _triton(kernel), kernel == "triton_exact"
    gx, gy = _fused_products(zx_own, zy, exact, panel, lambda x, y, offset, out: fused.softmax_weights(
        x, y, row_lse_own[offset[0] : offset[0] + len(x)], col_lse[offset[1] : offset[1] + len(y)], float(scale),
        first_row + offset[0] - offset[1], exact=exact, out=out))
    coef = float(scale) / (2 * len(zy))
    return gx.mul_(coef), gy.mul_(coef)


def fused_sigmoid(zx_own: Tensor, zy: Tensor, scale: Tensor, bias: Tensor, first_row: int, kernel: str,
                  panel: int = FUSED_PANEL) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`streamed_sigmoid` with the fused kernel: per panel one pass over S writes W = N dL/dl and
    adds the rows' loss terms and W sums; the embedding gradients are GEMMs on W (float32 sums)."""
    fused, exact = _triton(kernel), kernel == "triton_exact"
    f32 = dict(dtype=torch.float32, device=zy.device)
    loss_rows, bias_rows = torch.zeros(len(zx_own), **f32), torch.zeros(len(zx_own), **f32)
    gx, gy = _fused_products(zx_own, zy, exact, panel, lambda x, y, offset, out: fused.sigmoid_weights(
        x, y, float(scale), float(bias), first_row + offset[0] - offset[1], loss_rows=loss_rows[offset[0] : offset[0] + len(x)],
        bias_rows=bias_rows[offset[0] : offset[0] + len(x)], exact=exact, out=out))
    n = len(zy)
    return loss_rows.sum() / n, gx.mul_(float(scale) / n), gy.mul_(float(scale) / n), bias_rows.div_(n)


def _fused_products(zx_own: Tensor, zy: Tensor, exact: bool, panel: int, weights: Callable[..., Tensor]) -> tuple[Tensor, Tensor]:
    """(sum W Zy per own row, sum W^T Zx[own] per column), float32, over panels of at most `panel`
    x `panel`; `weights(x_rows, y_cols, (first own row, first column), out)` writes the panel's W."""
    zx_own, zy = zx_own.contiguous(), zy.contiguous()
    c, n = len(zx_own), len(zy)
    w_dtype = torch.float32 if exact or zx_own.dtype == torch.float32 else zx_own.dtype
    gx = torch.zeros(c, zy.shape[1], dtype=torch.float32, device=zy.device)
    gy = torch.zeros(n, zy.shape[1], dtype=torch.float32, device=zy.device)
    w_buffer = torch.empty(min(panel, c), min(panel, n), dtype=w_dtype, device=zy.device)
    for r0 in range(0, c, panel):
        rows = slice(r0, min(r0 + panel, c))
        x_rows = zx_own[rows].to(w_dtype)
        for c0 in range(0, n, panel):
            cols = slice(c0, min(c0 + panel, n))
            w = weights(zx_own[rows], zy[cols], (r0, c0), w_buffer[: rows.stop - r0, : cols.stop - c0])
            gx[rows] += w @ zy[cols].to(w_dtype)
            gy[cols] += w.T @ x_rows
    return gx, gy


def preferred_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """What "auto" picks for embeddings on `device` in `dtype`, before the self-check."""
    if kernel != "auto":
        return kernel
    if device.type != "cuda" or dtype == torch.float64 or importlib.util.find_spec("triton") is None:
        return "pytorch"
    return "triton_exact" if dtype == torch.float32 else "triton"


def loss_dtype(kernel: str, z_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the loss reads embeddings in: under "auto" with bf16 / fp16 mixed precision, float32
    embeddings go in `compute_dtype` (the rounding autocast gives the dense loss's logit matmul, and
    the fused kernels then run on tensor cores with float32 accumulation); otherwise their own."""
    if kernel == "auto" and z_dtype == torch.float32 and compute_dtype in (torch.bfloat16, torch.float16):
        return compute_dtype
    return z_dtype


def resolve_kernel(kernel: str, z: Tensor, loss: str = "clip") -> str:
    """The path for embeddings like `z`: `kernel` itself unless "auto" (see the module docstring)."""
    fused = preferred_kernel(kernel, z.device, z.dtype)
    if kernel != "auto" or fused == "pytorch":
        return fused
    return fused if _agrees_on_device(fused, z.device, z.dtype, z.shape[1], loss) else "pytorch"


def _fused_and_reference(loss: str, zx: Tensor, zy: Tensor, kernel: str) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The self-check's problem (all rows, two panels): the fused outputs and the PyTorch path's."""
    scale, n = torch.tensor(20.0, device=zx.device), len(zx)
    x32, y32 = zx.float(), zy.float()
    if loss == "siglip":
        bias = torch.tensor(-5.0, device=zx.device)
        return fused_sigmoid(zx, zy, scale, bias, 0, kernel, panel=256), streamed_sigmoid(x32, y32, scale, bias, 0, n)
    row, col = fused_lse(zx, zy, scale, kernel)
    got = fused_embedding_grads(zx, zy, row, col, scale, 0, kernel, panel=256)
    want_row, want_col = streamed_lse(x32, y32, scale, n), streamed_lse(y32, x32, scale, n)
    return (row, col, *got), (want_row, want_col, *streamed_embedding_grads(x32, y32, range(n), want_row, want_col, scale, n))


@functools.cache
def _agrees_on_device(kernel: str, device: torch.device, dtype: torch.dtype, d: int, loss: str = "clip") -> bool:
    """Once per (device, dtype, d, loss): the fused path against the PyTorch path on a small problem
    (333 rows, two panels). A toolchain that miscompiles falls back to PyTorch with a warning."""
    gen = torch.Generator(device).manual_seed(0)
    zx, zy = (F.normalize(torch.randn(333, d, device=device, generator=gen), dim=1).to(dtype) for _ in range(2))
    try:
        got, want = _fused_and_reference(loss, zx, zy, kernel)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        warnings.warn(f"loss.kernel=auto: the Triton kernels failed on {device} ({type(e).__name__}: {e}); using the PyTorch path")
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    errors = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want)]
    if not max(errors) <= tol:
        warnings.warn(f"loss.kernel=auto: the Triton kernels disagree with PyTorch on {device} {dtype} d={d} "
                      f"(relative errors {', '.join(f'{e:.1e}' for e in errors)}); using the PyTorch path")
    return max(errors) <= tol
