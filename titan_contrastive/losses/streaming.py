"""The contrastive losses over blocks of rows x all columns, never the whole logit matrix: the
PyTorch path of the streamed forms (`losses/infonce.py`, `losses/sigmoid.py` call these; the
fused Triton path is `losses/fused.py`).

Notation: a rank owns rows (queries) Zx[own] and sees all M columns Zy (documents: the N
positives, column i being query i's, then any hard negatives). S = s Zx Zy^T with s = exp(t').
A mask (`BlockMask`, false negatives) removes entries of S from the problem: they are -inf in
the softmax and absent from the sigmoid sum. The positive S_ii is never masked.

Softmax (InfoNCE), row LSE a_i = logsumexp_j S_ij over the unmasked columns, column LSE b_j =
logsumexp_i S_ij over the unmasked rows for the N positive columns only (symmetric loss),
P = exp(S - a 1^T), Q = exp(S - 1 b^T) on the positive columns (0 elsewhere):

    one-way    L = 1/N sum_i (a_i - S_ii)                  dL/dS = (P - I) / N
    symmetric  L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)       dL/dS = (P + Q - 2I) / (2N)
    dL/dZx = s dL/dS Zy,  dL/dZy = s dL/dS^T Zx,  dL/ds = <Zx, dL/dZx> / s.

Every function touches S in blocks of at most `chunk` rows by M, so the extra memory is
O(chunk M + M d); the logits are formed in at least float32. The forward (`streamed_row_col_lse`)
gives a rank's row LSEs and partial column LSEs, which the caller merges over ranks with a
logsumexp; the backward (`streamed_softmax_grads`) recomputes the same rows once: W per block,
then dZx[own] = W Zy and this rank's share of dZy = W^T Zx[own] as GEMMs (the caller sums the
shares over ranks). On CPU each block's elementwise passes run on row tiles of ~`TILE_BYTES`, so
they stay in cache; the forward takes one exp per logit (the column sums reuse the row pass's
exponentials, with an exact fallback for columns where that could underflow), the backward two.
A `KeptBlock` lets the backward start with the forward's last block instead of recomputing it.

Sigmoid (SigLIP), l = S + b, z = +1 on the positives, -1 elsewhere, masked pairs left out:
L = -(1/N) sum log sigmoid(z l), a sum over pairs, so one pass (`streamed_sigmoid`) gives the
loss terms and both gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# (logits of own rows start.. [rows, M], start) -> bool [rows, M], True where masked, or None
BlockMask = Callable[[Tensor, int], "Tensor | None"]
# (logits of own rows start.. [rows, M], start) -> None: reweights the block in place (hardness)
BlockWeight = Callable[[Tensor, int], None]

TILE_BYTES = 2 << 20  # CPU: a block's elementwise passes run on ~2 MiB row tiles, which stay in cache between passes


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """float32 for low-precision embeddings, else their own dtype (float32 / float64)."""
    return torch.promote_types(x.dtype, torch.float32)


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


def _masked_logits_into(
    out: Tensor,
    queries: Tensor,
    keys: Tensor,
    scale: float,
    mask: BlockMask | None,
    start: int,
    weight: BlockWeight | None = None,
) -> Tensor:
    """`_logits_into`, then -inf where `mask` says so (the rows are own rows start, start + 1, ...),
    then the hardness `weight` (`losses/hardness.py`), in place."""
    _logits_into(out, queries, keys, scale)
    if mask is not None and (masked := mask(out, start)) is not None:
        out.masked_fill_(masked, -math.inf)
    if weight is not None:
        weight(out, start)
    return out


def _underflow_margin(dtype: torch.dtype, rows: int) -> float:
    """How far (in log units, negative) a sum of `rows` exponentials exp(x - shift) may lie below
    its shift and still be exact: each term that flushes or goes subnormal is off by less than
    the smallest normal `tiny`, so a sum >= rows * tiny / eps (e times that, for margin) is off by
    less than one rounding error. fp32: about -63 at 1K rows; fp64: about -664."""
    info = torch.finfo(dtype)
    return math.log(rows * info.tiny / info.eps) + 1.0


class KeptBlock:
    """The last block of logits of a `streamed_row_col_lse` call (masked entries already -inf),
    kept for the `streamed_softmax_grads` call on the same rows that follows: that one starts with
    this block instead of recomputing it (one of the four GEMMs of a block saved; a quarter of all
    the work when the rows fit in one chunk), in the same buffer, so no extra memory. Used only if
    the embeddings, their versions and the scale are those of the LSE call; emptied when used."""

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
    zx_own: Tensor,
    zy: Tensor,
    scale: Tensor | float,
    chunk: int,
    keep: KeptBlock | None = None,
    *,
    lse_columns: int | None = None,
    mask: BlockMask | None = None,
    weight: BlockWeight | None = None,
) -> tuple[Tensor, Tensor]:
    """(row LSE of the rows `zx_own` [c], their partial column LSE of the first `lse_columns`
    columns [lse_columns]; default all) in one pass over S[own, :], `chunk` rows x M at a time;
    the PyTorch twin of `fused.fused_lse`.

    The global column LSE is the logsumexp of the partials over ranks (or over any split of the
    rows). Per block, on tiles of rows: E = exp(S - m) with m the tile's row maxima gives the
    row sums; the column sums come from the same E, sum_i E_ij exp(m_i - M) (a GEMV, M the
    tile's largest m), so each logit takes one exp. A column whose block sum lies so far below
    the block's shift that flushed terms could matter (fp32: below ~e^-63) is recomputed from the
    block's logits with a plain logsumexp, so the result is exact in every case; a column all of
    whose entries in a block are masked is -inf there. `keep`: the last block stays there for
    `streamed_softmax_grads`.
    """
    acc = accumulation_dtype(zx_own)
    c, m = len(zx_own), len(zy)
    n_lse = m if lse_columns is None else lse_columns
    dev = zx_own.device
    s = float(scale)
    row_lse = torch.empty(c, dtype=acc, device=dev)
    if c == 0:
        return row_lse, torch.full((n_lse,), -math.inf, dtype=acc, device=dev)
    block_buf = torch.empty(min(chunk, c), m, dtype=acc, device=dev)
    tile = min(_tile_rows(block_buf), len(block_buf))
    tiles_per_block = -(-len(block_buf) // tile)
    exps = torch.empty(tile, m, dtype=acc, device=dev)
    col_parts = torch.empty(tiles_per_block, n_lse, dtype=acc, device=dev)  # per tile: log sum_i exp(S_ij - M_tile)
    shifts = torch.empty(tiles_per_block, 1, dtype=acc, device=dev)
    col_lse = torch.full((n_lse,), -math.inf, dtype=acc, device=dev)
    for start in range(0, c, chunk):
        stop = min(start + chunk, c)
        block = _masked_logits_into(block_buf[: stop - start], zx_own[start:stop], zy, s, mask, start, weight)
        k = 0
        for t0 in range(0, len(block), tile):
            logits = block[t0 : t0 + tile]
            rows, e = row_lse[start + t0 : start + t0 + len(logits)], exps[: len(logits)]
            row_max = logits.amax(1).clamp_(min=torch.finfo(acc).min)  # a row masked throughout: -inf, not nan
            torch.sub(logits, row_max[:, None], out=e).exp_()
            torch.sum(e, 1, out=rows)
            rows.log_().add_(row_max)
            if n_lse:
                torch.amax(row_max, 0, keepdim=True, out=shifts[k])
                torch.mv(e[:, :n_lse].T, row_max.sub_(shifts[k]).exp_(), out=col_parts[k])
            k += 1
        if not n_lse:
            continue
        parts = col_parts[:k].log_().add_(shifts[:k])
        block_col = parts[0] if k == 1 else torch.logsumexp(parts, 0)
        suspect = block_col < shifts[:k].max() + _underflow_margin(acc, len(block))
        if suspect.any():  # flushed terms might matter: those columns straight from the logits
            cols = suspect.nonzero()[:, 0]
            block_col[cols] = torch.logsumexp(block[:, cols], 0)
        torch.logaddexp(col_lse, block_col, out=col_lse)
    if keep is not None:
        keep.buffer, keep.start, keep.key = block_buf, start, KeptBlock.key_of(zx_own, zy, s, chunk)
    return row_lse, col_lse


def streamed_softmax_grads(
    zx_own: Tensor,
    zy: Tensor,
    row_lse_own: Tensor,
    col_lse: Tensor | None,
    scale: Tensor | float,
    first_row: int,
    chunk: int,
    keep: KeptBlock | None = None,
    *,
    num_queries: int | None = None,
    mask: BlockMask | None = None,
    weight: BlockWeight | None = None,
    positive: bool = True,
) -> tuple[Tensor, Tensor]:
    """(dL/dZx[own] [c, d], this rank's share of dL/dZy [M, d]) from one recompute of S[own, :],
    `chunk` rows x M at a time; the PyTorch twin of `fused.fused_embedding_grads`.

    row_lse_own: the LSEs a of these rows; col_lse: the global column LSEs b of the first
    len(col_lse) columns (the symmetric loss), or None (one-way); first_row: the global index of
    zx_own[0] (its positive is column first_row); num_queries: N (default M). Per block, W = P + Q
    - 2I (symmetric) or P - I (on tiles of rows that stay in cache on CPU), then dZx[rows] = W Zy
    and dZy += W^T Zx[rows], both GEMMs scaled by s/(2N) or s/N (low-precision embeddings take W
    in their dtype, as the fused kernel does). Blocks run last to first, so the first can be the
    one `keep` holds from the LSE pass. `positive=False` (a joint direction's extra candidates,
    `losses/directions.py`): W = P, no positive on the diagonal. `mask` and `weight` must be those of
    the LSE pass (the weight has no gradient: W multiplies s Zy and s Zx as without it).
    """
    acc = accumulation_dtype(zx_own)
    c, m = len(zx_own), len(zy)
    n = num_queries or m
    dev = zx_own.device
    s = float(scale)
    symmetric = col_lse is not None
    coef = s / (2 * n) if symmetric else s / n
    gx = torch.empty(c, zy.shape[1], dtype=acc, device=dev)
    if c == 0:
        return gx, torch.zeros(m, zy.shape[1], dtype=acc, device=dev)
    gy = torch.empty(m, zy.shape[1], dtype=acc, device=dev)  # written by the first block's product, then summed into
    block_buf, kept = keep.take(KeptBlock.key_of(zx_own, zy, s, chunk)) if keep is not None else (None, -1)
    if block_buf is None:
        block_buf = torch.empty(min(chunk, c), m, dtype=acc, device=dev)
    tile = min(_tile_rows(block_buf), len(block_buf))
    p = torch.empty(tile, m, dtype=acc, device=dev) if symmetric else None
    n_q = len(col_lse) if symmetric else 0
    col_shift = col_lse[None, :] if symmetric else None
    low = zy.dtype != acc
    starts = range(0, c, chunk)
    for start in reversed(starts):
        stop, first = min(start + chunk, c), start == starts[-1]
        block = block_buf[: stop - start]
        if start != kept:
            _masked_logits_into(block, zx_own[start:stop], zy, s, mask, start, weight)
        for t0 in range(0, len(block), tile):
            logits = block[t0 : t0 + tile]
            rows = row_lse_own[start + t0 : start + t0 + len(logits), None]
            if not symmetric:
                logits.sub_(rows).exp_()  # P, in place
                continue
            pt = p[: len(logits)]
            torch.sub(logits, rows, out=pt).exp_()  # P
            logits[:, :n_q].sub_(col_shift).exp_()  # Q on the positive columns
            logits[:, n_q:].zero_()
            logits.add_(pt)
        if positive:
            block.diagonal(first_row + start).sub_(2 if symmetric else 1)  # - 2I (- I) on the global diagonal
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


def sigmoid_block(block: Tensor, bias: Tensor | float, diag_start: int, masked: Tensor | None) -> tuple[Tensor, Tensor]:
    """SigLIP's terms of one block of logits without their bias, s <x_r, y_j> (or s MaxSim) for rows r whose
    positives are the columns diag_start + r (those in the block: a tile of columns may hold some or none), turned in
    place into W = -z sigmoid(-z l) (l = block + b, z = +1 at the positives, -1 elsewhere; 0 where `masked`):
    (-sum log sigmoid(z l) over the unmasked pairs, W)."""
    signed = block.add_(bias).neg_()  # z l, built in place: -l, then +l on the diagonal
    first, last = max(0, -diag_start), min(len(signed), signed.shape[1] - diag_start)  # rows whose positive is here
    r = torch.arange(first, max(first, last), device=signed.device)  # from ints: no device-to-host sync
    diag = (r, diag_start + r)
    signed[diag] = -signed[diag]
    if masked is not None:  # log sigmoid(+inf) = 0 and sigmoid(-inf) = 0: a masked pair adds nothing
        signed.masked_fill_(masked, math.inf)
    loss = -F.logsigmoid(signed).sum()
    w = signed.neg_().sigmoid_()  # sigmoid(-z l)
    w[diag] *= -1  # -z sigmoid(-z l) = N dL/dl
    return loss, w


def streamed_sigmoid(
    zx_own: Tensor,
    zy: Tensor,
    scale: Tensor | float,
    bias: Tensor | float,
    first_row: int,
    chunk: int,
    num_pairs: int | None = None,
    *,
    mask: BlockMask | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SigLIP's loss over the rows `zx_own` (global rows first_row, ...) against all columns `zy`,
    and its gradients, in one pass over blocks of `chunk` rows x M (N = `num_pairs`, default M).

    l = s Zx Zy^T + b, z = +1 on the global diagonal, -1 elsewhere, L = -(1/N) sum log sigmoid(z l)
    over the unmasked pairs; W = dL/dl = -z sigmoid(-z l) / N (0 where masked). Returns (these
    rows' part of L, dL/dZx[own] = s W Zy, this rank's share of dL/dZy = s W^T Zx[own] for all M
    columns (the caller sums the shares over ranks), dL/db per own row = W summed over columns).
    A sum over pairs needs no normalizer: one block of logits per step of the loop.
    """
    n = num_pairs or len(zy)
    acc = accumulation_dtype(zx_own)
    gx = torch.empty(len(zx_own), zx_own.shape[1], dtype=acc, device=zx_own.device)
    gy = torch.zeros(len(zy), zy.shape[1], dtype=acc, device=zy.device)
    bias_rows = torch.empty(len(zx_own), dtype=acc, device=zx_own.device)
    loss = torch.zeros((), dtype=acc, device=zx_own.device)
    s = float(scale)
    for start in range(0, len(zx_own), chunk):
        rows = slice(start, start + chunk)
        block = torch.empty(len(zx_own[rows]), len(zy), dtype=acc, device=zx_own.device)
        _logits_into(block, zx_own[rows], zy, s)
        part, w = sigmoid_block(block, bias, first_row + start, mask(block, start) if mask is not None else None)
        loss += part
        gx[rows] = w.to(zy.dtype) @ zy
        gy += w.T.to(zx_own.dtype) @ zx_own[rows]
        bias_rows[rows] = w.sum(1)
    return loss / n, gx.mul_(s / n), gy.mul_(s / n), bias_rows.div_(n)
