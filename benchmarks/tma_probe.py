"""The fused loss's two kernels with TMA tensor-descriptor copies against today's pointer tiles (a Hopper probe).

    python -m benchmarks.tma_probe --out DIR                                    # CUDA: N = 64K, d = 512, bf16
    TRITON_INTERPRET=1 python -m benchmarks.tma_probe --n 150 --d 40 --check-n 90 --out /tmp/bench   # CPU

`_lse_tma` is `kernels/streaming_triton._lse_pass_kernel`'s streamed path and `_weights_tma` its
`_weights_kernel`'s, with the row and column slices loaded (and W stored) through
`tl.make_tensor_descriptor` (the copy engine on Hopper, pipelined like a GEMM's main loop) instead
of masked pointer loads; the tile arithmetic is the production kernels' own (`_lse_tile_update`,
`_softmax_w_tile`, `_dot`). The forward also comes with Hopper's automatic warp specialization of
its column loop (`tma_ws`). For the probe's calls a variant takes the production kernel's place in `row_col_lse` /
`softmax_weights`, so the fused loss runs it unchanged otherwise. First each variant is compiled and
checked in a child process (a compiler abort is a result, not the end of the probe): the forward's
LSEs and W against float64 at N = `--check-n`, on the inputs' own rounding. Then, side by side
(`harness.round_robin`, medians): each forward alone, each W kernel on one 8192 x 8192 panel, and the
whole fused loss (forward + backward) with each forward and with both descriptor kernels. Writes
`tma_probe_<device>.json`. Nothing here is used by the trainer: a winner moves into `kernels/` after
a GPU run shows it (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
import triton.language as tl

from benchmarks import harness, loss_bench
from titan_contrastive.config.job_config import Loss as LossConfig
from titan_contrastive.kernels import streaming_triton
from titan_contrastive.kernels.streaming_triton import LOG2E, _dot, _lse_tile_update, _softmax_w_tile
from titan_contrastive.kernels.tiles import INTERPRET

FORWARD_SHAPES = [
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 64, 64, 8, 3),
    (64, 256, 64, 4, 3),
]
WEIGHT_SHAPES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4)]
PANEL = 8192  # the W panel timed alone: the fused loss's (losses/fused.py FUSED_PANEL)


@triton.jit
def _lse_tma(
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
    WS: tl.constexpr,
):
    # _lse_pass_kernel's program layout; each d-slice of a tile comes through a descriptor, zero past
    # the last row or dim (the copy engine's padding) where the pointer kernel masks its loads
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_q, d], strides=[d, 1], block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[n_k, d], strides=[d, 1], block_shape=[BLOCK_N, BLOCK_D])
    pid = tl.program_id(0)
    col_max_ptr += pid * col_stride
    col_sum_ptr += pid * col_stride
    for block in range(pid, tl.cdiv(n_q, BLOCK_M), N_PROGRAMS):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_q
        r_max = tl.load(row_max_ptr + rows, mask=row_ok, other=float("-inf"))
        r_sum = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)
        for c0 in tl.range(0, n_k, BLOCK_N, warp_specialize=WS):
            cols = c0 + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for d0 in range(0, d, BLOCK_D):
                acc += _dot(q_desc.load([block * BLOCK_M, d0]), k_desc.load([c0, d0]), EXACT)
            edge = (block * BLOCK_M + BLOCK_M > n_q) | (c0 + BLOCK_N > n_k)
            r_max, r_sum = _lse_tile_update(
                acc * scale2, edge, row_ok, cols, cols < n_k, r_max, r_sum, col_max_ptr, col_sum_ptr
            )
        tl.store(row_max_ptr + rows, r_max, mask=row_ok)
        tl.store(row_sum_ptr + rows, r_sum, mask=row_ok)
        tl.debug_barrier()


@triton.jit
def _weights_tma(
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
):
    # _weights_kernel's streamed tile, its slices loaded and its W tile stored through descriptors (the
    # copy engine clips the store at the panel's edges)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_q, d], strides=[d, 1], block_shape=[BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[n_k, d], strides=[d, 1], block_shape=[BLOCK_N, BLOCK_D])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[n_q, n_k], strides=[w_stride, 1], block_shape=[BLOCK_M, BLOCK_N])
    r0, c0 = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    rows, cols = r0 + tl.arange(0, BLOCK_M), c0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, d, BLOCK_D):
        acc += _dot(q_desc.load([r0, d0]), k_desc.load([c0, d0]), EXACT)
    a2 = tl.load(a_ptr + rows, mask=rows < n_q, other=0.0) * LOG2E
    b2 = tl.load(b_ptr + cols, mask=cols < n_k, other=0.0) * LOG2E
    w = _softmax_w_tile(acc, scale2, a2, b2, r0, c0, diag_offset, BLOCK_M, BLOCK_N)
    w_desc.store([r0, c0], w.to(w_ptr.dtype.element_ty))


def _tuned(fn: Any, shapes: list, restore: list[str], **extra: object) -> Any:
    """`fn` autotuned over `shapes` (one small tile under the interpreter) with `extra` constexprs."""
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_D": k, **extra}, num_warps=w, num_stages=s)
        for m, n, k, w, s in ([(16, 16, 32, 1, 1)] if INTERPRET else shapes)
    ]
    return triton.autotune(configs=configs, key=["d", "EXACT"], restore_value=restore)(fn)


_STATS = ["row_max_ptr", "row_sum_ptr", "col_max_ptr", "col_sum_ptr"]
# per production kernel: its name in kernels/streaming_triton.py and its variants (None: the production one)
KERNELS = {
    "forward": (
        "_lse_pass_kernel",
        {"pointer": None, "tma": _tuned(_lse_tma, FORWARD_SHAPES, _STATS, WS=False)}
        | {"tma_ws": _tuned(_lse_tma, FORWARD_SHAPES, _STATS, WS=True)},
    ),
    "W": ("_weights_kernel", {"pointer": None, "tma": _tuned(_weights_tma, WEIGHT_SHAPES, [])}),
}


def using(choice: dict[str, str], fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with each kernel of `choice` ({"forward": variant, "W": variant}) in the production one's place."""

    def call() -> Any:
        with contextlib.ExitStack() as swaps:
            for kernel, variant in choice.items():
                name, variants = KERNELS[kernel]
                if variants[variant] is not None:
                    swaps.enter_context(mock.patch.object(streaming_triton, name, variants[variant]))
            return fn()

    return call


def errors_of(kernel: str, variant: str, n: int, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Max |result - float64| of one variant on the same (rounded) inputs: the forward's row and column
    LSEs, or W of the whole problem as one panel (its positives shifted by one, as on a second rank; N
    rounded down to a multiple of 8, as a descriptor's row stride must be 16 bytes)."""
    n = n if kernel == "forward" else n // 8 * 8
    x, y = loss_bench.embeddings(n, d, dtype, device, seed=1)
    logits = loss_bench.SCALE * x.double() @ y.double().T
    rows, cols = torch.logsumexp(logits, 1), torch.logsumexp(logits, 0)
    if kernel == "forward":
        got = using({kernel: variant}, lambda: streaming_triton.row_col_lse(x, y, loss_bench.SCALE))()
        return {
            "rows": (got[0].double() - rows).abs().max().item(),
            "cols": (got[1].double() - cols).abs().max().item(),
        }
    positives = torch.diag(torch.ones(n - 1, dtype=torch.float64, device=device), 1)  # row i's is column i + 1
    want = (logits - rows[:, None]).exp() + (logits - cols[None, :]).exp() - 2 * positives
    weights = lambda: streaming_triton.softmax_weights(x, y, rows.float(), cols.float(), loss_bench.SCALE, 1)  # noqa: E731
    return {"w": (using({kernel: variant}, weights)().double() - want).abs().max().item()}


def checked_apart(kernel: str, variant: str, args: argparse.Namespace) -> dict:
    """`errors_of` in a child process: a compiler that aborts (Hopper's warp-specialization pass has
    asserted on loops like these, triton-lang/triton#9728) ends the child, not the probe."""
    cmd = [sys.executable, "-m", "benchmarks.tma_probe", "--check-only", f"{kernel}:{variant}"]
    try:
        child = harness.run_child(
            [*cmd, "--check-n", str(args.check_n), "--d", str(args.d)], cwd=harness.REPO, timeout=300
        )
    except subprocess.TimeoutExpired:
        return {"error": "compile and check timed out after 300 s"}
    if child.returncode != 0:
        tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
        return {"error": f"exit {child.returncode}: " + " | ".join(tail)[-500:]}
    return json.loads(child.stdout.strip().splitlines()[-1])


def timed_variants(n: int, d: int, dtype: torch.dtype, device: torch.device, ok: dict[str, list[str]]) -> dict:
    """The calls to time: each forward alone, each W kernel on one panel, the fused loss with each forward
    (pointer W) and with both descriptor kernels, where those passed their check."""
    zx, zy = (z.requires_grad_() for z in loss_bench.embeddings(n, d, dtype, device))
    chunk = LossConfig.stream_chunk_size
    p = min(PANEL, n)
    lse = [t[:p].float().contiguous() for t in streaming_triton.row_col_lse(zx.detach(), zy.detach(), loss_bench.SCALE)]
    w_out = torch.empty(p, p, dtype=dtype, device=device)
    forward = lambda: streaming_triton.row_col_lse(zx.detach(), zy.detach(), loss_bench.SCALE)  # noqa: E731
    x, y = zx.detach()[:p], zy.detach()[:p]
    weights = lambda: streaming_triton.softmax_weights(x, y, *lse, loss_bench.SCALE, 0, out=w_out)  # noqa: E731

    def loss() -> None:
        zx.grad = zy.grad = None
        loss_bench.streaming_triton(zx, zy, chunk)

    calls = {f"forward, {v}": using({"forward": v}, forward) for v in ok["forward"]}
    calls |= {f"W panel, {v}": using({"W": v}, weights) for v in ok["W"]}
    calls |= {f"loss, forward {v}": using({"forward": v}, loss) for v in ok["forward"]}
    if "tma" in ok["forward"] and "tma" in ok["W"]:
        calls["loss, forward tma + W tma"] = using({"forward": "tma", "W": "tma"}, loss)
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="rows per side (default: 64K on CUDA, 150 on CPU)")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check-n", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--check-only", help=argparse.SUPPRESS)  # KERNEL:VARIANT, in a child of this probe
    args = parser.parse_args(argv)
    device = harness.default_device()
    cuda = device.type == "cuda"
    if cuda:  # device-side descriptors take their scratch from here
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))
    n, dtype = args.n or (65536 if cuda else 150), torch.bfloat16 if cuda else torch.float32
    if args.check_only:
        print(json.dumps(errors_of(*args.check_only.split(":"), args.check_n, args.d, dtype, device)))
        return
    meta = harness.metadata(device)
    checks = {
        f"{kernel}:{variant}": errors_of(kernel, variant, args.check_n, args.d, dtype, device)
        if variants[variant] is None
        else checked_apart(kernel, variant, args)
        for kernel, (_, variants) in KERNELS.items()
        for variant in variants
    }
    print(f"check N={args.check_n}: max |result - float64| {checks}", flush=True)
    path = args.out / f"tma_probe_{'cuda' if cuda else 'cpu'}.json"
    harness.write_json(path, meta, {"check_n": args.check_n, "checks": checks})  # kept if a time limit stops the timing
    ok = {
        kernel: [v for v in variants if "error" not in checks[f"{kernel}:{v}"]]
        for kernel, (_, variants) in KERNELS.items()
    }
    calls = timed_variants(n, args.d, dtype, device, ok)
    runs = harness.round_robin(calls, args.repeats, device=device, rss=not cuda, tolerate=True)
    rows = [
        {"variant": name, "n": n, "d": args.d, "dtype": str(dtype), "status": m.status}
        | ({"median_ms": m.median_s * 1e3} if m.ok else {})
        for name, m in runs.items()
    ]
    for row in rows:
        print(row, flush=True)
    configs = {
        f"{kernel}:{v}": str(getattr(variants[v], "best_config", None))
        for kernel, (_, variants) in KERNELS.items()
        for v in ok[kernel]
        if variants[v] is not None
    }
    payload = {"check_n": args.check_n, "checks": checks, "configs": configs, "rows": rows}
    harness.write_json(path, meta, payload | {"autotuned": loss_bench.autotuned()})


if __name__ == "__main__":
    main()
