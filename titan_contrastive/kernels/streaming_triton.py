"""Fused Triton kernels for the streaming symmetric InfoNCE (the two hot loops of streaming_loss.py).

`lse(queries, keys, scale)`: logsumexp_j(scale · q_i·k_j) for every query, one pass over key tiles
with an online max / sum (flash-attention's forward without values); S never leaves registers.

`softmax_pair_times(queries, keys, q_shift, k_shift, scale)`: Σ_j (exp(s_ij − q_shift_i) +
exp(s_ij − k_shift_j)) · k_j. Both shifts are final LSEs known from the forward, so no online
renormalisation is needed; this is the row-softmax plus column-softmax product that the
embedding gradients need (dZx with shifts (a, b) over Zy; dZy with shifts (b, a) over Zx).

Both take any N (masked tails), d up to 1024 (the dot products run over d in tiles of 64; the
output of the second kernel is split over d tiles of up to 256 on the grid, each recomputing S), bf16 / fp16 / fp32 inputs with fp32
accumulation (the logits tile is fp32; bf16/fp16 inputs go through the tensor-core dot with fp32
accumulators), and `exact=True` for IEEE fp32 dot products (inputs upcast) instead of TF32. Inputs must be
row-major contiguous (a clear error otherwise). Set TRITON_INTERPRET=1 before importing this
module to run the kernels on CPU (tests do).

Status: correctness is tested (interpreter on CPU, compiled on CUDA when present); speed is not
yet measured on a GPU, so the PyTorch path stays the default (`[loss] kernel = "pytorch"`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["lse", "softmax_pair_times"]

BLOCK_M, BLOCK_N, BLOCK_D = 32, 32, 64
MAX_BLOCK_OUT = 256  # output columns per program of the gradient kernel (register budget)


@triton.jit
def _scores(q_ptr, k_ptr, rows, cols, n_q, n_k, d, scale, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """scale · Q[rows] · K[cols]^T as an fp32 [BLOCK_M, BLOCK_N] tile, the dot product over d tiles."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=(rows[:, None] < n_q) & (dims[None, :] < d), other=0.0)
        k = tl.load(k_ptr + cols[:, None] * d + dims[None, :], mask=(cols[:, None] < n_k) & (dims[None, :] < d), other=0.0)
        if EXACT:
            acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(q, tl.trans(k))
    return acc * scale


@triton.jit
def _lse_kernel(q_ptr, k_ptr, out_ptr, n_q, n_k, d, scale, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c0 in range(0, n_k, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        s = _scores(q_ptr, k_ptr, rows, cols, n_q, n_k, d, scale, EXACT, BLOCK_M, BLOCK_N, BLOCK_D)
        s = tl.where(cols[None, :] < n_k, s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        running_max = new_max
    tl.store(out_ptr + rows, running_max + tl.log(running_sum), mask=rows < n_q)


@triton.jit
def _pair_kernel(q_ptr, k_ptr, qs_ptr, ks_ptr, out_ptr, n_q, n_k, d, scale, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_OUT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    out_dims = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)  # this program's output columns
    q_shift = tl.load(qs_ptr + rows, mask=rows < n_q, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_OUT), dtype=tl.float32)
    for c0 in range(0, n_k, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        s = _scores(q_ptr, k_ptr, rows, cols, n_q, n_k, d, scale, EXACT, BLOCK_M, BLOCK_N, BLOCK_D)
        k_shift = tl.load(ks_ptr + cols, mask=cols < n_k, other=float("inf"))  # masked columns weigh 0
        w = tl.exp(s - q_shift[:, None]) * (cols[None, :] < n_k) + tl.exp(s - k_shift[None, :])
        v = tl.load(k_ptr + cols[:, None] * d + out_dims[None, :], mask=(cols[:, None] < n_k) & (out_dims[None, :] < d), other=0.0)
        if EXACT:
            acc += tl.dot(w, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w.to(v.dtype), v)
    tl.store(out_ptr + rows[:, None] * d + out_dims[None, :], acc, mask=(rows[:, None] < n_q) & (out_dims[None, :] < d))


def _exact(exact: bool) -> bool:
    """Triton 3.9's interpreter computes bf16/fp16 tl.dot wrongly (garbage); under it the tiles are
    upcast and multiplied in IEEE fp32, so CPU tests check everything but the low-precision dot
    itself, which the CUDA test covers."""
    return exact or os.environ.get("TRITON_INTERPRET") == "1"


def _check(queries: Tensor, keys: Tensor) -> None:
    if queries.ndim != 2 or keys.ndim != 2 or queries.shape[1] != keys.shape[1]:
        raise ValueError(f"queries and keys must be [M, d] and [N, d] with the same d, got {list(queries.shape)} and {list(keys.shape)}")
    if not (queries.is_contiguous() and keys.is_contiguous()):
        raise ValueError("the Triton contrastive kernels need row-major contiguous embeddings; call .contiguous() first")
    if queries.dtype != keys.dtype or queries.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"embeddings must share one of float32 / bfloat16 / float16, got {queries.dtype} and {keys.dtype} "
                         "(float64: use loss.kernel=pytorch)")
    if queries.shape[1] > 1024:
        raise ValueError(f"embedding dim {queries.shape[1]} > 1024 is not supported by the Triton kernels; use [loss] kernel = \"pytorch\"")


def lse(queries: Tensor, keys: Tensor, scale: float, *, exact: bool = False, out: Tensor | None = None) -> Tensor:
    """[M] float32: logsumexp_j(scale · queries_i · keys_j) (into `out` if given)."""
    _check(queries, keys)
    out = torch.empty(len(queries), dtype=torch.float32, device=queries.device) if out is None else out
    grid = (triton.cdiv(len(queries), BLOCK_M),)
    _lse_kernel[grid](queries, keys, out, len(queries), len(keys), queries.shape[1], float(scale), _exact(exact), BLOCK_M, BLOCK_N, BLOCK_D)
    return out


def softmax_pair_times(queries: Tensor, keys: Tensor, q_shift: Tensor, k_shift: Tensor, scale: float, *, exact: bool = False,
                       out: Tensor | None = None) -> Tensor:
    """[M, d] float32: Σ_j (exp(s_ij − q_shift_i) + exp(s_ij − k_shift_j)) · keys_j, s = scale · q·k."""
    _check(queries, keys)
    if q_shift.shape != (len(queries),) or k_shift.shape != (len(keys),):
        raise ValueError(f"shifts must be [{len(queries)}] and [{len(keys)}], got {list(q_shift.shape)} and {list(k_shift.shape)}")
    out = torch.empty(queries.shape, dtype=torch.float32, device=queries.device) if out is None else out
    block_out = min(triton.next_power_of_2(queries.shape[1]), MAX_BLOCK_OUT)  # each output tile recomputes S once
    grid = (triton.cdiv(len(queries), BLOCK_M), triton.cdiv(queries.shape[1], block_out))
    _pair_kernel[grid](queries, keys, q_shift.float().contiguous(), k_shift.float().contiguous(), out, len(queries), len(keys),
                       queries.shape[1], float(scale), _exact(exact), BLOCK_M, BLOCK_N, BLOCK_D, block_out)
    return out
