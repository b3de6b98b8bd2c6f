"""The PyTorch path of the streaming softmax loss (`streamed_row_col_lse`, `streamed_softmax_grads`)
against autograd of the dense loss in float64.

Each function takes one rank's rows of S against all N columns: the row LSEs of those rows and
their partial column LSEs, then dZx for those rows and the rank's share of dZy. Here the ranks are
split by hand in one process (the column partials merged with logsumexp, the dZy shares summed), with
chunk sizes and CPU tile sizes that divide nothing, and an fp32 case whose column sums underflow
the one-exp shortcut (the exact fallback must catch it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_contrastive.components.memory_probe import LargestTensor
from titan_contrastive.losses import InfoNCE, streaming
from titan_contrastive.losses.streaming import KeptBlock, streamed_row_col_lse, streamed_softmax_grads

N, D, LOG_SCALE = 37, 24, 2.6  # s = e^2.6 ~ 13.5
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=1)


def loss_from_lse(
    zx: torch.Tensor, zy: torch.Tensor, row: torch.Tensor, col: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """CLIP's loss from its log-sum-exps: the mean over rows and columns of LSE - s <zx_i, zy_i>."""
    positive = s * (zx.to(row.dtype) * zy.to(row.dtype)).sum(1)
    return ((row - positive).mean() + (col - positive).mean()) / 2


def dense(x: torch.Tensor, y: torch.Tensor, log_scale: float) -> tuple[float, torch.Tensor, torch.Tensor, float]:
    """Autograd of the dense float64 loss: (L, dZx, dZy, dL/dlog s)."""
    x, y = x.double().clone().requires_grad_(), y.double().clone().requires_grad_()
    t = torch.tensor(log_scale, dtype=torch.float64, requires_grad=True)
    loss = InfoNCE().dense(x, y, t.exp())
    loss.backward()
    return loss.item(), x.grad, y.grad, t.grad.item()


def streamed(
    zx: torch.Tensor, zy: torch.Tensor, log_scale: float, chunk: int, shares: list[range], keep: bool = False
) -> tuple[float, torch.Tensor, torch.Tensor, float]:
    """The same four from the streamed functions, each share of rows called as one rank would be
    (`keep`: each with its KeptBlock, as the step does)."""
    acc = streaming.accumulation_dtype(zx)
    s = torch.tensor(log_scale, dtype=torch.float64).exp().to(acc)
    kept = [KeptBlock() if keep else None for _ in shares]
    lses = [streamed_row_col_lse(zx[r.start : r.stop], zy, s, chunk, k) for r, k in zip(shares, kept)]
    row = torch.cat([r for r, _ in lses])
    col = torch.stack([c for _, c in lses]).logsumexp(0)  # the all-gather + merge over ranks
    loss = loss_from_lse(zx, zy, row, col, s)
    grads = [
        streamed_softmax_grads(zx[r.start : r.stop], zy, row[r.start : r.stop], col, s, r.start, chunk, k)
        for r, k in zip(shares, kept)
    ]
    assert all(k is None or k.buffer is None for k in kept)  # emptied when used
    gx = torch.cat([g for g, _ in grads])
    gy = sum(g for _, g in grads)  # the reduce-scatter
    d_log_scale = (zx.to(acc) * gx).sum()  # dL/dlog s = <Zx, dL/dZx>
    return loss.item(), gx, gy, d_log_scale.item()


def assert_matches(got: tuple, want: tuple, tol: float) -> None:
    loss, gx, gy, dt = got
    want_loss, want_gx, want_gy, want_dt = want
    assert abs(loss - want_loss) <= tol * abs(want_loss)
    assert rel(gx, want_gx) <= tol and rel(gy, want_gy) <= tol
    assert abs(dt - want_dt) <= tol * abs(want_dt)


SPLITS = {
    "1 rank": [range(0, N)],
    "2 ranks": [range(0, 13), range(13, N)],
    "3 ranks": [range(0, 10), range(10, 11), range(11, N)],
}


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("chunk", [5, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_streamed_functions_equal_dense_autograd(dtype: torch.dtype, chunk: int, split: str, keep: bool) -> None:
    """Chunks of 5 and 16 divide no share; 64 holds every share in one block (then with `keep` the
    gradient pass computes no logits at all)."""
    x, y = unit(N, D, 0), unit(N, D, 1)
    want = dense(x, y, LOG_SCALE)
    assert_matches(streamed(x.to(dtype), y.to(dtype), LOG_SCALE, chunk, SPLITS[split], keep), want, TOL[dtype])


def test_a_kept_block_is_used_only_for_the_same_inputs() -> None:
    """The gradient pass starts with the kept block only when embeddings (storage, version) and scale
    are those of the LSE pass; else it recomputes. A block used for other inputs would give other
    gradients than the recompute: after each change they must be exactly the recomputed ones."""
    x, y = unit(N, D, 12), unit(N, D, 13)
    s = torch.tensor(13.0, dtype=torch.float64)
    for change in ("scale", "other tensor", "in place"):
        keep = KeptBlock()
        row, col = streamed_row_col_lse(x, y, s, 16, keep)
        assert keep.buffer is not None and keep.start == 32
        x2, s2 = x.flip(0).contiguous(), s
        if change == "scale":
            x2 = x
            s2 = torch.tensor(14.0, dtype=torch.float64)
        elif change == "in place":
            x2 = x
            x.mul_(-1)  # same storage, new version
        want = streamed_softmax_grads(x2, y, row, col, s2, 0, 16)
        got = streamed_softmax_grads(x2, y, row, col, s2, 0, 16, keep)
        assert keep.buffer is None
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), change


@pytest.mark.parametrize("tile_rows", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_cpu_tiles_that_divide_nothing(dtype: torch.dtype, tile_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The elementwise passes run on row tiles of ~TILE_BYTES inside each block: tiles of 1, 3 and 7
    rows in blocks of 16 (and a last block of 5), two ranks."""
    monkeypatch.setattr(streaming, "TILE_BYTES", tile_rows * N * torch.finfo(dtype).bits // 8)
    x, y = unit(N, D, 2), unit(N, D, 3)
    want = dense(x, y, LOG_SCALE)
    assert_matches(streamed(x.to(dtype), y.to(dtype), LOG_SCALE, 16, SPLITS["2 ranks"]), want, TOL[dtype])


def test_bfloat16_embeddings() -> None:
    """Low-precision embeddings: blocks in float32, W in bfloat16 for the products (as the fused kernel)."""
    x, y = unit(N, D, 4), unit(N, D, 5)
    want = dense(x.bfloat16(), y.bfloat16(), LOG_SCALE)  # the same rounded embeddings, in float64
    got = streamed(x.bfloat16(), y.bfloat16(), LOG_SCALE, 16, SPLITS["2 ranks"])
    assert got[1].dtype == got[2].dtype == torch.float32
    assert_matches(got, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_columns_far_below_the_shift_fall_back_exactly(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column 0 anti-aligned with every row at s = 60: its logits are < -55 where the row maxima are
    > +55, so in the one-exp column sums its terms are ~e^-120, below float32's smallest normal.
    The block's check sends it to a plain logsumexp: the column LSE, the loss and the gradients stay
    exact. (float32 to 3e-5 here: logits of magnitude 60 carry rounding errors of ~60 eps = 4e-6,
    so even dense float32 autograd is 7e-6 off in dZy; float64 to 1e-10 as everywhere.)"""
    x = F.normalize(unit(N, 4, 6) * 0.05 + torch.tensor([1.0, 0, 0, 0], dtype=torch.float64), dim=1)
    y = x.clone()
    y[0] = -x[1:].mean(0)
    y = F.normalize(y + 0.01 * unit(N, 4, 7), dim=1)
    s = 60.0 * (x @ y.T)
    assert (s[:, 0] < -55).all() and (s.amax(1) > 55).all()
    scale = torch.tensor(60.0, dtype=dtype)
    _, col = streamed_row_col_lse(x.to(dtype), y.to(dtype), scale, 16)
    assert torch.isfinite(col).all() and rel(col, torch.logsumexp(s, 0)) <= TOL[dtype]
    log_scale = float(torch.tensor(60.0, dtype=torch.float64).log())
    got = streamed(x.to(dtype), y.to(dtype), log_scale, 16, SPLITS["3 ranks"])
    assert_matches(got, dense(x, y, log_scale), 3e-5 if dtype == torch.float32 else TOL[dtype])
    if dtype == torch.float32:  # the case needs the fallback: without the check, column 0 underflows to -inf
        monkeypatch.setattr(streaming, "_underflow_margin", lambda dtype, rows: -float("inf"))
        _, col = streamed_row_col_lse(x.to(dtype), y.to(dtype), scale, 16)
        assert torch.isneginf(col[0])


def test_largest_tensor_is_one_block() -> None:
    """Never an N x N tensor: the largest any op makes is one chunk x N block of logits (here
    larger than the N x d gradients)."""
    n, chunk = 200, 40
    x, y = unit(n, D, 8).float(), unit(n, D, 9).float()
    s = torch.tensor(10.0)
    with LargestTensor() as probe:
        row, col = streamed_row_col_lse(x, y, s, chunk)
        streamed_softmax_grads(x, y, row, col, s, 0, chunk)
    assert probe.largest == chunk * n


def test_an_empty_share() -> None:
    """A rank with no rows: no row LSEs, a column partial of -inf (neutral in the merge), zero share of dZy."""
    x, y = unit(5, D, 10), unit(5, D, 11)
    s = torch.tensor(10.0, dtype=torch.float64)
    row, col = streamed_row_col_lse(x[:0], y, s, 4)
    assert row.shape == (0,) and torch.isneginf(col).all()
    gx, gy = streamed_softmax_grads(x[:0], y, row, col, s, 0, 4)
    assert gx.shape == (0, D) and not gy.any()
