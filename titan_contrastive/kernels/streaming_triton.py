"""Fused Triton kernels for the streaming symmetric InfoNCE: one pass over S forward, one recompute backward.

S = scale · Q K^T for a block of rows Q [M, d] (this rank's) against columns K [N, d] (all of
them) is formed tile by tile in registers and never stored:

`row_col_lse(q, k, scale)` -> (row LSE [M] over all N columns, column LSE [N] over these M
rows only). One pass over the tiles: every tile updates its rows' online max / sum (in
registers) and its columns' online max / sum (a per-program partial in memory, merged by one
logsumexp over the programs at the end of each column panel). A rank's column LSEs are partial;
the distributed step merges them over ranks (seed 001's all-gather design).

`softmax_weights(q, k, row_lse, col_lse, scale, diag_offset, out)` -> W = exp(S - a 1^T) +
exp(S - 1 b^T) - 2 I (the identity shifted by `diag_offset`: row i's positive is column
i + diag_offset), written in the input dtype (bf16/fp16) or float32. This is the only place the
backward recomputes S: both embedding gradients are then GEMMs on the same W (dZx = W Zy,
dZy = W^T Zx, cuBLAS), done panel by panel in losses/fused.py: 8 N^2 d FLOPs, as
the PyTorch path (same organisation), with S never in memory.

`sigmoid_weights(q, k, scale, bias, diag_offset, out, loss_rows, bias_rows)` -> W = dL/dl of
SigLIP's sigmoid loss up to 1/N, -z sigmoid(-z l) with l = S + bias and z = +1 on the shifted
diagonal, -1 elsewhere, written like the softmax W; the same tile also adds each row's loss terms
-log sigmoid(z l) and its W sum (dL/db) into float32 row vectors (atomic adds across column
tiles). A sum over pairs needs no normalizer: this is the loss's only pass over S, forward and
backward at once, and the GEMMs on W give both embedding gradients.

Inputs: bf16 / fp16 / fp32, row-major contiguous, d <= 1024, any M, N (masked tails). The
logit tile is fp32; bf16/fp16 go through the tensor-core dot with fp32 accumulators; `exact`
computes the dot in IEEE fp32 (inputs upcast) instead of TF32 / bf16. Tiles are autotuned per
(d, dtype) on CUDA, of two kinds: both sides streamed over d, or the row block resident in shared
memory while its program sweeps columns (bf16 / fp16; kernels/tiles.py). Set TRITON_INTERPRET=1
before importing this module to run it on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_contrastive.kernels.tiles import INTERPRET, LSE_CONFIGS, SIGMOID_CONFIGS, WEIGHT_CONFIGS, prune_resident

__all__ = ["row_col_lse", "sigmoid_weights", "softmax_weights"]

LSE_PANEL = 8192  # columns per forward launch: the per-program partials are programs x LSE_PANEL floats
# The kernels exponentiate in base 2 (exp(x) = 2^(x log2 e)): Triton's exp2 is the hardware's
# ex2.approx.ftz, one instruction; its exp adds a multiply and a subnormal fix-up around it.
_LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
LOG2E = tl.constexpr(_LOG2E)


@triton.jit
def _dot(q, k, EXACT: tl.constexpr):
    """q · k^T as fp32: IEEE fp32 products when EXACT, else the inputs' tensor-core dot."""
    if EXACT:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _load_rows(ptr, rows, n, d, d0, BLOCK_D: tl.constexpr):
    """Embeddings [rows, d0 : d0 + BLOCK_D] (zero past n rows and d dims): a d-slice of a streamed
    tile, or (d0 = 0, BLOCK_D >= d) a resident row block or a column tile against it."""
    dims = d0 + tl.arange(0, BLOCK_D)
    return tl.load(ptr + rows[:, None] * d + dims[None, :], mask=(rows[:, None] < n) & (dims[None, :] < d), other=0.0)


@triton.jit
def _tile_dots(
    q,
    q_ptr,
    k_ptr,
    rows,
    cols,
    n_q,
    n_k,
    d,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    """The fp32 tile Q[rows] · K[cols]^T (unscaled: each kernel folds its scale into the next
    instruction): from the resident row block `q` and the columns, or both sides streamed over d in
    BLOCK_D slices."""
    if RESIDENT:
        return _dot(q, _load_rows(k_ptr, cols, n_k, d, 0, BLOCK_D), EXACT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        acc += _dot(_load_rows(q_ptr, rows, n_q, d, d0, BLOCK_D), _load_rows(k_ptr, cols, n_k, d, d0, BLOCK_D), EXACT)
    return acc


@triton.jit
def _lse_tile_update(s, edge, row_ok, cols, col_ok, r_max, r_sum, col_max_ptr, col_sum_ptr):
    """One fp32 tile `s` of the forward pass, in base-2 units (scale · log2 e · q·k): its rows'
    online (max, sum of 2^(s - max)), returned, and its columns' partial (max, sum) in memory,
    updated. Padded rows and columns count as -inf; only a tile on the `edge` of the block has them."""
    if edge:
        s = tl.where(row_ok[:, None] & col_ok[None, :], s, float("-inf"))
    new_max = tl.maximum(r_max, tl.max(s, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # padded rows: no inf - inf
    r_sum = r_sum * tl.math.exp2(r_max - shift) + tl.sum(tl.math.exp2(s - shift[:, None]), axis=1)
    c_max = tl.load(col_max_ptr + cols, mask=col_ok, other=float("-inf"))
    c_sum = tl.load(col_sum_ptr + cols, mask=col_ok, other=0.0)
    new_c = tl.maximum(c_max, tl.max(s, axis=0))
    c_shift = tl.where(new_c == float("-inf"), 0.0, new_c)
    c_sum = c_sum * tl.math.exp2(c_max - c_shift) + tl.sum(tl.math.exp2(s - c_shift[None, :]), axis=0)
    tl.store(col_max_ptr + cols, new_c, mask=col_ok)
    tl.store(col_sum_ptr + cols, c_sum, mask=col_ok)
    return new_max, r_sum


@triton.jit
def _softmax_w_tile(acc, scale2, a2, b2, r0, c0, diag_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """W's fp32 tile (rows r0 ..., columns c0 ...) from the raw dots `acc`: 2^(acc scale2 - a2) +
    2^(acc scale2 - b2), i.e. exp(S - a) + exp(S - b) with S = scale · q·k, `scale2` = scale · log2 e
    and the LSEs in base 2 (a2 = a · log2 e), minus 2 on the shifted diagonal: only a tile that
    crosses it compares indices."""
    w = tl.math.exp2(tl.fma(acc, scale2, -a2[:, None])) + tl.math.exp2(tl.fma(acc, scale2, -b2[None, :]))
    if (r0 + diag_offset < c0 + BLOCK_N) & (c0 < r0 + diag_offset + BLOCK_M):
        rows, cols = r0 + tl.arange(0, BLOCK_M), c0 + tl.arange(0, BLOCK_N)
        w -= 2.0 * (cols[None, :] == rows[:, None] + diag_offset).to(tl.float32)
    return w


if INTERPRET:

    @triton.jit
    def _rcp(x):
        """1 / x (the interpreter's numpy division)."""
        return 1.0 / x

else:

    @triton.jit
    def _rcp(x):
        """1 / x for x in [2, 6]: the MUFU's approximate reciprocal (rcp.approx.ftz, 1 ulp), one
        instruction where `/` wraps range checks and rescaling around it."""
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _sigmoid_tile(logits, positive_tile, rows, cols, diag_offset):
    """(-log sigmoid(z l), W = -z sigmoid(-z l)) of a tile of logits l, z = +1 on the shifted
    diagonal and -1 elsewhere; only a tile that crosses the diagonal (`positive_tile`) compares
    indices. With x = -z l and e = exp(-|x|) (one exponential): -log sigmoid(-x) = max(x, 0) +
    log1p(e) and sigmoid(x) = (1 or e) / (1 + e). log1p(e) is 2 atanh(t), t = e / (2 + e) <= 1/3,
    by its odd series to t^13 (truncation below 1e-8 relative): every digit of e is kept where
    log(1 + e) would round 1 + e to 1. 1 / (1 + e) and 1 / (2 + e) come from one reciprocal of
    their product."""
    x = logits
    if positive_tile:
        x = tl.where(cols[None, :] == rows[:, None] + diag_offset, -logits, logits)
    e = tl.math.exp2(-tl.abs(x) * LOG2E)
    p, q = 1.0 + e, 2.0 + e
    r = _rcp(p * q)
    t = e * r * p
    t2 = t * t
    log1p_e = 2.0 * t * (1.0 + t2 * (1 / 3 + t2 * (1 / 5 + t2 * (1 / 7 + t2 * (1 / 9 + t2 * (1 / 11 + t2 / 13))))))
    w = tl.where(x > 0.0, 1.0, e) * (r * q)
    if positive_tile:
        w = tl.where(cols[None, :] == rows[:, None] + diag_offset, -w, w)
    return tl.maximum(x, 0.0) + log1p_e, w


@triton.autotune(
    configs=LSE_CONFIGS,
    key=["d", "EXACT"],
    restore_value=["row_max_ptr", "row_sum_ptr", "col_max_ptr", "col_sum_ptr"],
    prune_configs_by={"early_config_prune": prune_resident},
)
@triton.jit
def _lse_pass_kernel(
    q_ptr,
    k_ptr,
    row_max_ptr,
    row_sum_ptr,
    col_max_ptr,
    col_sum_ptr,
    n_q,
    n_k,
    d,
    col_stride,
    scale2,
    N_PROGRAMS: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    # Program p owns row blocks p, p + P, ... and one row of the column partials. Per row block:
    # load its rows' running (max, sum) -> sweep every column tile of the panel, updating the rows
    # in registers and the columns' partials in memory -> store the rows -> barrier (the next row
    # block reads the column partials this one wrote).
    pid = tl.program_id(0)
    col_max_ptr += pid * col_stride
    col_sum_ptr += pid * col_stride
    for block in range(pid, tl.cdiv(n_q, BLOCK_M), N_PROGRAMS):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_q
        r_max = tl.load(row_max_ptr + rows, mask=row_ok, other=float("-inf"))
        r_sum = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)
        if RESIDENT:  # the rows' embeddings, loaded once for all the tiles below (BLOCK_D >= d)
            q = _load_rows(q_ptr, rows, n_q, d, 0, BLOCK_D)
        else:
            q = 0.0  # unused: the tiles stream both sides
        for c0 in range(0, n_k, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n_k
            s = scale2 * _tile_dots(
                q, q_ptr, k_ptr, rows, cols, n_q, n_k, d, EXACT, BLOCK_M, BLOCK_N, BLOCK_D, RESIDENT
            )
            edge = (block * BLOCK_M + BLOCK_M > n_q) | (c0 + BLOCK_N > n_k)
            r_max, r_sum = _lse_tile_update(s, edge, row_ok, cols, col_ok, r_max, r_sum, col_max_ptr, col_sum_ptr)
        tl.store(row_max_ptr + rows, r_max, mask=row_ok)
        tl.store(row_sum_ptr + rows, r_sum, mask=row_ok)
        tl.debug_barrier()


@triton.autotune(configs=WEIGHT_CONFIGS, key=["d", "EXACT"], prune_configs_by={"early_config_prune": prune_resident})
@triton.jit
def _weights_kernel(
    q_ptr,
    k_ptr,
    a_ptr,
    b_ptr,
    w_ptr,
    n_q,
    n_k,
    d,
    w_stride,
    scale2,
    diag_offset,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDENT: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    # Program (i, j): row block i against column tiles j * COL_TILES ... (j + 1) * COL_TILES - 1.
    r0 = tl.program_id(0) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    a2 = tl.load(a_ptr + rows, mask=rows < n_q, other=0.0) * LOG2E
    if RESIDENT:  # the rows' embeddings, loaded once for all the tiles below (BLOCK_D >= d)
        q = _load_rows(q_ptr, rows, n_q, d, 0, BLOCK_D)
    else:
        q = 0.0  # unused: the tiles stream both sides
    for t in range(COL_TILES):
        c0 = (tl.program_id(1) * COL_TILES + t) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        acc = _tile_dots(q, q_ptr, k_ptr, rows, cols, n_q, n_k, d, EXACT, BLOCK_M, BLOCK_N, BLOCK_D, RESIDENT)
        b2 = tl.load(b_ptr + cols, mask=cols < n_k, other=0.0) * LOG2E
        w = _softmax_w_tile(acc, scale2, a2, b2, r0, c0, diag_offset, BLOCK_M, BLOCK_N).to(w_ptr.dtype.element_ty)
        tile = w_ptr + rows[:, None] * w_stride + cols[None, :]
        if (r0 + BLOCK_M > n_q) | (c0 + BLOCK_N > n_k):  # only an edge tile masks its store
            tl.store(tile, w, mask=(rows[:, None] < n_q) & (cols[None, :] < n_k))
        else:
            tl.store(tile, w)


@triton.autotune(
    configs=SIGMOID_CONFIGS,
    key=["d", "EXACT"],
    restore_value=["loss_ptr", "bias_ptr"],
    prune_configs_by={"early_config_prune": prune_resident},
)
@triton.jit
def _sigmoid_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    loss_ptr,
    bias_ptr,
    n_q,
    n_k,
    d,
    w_stride,
    scale,
    bias,
    diag_offset,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDENT: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    # Program (i, j): row block i against column tiles j * COL_TILES ... (j + 1) * COL_TILES - 1; the
    # rows' loss terms and W sums are summed over its tiles, then added once (atomically).
    r0 = tl.program_id(0) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    if RESIDENT:  # the rows' embeddings, loaded once for all the tiles below (BLOCK_D >= d)
        q = _load_rows(q_ptr, rows, n_q, d, 0, BLOCK_D)
    else:
        q = 0.0  # unused: the tiles stream both sides
    loss_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    w_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for t in range(COL_TILES):
        c0 = (tl.program_id(1) * COL_TILES + t) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        logits = tl.fma(
            _tile_dots(q, q_ptr, k_ptr, rows, cols, n_q, n_k, d, EXACT, BLOCK_M, BLOCK_N, BLOCK_D, RESIDENT),
            scale,
            bias,
        )
        positive_tile = (r0 + diag_offset < c0 + BLOCK_N) & (c0 < r0 + diag_offset + BLOCK_M)
        loss, w = _sigmoid_tile(logits, positive_tile, rows, cols, diag_offset)
        tile = w_ptr + rows[:, None] * w_stride + cols[None, :]
        if (r0 + BLOCK_M > n_q) | (c0 + BLOCK_N > n_k):  # only an edge tile has padding to mask
            valid = (rows[:, None] < n_q) & (cols[None, :] < n_k)
            w = tl.where(valid, w, 0.0)
            loss = tl.where(valid, loss, 0.0)
            tl.store(tile, w.to(w_ptr.dtype.element_ty), mask=valid)
        else:
            tl.store(tile, w.to(w_ptr.dtype.element_ty))
        loss_sum += tl.sum(loss, axis=1)
        w_sum += tl.sum(w, axis=1)
    tl.atomic_add(loss_ptr + rows, loss_sum, mask=rows < n_q)
    tl.atomic_add(bias_ptr + rows, w_sum, mask=rows < n_q)


def _exact(exact: bool) -> bool:
    """Triton 3.9's interpreter computes bf16/fp16 tl.dot wrongly (garbage); under it the tiles are
    upcast and multiplied in IEEE fp32, so CPU tests check everything but the low-precision dot
    itself, which the CUDA test covers."""
    return exact or INTERPRET


def _check(queries: Tensor, keys: Tensor) -> None:
    if queries.ndim != 2 or keys.ndim != 2 or queries.shape[1] != keys.shape[1]:
        raise ValueError(
            f"queries and keys must be [M, d] and [N, d] with the same d, got {list(queries.shape)} and "
            f"{list(keys.shape)}"
        )
    if not (queries.is_contiguous() and keys.is_contiguous()):
        raise ValueError(
            "the Triton contrastive kernels need row-major contiguous embeddings; call .contiguous() first"
        )
    if queries.dtype != keys.dtype or queries.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"embeddings must share one of float32 / bfloat16 / float16, got {queries.dtype} and {keys.dtype} "
            "(float64: use loss.kernel=pytorch)"
        )
    if queries.shape[1] > 1024:
        raise ValueError(
            f"embedding dim {queries.shape[1]} > 1024 is not supported by the Triton kernels; use [loss] kernel = "
            '"pytorch"'
        )


def _programs(rows: int, device: torch.device) -> int:
    """Forward programs: about two per SM (each sweeps whole row blocks); two under the interpreter,
    so tests see a program own several row blocks."""
    target = 2 if device.type != "cuda" else 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(target, triton.cdiv(rows, 16)))


def row_col_lse(
    queries: Tensor, keys: Tensor, scale: float, *, exact: bool = False, panel: int = LSE_PANEL
) -> tuple[Tensor, Tensor]:
    """(logsumexp_j S_ij for every query [M], logsumexp_i S_ij over these queries for every key [N]), float32.

    One pass over S = scale · queries · keys^T; extra memory 2 x programs x `panel` floats.
    """
    _check(queries, keys)
    m, n, d = len(queries), len(keys), queries.shape[1]
    f32 = dict(dtype=torch.float32, device=queries.device)
    row_max, row_sum = torch.full((m,), float("-inf"), **f32), torch.zeros(m, **f32)
    col_lse = torch.empty(n, **f32)
    programs = _programs(m, queries.device)
    col_max, col_sum = torch.empty(programs, min(panel, n), **f32), torch.empty(programs, min(panel, n), **f32)
    for c0 in range(0, n, panel):  # column panels: the partials' memory does not grow with N
        width = min(panel, n - c0)
        col_max.fill_(float("-inf"))
        col_sum.zero_()
        _lse_pass_kernel[(programs,)](
            queries,
            keys[c0 : c0 + width],
            row_max,
            row_sum,
            col_max,
            col_sum,
            m,
            width,
            d,
            col_max.stride(0),
            float(scale) * _LOG2E,
            programs,
            _exact(exact),
        )
        # the partials are in base 2 (max of scale log2 e q·k, sum of 2^(s - max))
        col_lse[c0 : c0 + width] = torch.logsumexp((col_max[:, :width] + col_sum[:, :width].log2()) * LN2, dim=0)
    return (row_max + row_sum.log2()) * LN2, col_lse


def _panel_output(
    queries: Tensor, m: int, n: int, exact: bool, out: Tensor | None
) -> tuple[Tensor, Callable[[dict], tuple[int, int]]]:
    """The W panel to write (`out`, checked, or a new one in the inputs' dtype; float32 when exact)
    and the launch grid over its tiles."""
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32 if exact else queries.dtype, device=queries.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(
            f"out must be [{m}, {n}] with unit column stride, got {list(out.shape)} strides {out.stride()}"
        )
    return out, lambda meta: (
        triton.cdiv(m, meta["BLOCK_M"]),
        triton.cdiv(n, meta["BLOCK_N"] * meta.get("COL_TILES", 1)),
    )


def softmax_weights(
    queries: Tensor,
    keys: Tensor,
    row_lse: Tensor,
    col_lse: Tensor,
    scale: float,
    diag_offset: int,
    *,
    exact: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """W [M, N] = exp(S - row_lse) + exp(S - col_lse) - 2 [j == i + diag_offset], S = scale · q·k.

    Written into `out` (any row stride, unit column stride; its dtype is W's) or a new tensor in
    the inputs' dtype (float32 when `exact`).
    """
    _check(queries, keys)
    m, n = len(queries), len(keys)
    if row_lse.shape != (m,) or col_lse.shape != (n,):
        raise ValueError(f"LSEs must be [{m}] and [{n}], got {list(row_lse.shape)} and {list(col_lse.shape)}")
    out, grid = _panel_output(queries, m, n, exact, out)
    _weights_kernel[grid](
        queries,
        keys,
        row_lse.float().contiguous(),
        col_lse.float().contiguous(),
        out,
        m,
        n,
        queries.shape[1],
        out.stride(0),
        float(scale) * _LOG2E,
        int(diag_offset),
        _exact(exact),
    )
    return out


def sigmoid_weights(
    queries: Tensor,
    keys: Tensor,
    scale: float,
    bias: float,
    diag_offset: int,
    *,
    loss_rows: Tensor,
    bias_rows: Tensor,
    exact: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """W [M, N] = -z sigmoid(-z (S + bias)), S = scale · q·k, z = +1 where j == i + diag_offset.

    Also adds each row's sum of -log sigmoid(z (S + bias)) into `loss_rows` and of W into
    `bias_rows` (float32 [M]). W goes into `out` (any row stride, unit column stride) or a new
    tensor in the inputs' dtype (float32 when `exact`).
    """
    _check(queries, keys)
    m, n = len(queries), len(keys)
    for name, rows in (("loss_rows", loss_rows), ("bias_rows", bias_rows)):
        if rows.shape != (m,) or rows.dtype != torch.float32 or not rows.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [{m}], got {rows.dtype} {list(rows.shape)}")
    out, grid = _panel_output(queries, m, n, exact, out)
    _sigmoid_kernel[grid](
        queries,
        keys,
        out,
        loss_rows,
        bias_rows,
        m,
        n,
        queries.shape[1],
        out.stride(0),
        float(scale),
        float(bias),
        int(diag_offset),
        _exact(exact),
    )
    return out
