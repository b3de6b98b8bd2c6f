"""The fused Triton path of the streamed losses, and which path a run takes.

`kernel="triton"` / `"triton_exact"` (IEEE fp32 dot products) computes the streamed quantities of
`losses/streaming.py` with the fused kernels of `titan_contrastive.kernels.streaming_triton`, S
never in memory: `fused_lse` and `fused_embedding_grads` for the symmetric softmax loss,
`fused_sigmoid` for the sigmoid loss (W = N dL/dl per panel, then GEMMs). The kernels serve the
plain problems only: N x N, no hard-negative columns, no masking, the symmetric softmax loss. An
objective with any of those options takes the PyTorch path (`losses/infonce.py`, `losses/sigmoid.py`
decide, and say so once).

`"auto"` (the default) takes the kernels on CUDA for bf16 / fp16 (`triton`) and fp32
(`triton_exact`) once a self-check on the device agrees with the PyTorch path, and the PyTorch
path everywhere else (CPU, float64, no triton).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.losses.streaming import streamed_row_col_lse, streamed_sigmoid, streamed_softmax_grads

KERNELS = ("auto", "pytorch", "triton", "triton_exact")
FUSED_PANEL = 8192  # rows x columns of W per backward panel: 128 MiB in bf16, 256 MiB in fp32


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


def fused_lse(zx_own: Tensor, zy: Tensor, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """(row LSE of this rank's rows [c], their partial column LSE [N]) in one pass over S[own, :].

    The global column LSE is the logsumexp of the partials over ranks (the caller's all-gather).
    """
    return _triton(kernel).row_col_lse(zx_own.contiguous(), zy.contiguous(), scale, exact=kernel == "triton_exact")


def fused_embedding_grads(
    zx_own: Tensor,
    zy: Tensor,
    row_lse_own: Tensor,
    col_lse: Tensor,
    scale: float,
    first_row: int,
    kernel: str,
    panel: int | None = None,
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
            scale,
            first_row + offset[0] - offset[1],
            exact=exact,
            out=out,
        ),
    )
    coef = scale / (2 * len(zy))
    return gx.mul_(coef), gy.mul_(coef)


def fused_sigmoid(
    zx_own: Tensor, zy: Tensor, scale: float, bias: float, first_row: int, kernel: str, panel: int | None = None
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
            scale,
            bias,
            first_row + offset[0] - offset[1],
            loss_rows=loss_rows[offset[0] : offset[0] + len(x)],
            bias_rows=bias_rows[offset[0] : offset[0] + len(x)],
            exact=exact,
            out=out,
        ),
    )
    n = len(zy)
    return loss_rows.sum() / n, gx.mul_(scale / n), gy.mul_(scale / n), bias_rows.div_(n)


def _fused_products(
    zx_own: Tensor, zy: Tensor, exact: bool, panel: int | None, weights: Callable[..., Tensor]
) -> tuple[Tensor, Tensor]:
    """(sum W Zy per own row, sum W^T Zx[own] per column), float32, over panels of at most `panel`
    x `panel` (None: FUSED_PANEL as it is at the call); `weights(x_rows, y_cols, (first own row,
    first column), out)` writes the panel's W."""
    panel = FUSED_PANEL if panel is None else panel
    zx_own, zy = zx_own.contiguous(), zy.contiguous()
    c, n = len(zx_own), len(zy)
    w_dtype = torch.float32 if exact or zx_own.dtype == torch.float32 else zx_own.dtype
    gx = torch.zeros(c, zy.shape[1], dtype=torch.float32, device=zy.device)
    gy = torch.zeros(n, zy.shape[1], dtype=torch.float32, device=zy.device)
    w_buffer = torch.empty(min(panel, c), min(panel, n), dtype=w_dtype, device=zy.device)
    add_product = _add_product_fn(zy.device, w_dtype)
    for r0 in range(0, c, panel):
        rows = slice(r0, min(r0 + panel, c))
        x_rows = zx_own[rows].to(w_dtype)
        for c0 in range(0, n, panel):
            cols = slice(c0, min(c0 + panel, n))
            w = weights(zx_own[rows], zy[cols], (r0, c0), w_buffer[: rows.stop - r0, : cols.stop - c0])
            add_product(gx[rows], w, zy[cols].to(w_dtype))
            add_product(gy[cols], w.T, x_rows)
    return gx, gy


def _add_sum(acc: Tensor, a: Tensor, b: Tensor) -> None:
    acc += a @ b


def _add_wide(acc: Tensor, a: Tensor, b: Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


@functools.cache
def _add_product_fn(device: torch.device, dtype: torch.dtype) -> Callable[[Tensor, Tensor, Tensor], None]:
    """acc (float32) += a @ b: one GEMM with a float32 output where the device has it (CUDA, bf16 /
    fp16 inputs: no rounded product in between, no separate pass to add it), checked once on a small
    problem; else the product in the inputs' dtype, then the sum."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return _add_sum
    a = torch.linspace(-1, 1, 24, device=device).view(4, 6).to(dtype)
    acc, want = torch.ones(4, 4, device=device), 1 + a.double() @ a.double().T
    try:
        _add_wide(acc, a, a.T)
    except (RuntimeError, TypeError, NotImplementedError):
        return _add_sum
    return _add_wide if torch.allclose(acc.double(), want, rtol=1e-5, atol=1e-5) else _add_sum


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


def resolve_kernel(kernel: str, z: Tensor, kind: str = "softmax") -> str:
    """The path for embeddings like `z`: `kernel` itself unless "auto" (see the module docstring)."""
    fused = preferred_kernel(kernel, z.device, z.dtype)
    if kernel != "auto" or fused == "pytorch":
        return fused
    return fused if _agrees_on_device(fused, z.device, z.dtype, z.shape[1], kind) else "pytorch"


SELF_CHECK_ROWS, SELF_CHECK_PANEL = 333, 256  # the self-check's problem: two panels, the second ragged


def _fused_and_reference(
    kind: str, zx: Tensor, zy: Tensor, kernel: str
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The self-check's problem (all rows, two panels): the fused outputs and the PyTorch path's."""
    scale, n = torch.tensor(20.0, device=zx.device), len(zx)
    x32, y32 = zx.float(), zy.float()
    if kind == "sigmoid":
        bias = torch.tensor(-5.0, device=zx.device)
        return fused_sigmoid(zx, zy, scale, bias, 0, kernel, panel=SELF_CHECK_PANEL), streamed_sigmoid(
            x32, y32, scale, bias, 0, n
        )
    row, col = fused_lse(zx, zy, scale, kernel)
    got = fused_embedding_grads(zx, zy, row, col, scale, 0, kernel, panel=SELF_CHECK_PANEL)
    want_row, want_col = streamed_row_col_lse(x32, y32, scale, n)
    return (row, col, *got), (want_row, want_col, *streamed_softmax_grads(x32, y32, want_row, want_col, scale, 0, n))


@functools.cache
def _agrees_on_device(kernel: str, device: torch.device, dtype: torch.dtype, d: int, kind: str = "softmax") -> bool:
    """Once per (device, dtype, d, kind: "softmax" or "sigmoid"): the fused path against the PyTorch
    path on a small problem (SELF_CHECK_ROWS rows, two panels). A toolchain that miscompiles falls back to
    PyTorch with a warning."""
    gen = torch.Generator(device).manual_seed(0)
    zx, zy = (
        F.normalize(torch.randn(SELF_CHECK_ROWS, d, device=device, generator=gen), dim=1).to(dtype) for _ in range(2)
    )
    try:
        got, want = _fused_and_reference(kind, zx, zy, kernel)
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


def choose_path(
    kernel: str,
    objective: Any,
    z: Tensor,
    compute_dtype: torch.dtype | None,
    num_queries: int,
    num_columns: int,
) -> tuple[str, torch.dtype]:
    """(the path, the dtype the objective reads embeddings in) for `objective` on embeddings like
    `z`: the fused kernels where `kernel` asks for them (or "auto" finds them on the device) and the
    objective's problem is one they serve (`objective.fused`), else "pytorch" in z's own dtype.
    ValueError when `kernel` names a fused path for a problem the kernels do not serve."""
    if not objective.fused(num_queries, num_columns):
        if kernel in ("triton", "triton_exact"):
            raise ValueError(
                f"loss.kernel={kernel}: the fused kernels serve the plain symmetric problems only (no hard negatives, "
                f"no masking, no one-way loss); this run's is {objective.describe()} with {num_columns} columns for "
                f"{num_queries} queries: set loss.kernel=auto or pytorch"
            )
        return "pytorch", z.dtype
    dtype = loss_dtype(kernel, z.dtype, compute_dtype)
    path = resolve_kernel(kernel, z.to(dtype), objective.kernel_kind)
    return path, dtype if path != "pytorch" else z.dtype
