"""Symmetric InfoNCE over N pairs without an N x N matrix: streamed log-sum-exps and gradients.

Notation (seed 001): S = s * Zx Zy^T with s = exp(logit_scale) = 1/tau, row LSE a_i =
logsumexp_j S_ij, column LSE b_j = logsumexp_i S_ij, P = exp(S - a 1^T) (row softmax),
Q = exp(S - 1 b^T) (column softmax).

    L    = 1/(2N) * sum_i (a_i + b_i - 2 S_ii)
    dL/dZx = s/(2N) * (P + Q - 2I) Zy          dL/dZy = s/(2N) * (P + Q - 2I)^T Zx
    dL/dlog(s) = <Zx, dL/dZx>                  (= <Zy, dL/dZy>)

Every function here touches S only in blocks of at most `chunk` rows by N, so the extra memory
is O(chunk * N + N * d); the logits are formed in at least float32 (float64 stays float64). A
rank takes its own rows of S against all N columns, once forward and once backward, with the
same organisation on both paths, which differ only in the pair of functions:
- forward, `streamed_row_col_lse` (PyTorch) / `fused_lse` (Triton): the row LSEs of its rows and
  their partial column LSEs, which the caller merges over ranks with a logsumexp;
- backward, `streamed_softmax_grads` / `fused_embedding_grads`: W = P + Q - 2I per block, then
  dZx[own] = W Zy and this rank's share of dZy = W^T Zx[own] as GEMMs; the caller sums the
  shares over ranks (a reduce-scatter).
That is 8 N^2 d FLOPs over all ranks (one GEMM forward, three backward), against 6 for the dense
loss, whose passes over N x N matrices (softmax both ways, their backward, the transposed copy)
cost more than the two extra GEMMs: on the 2-core CPU the streaming loss takes 0.94-0.97x the
dense time at N = 1-2K and 0.71x at 8K in float32 (benchmarks/loss_bench.py, README). On CPU the
PyTorch path runs each block's elementwise passes on row tiles of ~`TILE_BYTES` (0.5-32 MiB
measured the same on a quiet machine; kept small so they stay in cache), its forward takes one
exp per logit (the column sums reuse the row pass's exponentials, with an exact fallback for
columns where that could underflow), its backward two. The step (`steps/global_negatives.py`)
passes a `KeptBlock`, so the backward starts with the forward's last block instead of
recomputing it (at N <= chunk: 6 N^2 d). The distributed step (`titan_contrastive.distributed_clip`)
splits the rows over ranks instead of repeating the work on every rank as the seed does.

`kernel="triton"` / `"triton_exact"` (IEEE fp32 dot products) computes the same quantities with
the fused Triton kernels (`titan_contrastive.kernels.streaming_triton`), S never in memory.
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
import math
import warnings
from collections.abc import Callable

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
            raise ImportError(
                f"loss.kernel={kernel} needs triton ({e}); pip install triton, or set loss.kernel=pytorch"
            ) from None


def _triton(kernel: str):  # noqa: ANN202 - the module, imported only when asked for
    require_kernel(kernel)
    return importlib.import_module("titan_contrastive.kernels.streaming_triton")


def infonce_loss_from_lse(zx: Tensor, zy: Tensor, row_lse: Tensor, col_lse: Tensor, scale: Tensor) -> Tensor:
    """L from the global LSEs and the diagonal only: O(N * d)."""
    diag = (zx.to(row_lse.dtype) * zy.to(row_lse.dtype)).sum(1) * scale
    return (row_lse.sum() + col_lse.sum() - 2 * diag.sum()) / (2 * len(zx))


# ------------------------------------------------------------------ the PyTorch path

TILE_BYTES = 2 << 20  # CPU: a block's elementwise passes run on ~2 MiB row tiles, which stay in cache between passes


def _tile_rows(block: Tensor) -> int:
    """Rows per elementwise tile of `block`: on CPU ~TILE_BYTES (at least one row), so the
    passes over a tile (subtract, exp, sum, ...) read it from cache, not from memory; elsewhere
    the whole block (a GPU gains nothing from tiling, only launches)."""
    if block.device.type != "cpu":
        return max(1, len(block))
    return max(1, TILE_BYTES // max(1, block.shape[1] * block.element_size()))


def _logits_into(out: Tensor, queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """out = scale * queries @ keys^T, out in the accumulation dtype: one GEMM with the scale as its
    alpha when the embeddings are already in that dtype; else the product in theirs, copied into
    out and scaled there."""
    if queries.dtype == out.dtype:
        return out.addmm_(queries, keys.T, beta=0, alpha=scale)
    return out.copy_(queries @ keys.T).mul_(scale)  # scaled in out's dtype, not rounded to the inputs' again


def _underflow_margin(dtype: torch.dtype, rows: int) -> float:
    """How far (in log units, negative) a sum of `rows` exponentials exp(x - shift) may lie below
    its shift and still be exact: each term that flushes or goes subnormal is off by less than
    the smallest normal `tiny`, so a sum >= rows * tiny / eps (e times that, for margin) is off by
    less than one rounding error. fp32: about -63 at 1K rows; fp64: about -664."""
    info = torch.finfo(dtype)
    return math.log(rows * info.tiny / info.eps) + 1.0


class KeptBlock:
    """The last block of logits of a `streamed_row_col_lse` call, kept for the
    `streamed_softmax_grads` call on the same rows that follows: that one starts with this block
    instead of recomputing it (one of the four GEMMs of a block saved; a quarter of all the work
    when the rows fit in one chunk), in the same buffer, so no extra memory. Used only if the
    embeddings, their versions and the scale are those of the LSE call; emptied when used."""

    __slots__ = ("buffer", "key", "start")

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.key: tuple = ()
        self.start = -1

    @staticmethod
    def key_of(zx_own: Tensor, zy: Tensor, scale: float, chunk: int) -> tuple:
        return (
            zx_own.data_ptr(),
            zx_own.shape,
            zx_own.stride(),
            zx_own._version,
            zx_own.dtype,
            zy.data_ptr(),
            zy.shape,
            zy.stride(),
            zy._version,
            scale,
            chunk,
        )

    def take(self, key: tuple) -> tuple[Tensor | None, int]:
        """(the buffer holding the kept block, its first row) if it is for `key`, else (None, -1)."""
        buffer, start, match = self.buffer, self.start, self.key == key
        self.buffer, self.key, self.start = None, (), -1
        return (buffer, start) if match else (None, -1)


def streamed_row_col_lse(
    zx_own: Tensor, zy: Tensor, scale: Tensor, chunk: int, keep: KeptBlock | None = None
) -> tuple[Tensor, Tensor]:
    """(row LSE of the rows `zx_own` [c], their partial column LSE [N]) in one pass over S[own, :],
    `chunk` rows x N at a time; the PyTorch twin of `fused_lse`.

    The global column LSE is the logsumexp of the partials over ranks (or over any split of the
    rows). Per block, on tiles of rows: E = exp(S - m) with m the tile's row maxima gives the
    row sums; the column sums come from the same E, sum_i E_ij exp(m_i - M) (a GEMV, M the
    tile's largest m), so each logit takes one exp. A column whose block sum lies so far below
    the block's shift that flushed terms could matter (fp32: below ~e^-63; with unit embeddings,
    only at s > 31) is recomputed from the block's logits with a plain logsumexp, so the result
    is exact in every case. `keep`: the last block stays there for `streamed_softmax_grads`.
    """
    acc = accumulation_dtype(zx_own)
    c, n = len(zx_own), len(zy)
    dev = zx_own.device
    s = float(scale)
    row_lse = torch.empty(c, dtype=acc, device=dev)
    if c == 0:
        return row_lse, torch.full((n,), -math.inf, dtype=acc, device=dev)
    block_buf = torch.empty(min(chunk, c), n, dtype=acc, device=dev)
    tile = min(_tile_rows(block_buf), len(block_buf))
    tiles_per_block = -(-len(block_buf) // tile)
    exps = torch.empty(tile, n, dtype=acc, device=dev)
    col_parts = torch.empty(tiles_per_block, n, dtype=acc, device=dev)  # per tile: log sum_i exp(S_ij - M_tile)
    shifts = torch.empty(tiles_per_block, 1, dtype=acc, device=dev)
    col_lse = None
    for start in range(0, c, chunk):
        stop = min(start + chunk, c)
        block = _logits_into(block_buf[: stop - start], zx_own[start:stop], zy, s)
        k = 0
        for t0 in range(0, len(block), tile):
            logits = block[t0 : t0 + tile]
            rows, e = row_lse[start + t0 : start + t0 + len(logits)], exps[: len(logits)]
            row_max = logits.amax(1)
            torch.sub(logits, row_max[:, None], out=e).exp_()
            torch.sum(e, 1, out=rows)
            rows.log_().add_(row_max)
            torch.amax(row_max, 0, keepdim=True, out=shifts[k])
            torch.mv(e.T, row_max.sub_(shifts[k]).exp_(), out=col_parts[k])
            k += 1
        parts = col_parts[:k].log_().add_(shifts[:k])
        block_col = parts[0] if k == 1 else torch.logsumexp(parts, 0)
        suspect = block_col < shifts[:k].max() + _underflow_margin(acc, len(block))
        if suspect.any():  # flushed terms might matter: those columns straight from the logits
            cols = suspect.nonzero()[:, 0]
            block_col[cols] = torch.logsumexp(block[:, cols], 0)
        col_lse = block_col.clone() if col_lse is None else torch.logaddexp(col_lse, block_col, out=col_lse)
    if keep is not None:
        keep.buffer, keep.start, keep.key = block_buf, start, KeptBlock.key_of(zx_own, zy, s, chunk)
    return row_lse, col_lse


def streamed_softmax_grads(
    zx_own: Tensor,
    zy: Tensor,
    row_lse_own: Tensor,
    col_lse: Tensor,
    scale: Tensor,
    first_row: int,
    chunk: int,
    keep: KeptBlock | None = None,
) -> tuple[Tensor, Tensor]:
    """(dL/dZx[own] [c, d], this rank's share of dL/dZy [N, d]) from one recompute of S[own, :],
    `chunk` rows x N at a time; the PyTorch twin of `fused_embedding_grads`.

    row_lse_own: the LSEs a of these rows; col_lse: the global column LSEs b; first_row: the
    global index of zx_own[0] (its positive is column first_row). Per block, W = exp(S - a) +
    exp(S - b) - 2I (on tiles of rows that stay in cache on CPU), then dZx[rows] = W Zy and
    dZy += W^T Zx[rows], both GEMMs scaled by s/(2N) (low-precision embeddings take W in their
    dtype, as the fused kernel does). The shares of dZy sum to the gradient over ranks. Blocks
    run last to first, so the first can be the one `keep` holds from the LSE pass.
    """
    acc = accumulation_dtype(zx_own)
    c, n = len(zx_own), len(zy)
    dev = zx_own.device
    s = float(scale)
    coef = s / (2 * n)
    gx = torch.empty(c, zy.shape[1], dtype=acc, device=dev)
    if c == 0:
        return gx, torch.zeros(n, zy.shape[1], dtype=acc, device=dev)
    gy = torch.empty(n, zy.shape[1], dtype=acc, device=dev)  # written by the first block's product, then summed into
    block_buf, kept = keep.take(KeptBlock.key_of(zx_own, zy, s, chunk)) if keep is not None else (None, -1)
    if block_buf is None:
        block_buf = torch.empty(min(chunk, c), n, dtype=acc, device=dev)
    tile = min(_tile_rows(block_buf), len(block_buf))
    p = torch.empty(tile, n, dtype=acc, device=dev)
    col_shift = col_lse[None, :]
    low = zy.dtype != acc
    starts = range(0, c, chunk)
    for start in reversed(starts):
        stop, first = min(start + chunk, c), start == starts[-1]
        block = block_buf[: stop - start]
        if start != kept:
            _logits_into(block, zx_own[start:stop], zy, s)
        for t0 in range(0, len(block), tile):
            logits = block[t0 : t0 + tile]
            pt = p[: len(logits)]
            torch.sub(logits, row_lse_own[start + t0 : start + t0 + len(logits), None], out=pt).exp_()  # P
            logits.sub_(col_shift).exp_().add_(pt)  # Q + P, in place
        block.diagonal(first_row + start).sub_(2)  # - 2I on the global diagonal
        if low:  # W rounded to the embeddings' dtype for the products, their results summed in float32
            w = block.to(zy.dtype)
            gx[start:stop] = w @ zy
            share = w.T @ zx_own[start:stop]
            if first:
                gy.copy_(share)
            else:
                gy += share
        else:
            gx[start:stop].addmm_(block, zy, beta=0, alpha=coef)
            gy.addmm_(block.T, zx_own[start:stop], beta=0 if first else 1, alpha=coef)
    if low:
        gx.mul_(coef)
        gy.mul_(coef)
    return gx, gy


def streamed_sigmoid(
    zx_own: Tensor, zy: Tensor, scale: Tensor, bias: Tensor, first_row: int, chunk: int, num_pairs: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    return _triton(kernel).row_col_lse(
        zx_own.contiguous(), zy.contiguous(), float(scale), exact=kernel == "triton_exact"
    )


def fused_embedding_grads(
    zx_own: Tensor,
    zy: Tensor,
    row_lse_own: Tensor,
    col_lse: Tensor,
    scale: Tensor,
    first_row: int,
    kernel: str,
    panel: int = FUSED_PANEL,
) -> tuple[Tensor, Tensor]:
    """(dL/dZx[own] [c, d], this rank's share of dL/dZy [N, d]), float32, from one recompute of S[own, :].

    first_row: the global index of zx_own[0] (its positive is column first_row). Per panel of
    at most `panel` x `panel`: the kernel writes W = P + Q - 2I, then dZx[rows] += W Zy[cols]
    and dZy[cols] += W^T Zx[rows] (cuBLAS; bf16 inputs give bf16 products, each added once to
    the float32 sums). The shares of dZy sum to the gradient over ranks.
    """
    fused, exact = _triton(kernel), kernel == "triton_exact"
    gx, gy = _fused_products(
        zx_own,
        zy,
        exact,
        panel,
        lambda x, y, offset, out: fused.softmax_weights(
            x,
            y,
            row_lse_own[offset[0] : offset[0] + len(x)],
            col_lse[offset[1] : offset[1] + len(y)],
            float(scale),
            first_row + offset[0] - offset[1],
            exact=exact,
            out=out,
        ),
    )
    coef = float(scale) / (2 * len(zy))
    return gx.mul_(coef), gy.mul_(coef)


def fused_sigmoid(
    zx_own: Tensor, zy: Tensor, scale: Tensor, bias: Tensor, first_row: int, kernel: str, panel: int = FUSED_PANEL
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`streamed_sigmoid` with the fused kernel: per panel one pass over S writes W = N dL/dl and
    adds the rows' loss terms and W sums; the embedding gradients are GEMMs on W (float32 sums)."""
    fused, exact = _triton(kernel), kernel == "triton_exact"
    f32 = dict(dtype=torch.float32, device=zy.device)
    loss_rows, bias_rows = torch.zeros(len(zx_own), **f32), torch.zeros(len(zx_own), **f32)
    gx, gy = _fused_products(
        zx_own,
        zy,
        exact,
        panel,
        lambda x, y, offset, out: fused.sigmoid_weights(
            x,
            y,
            float(scale),
            float(bias),
            first_row + offset[0] - offset[1],
            loss_rows=loss_rows[offset[0] : offset[0] + len(x)],
            bias_rows=bias_rows[offset[0] : offset[0] + len(x)],
            exact=exact,
            out=out,
        ),
    )
    n = len(zy)
    return loss_rows.sum() / n, gx.mul_(float(scale) / n), gy.mul_(float(scale) / n), bias_rows.div_(n)


def _fused_products(
    zx_own: Tensor, zy: Tensor, exact: bool, panel: int, weights: Callable[..., Tensor]
) -> tuple[Tensor, Tensor]:
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


def _fused_and_reference(
    loss: str, zx: Tensor, zy: Tensor, kernel: str
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The self-check's problem (all rows, two panels): the fused outputs and the PyTorch path's."""
    scale, n = torch.tensor(20.0, device=zx.device), len(zx)
    x32, y32 = zx.float(), zy.float()
    if loss == "siglip":
        bias = torch.tensor(-5.0, device=zx.device)
        return fused_sigmoid(zx, zy, scale, bias, 0, kernel, panel=256), streamed_sigmoid(x32, y32, scale, bias, 0, n)
    row, col = fused_lse(zx, zy, scale, kernel)
    got = fused_embedding_grads(zx, zy, row, col, scale, 0, kernel, panel=256)
    want_row, want_col = streamed_row_col_lse(x32, y32, scale, n)
    return (row, col, *got), (want_row, want_col, *streamed_softmax_grads(x32, y32, want_row, want_col, scale, 0, n))


@functools.cache
def _agrees_on_device(kernel: str, device: torch.device, dtype: torch.dtype, d: int, loss: str = "clip") -> bool:
    """Once per (device, dtype, d, loss): the fused path against the PyTorch path on a small problem
    (333 rows, two panels). A toolchain that miscompiles falls back to PyTorch with a warning."""
    gen = torch.Generator(device).manual_seed(0)
    zx, zy = (F.normalize(torch.randn(333, d, device=device, generator=gen), dim=1).to(dtype) for _ in range(2))
    try:
        got, want = _fused_and_reference(loss, zx, zy, kernel)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use it
        warnings.warn(
            f"loss.kernel=auto: the Triton kernels failed on {device} ({type(e).__name__}: {e}); using the PyTorch "
            "path",
            stacklevel=2,
        )
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    errors = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want)]
    if not max(errors) <= tol:
        warnings.warn(
            f"loss.kernel=auto: the Triton kernels disagree with PyTorch on {device} {dtype} d={d} "
            f"(relative errors {', '.join(f'{e:.1e}' for e in errors)}); using the PyTorch path",
            stacklevel=2,
        )
    return max(errors) <= tol
