"""The fused loss's forward pass with TMA tensor-descriptor loads against today's pointer tiles (a Hopper probe).

    python -m benchmarks.lse_probe --out DIR                                  # CUDA: N = 64K, d = 512, bf16
    TRITON_INTERPRET=1 python -m benchmarks.lse_probe --n 160 --d 32 --check-n 96 --out /tmp/bench   # CPU

`_lse_tma_kernel` is `kernels/streaming_triton._lse_pass_kernel`'s streamed path with the row and
column slices loaded through `tl.make_tensor_descriptor` (the copy engine on Hopper, pipelined like a
GEMM's main loop) instead of masked pointer loads; the tile statistics are the production kernel's own
function (`_lse_tile_update`). For the probe's calls it takes the production kernel's place in
`row_col_lse`, so both run through one host path, and in the whole fused loss. First both forwards'
LSEs are compared with float64 at N = `--check-n` (on the inputs' own rounding; each descriptor kernel
compiled and checked in a child process, so a compiler abort is a result); then the forward alone
and the fused loss (forward + backward) are timed side by side (`harness.round_robin`, medians). A
descriptor kernel that fails to compile or run is recorded with its error; the pointer rows still run.
Writes `lse_probe_<device>.json`. Nothing here is used by the trainer: a winner moves into
`kernels/` after a GPU run shows it (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks import harness, loss_bench
from titan_contrastive.config.job_config import Loss as LossConfig
from titan_contrastive.kernels import streaming_triton
from titan_contrastive.kernels.streaming_triton import _dot, _lse_tile_update
from titan_contrastive.kernels.tiles import INTERPRET

SHAPES = [(64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 256, 64, 4, 3)]


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
    scale,
    N_PROGRAMS: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WS: tl.constexpr = False,
):
    # _lse_pass_kernel's program layout; each d-slice of a tile comes through a descriptor, zero past
    # the last row (the copy engine's padding) where the pointer kernel masks its loads
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
            r_max, r_sum = _lse_tile_update(
                acc * scale, row_ok, cols, cols < n_k, r_max, r_sum, col_max_ptr, col_sum_ptr
            )
        tl.store(row_max_ptr + rows, r_max, mask=row_ok)
        tl.store(row_sum_ptr + rows, r_sum, mask=row_ok)
        tl.debug_barrier()


def _tuned(ws: bool) -> Any:
    """`_lse_tma` autotuned over SHAPES, with Hopper's automatic warp specialization of the column
    loop (`ws`: a producer warp group issues the copies, the others compute) or without."""
    shapes = [(16, 16, 32, 1, 1)] if INTERPRET else SHAPES
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_D": k, "WS": ws}, num_warps=w, num_stages=s)
        for m, n, k, w, s in shapes
    ]
    restore = ["row_max_ptr", "row_sum_ptr", "col_max_ptr", "col_sum_ptr"]
    return triton.autotune(configs=configs, key=["d", "EXACT"], restore_value=restore)(_lse_tma)


FORWARDS = {"pointer": None, "tma": _tuned(False), "tma_ws": _tuned(True)}  # None: the production kernel


def forward_with(kernel: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with `row_col_lse` (and so the fused loss) running `kernel` as its forward, for the call."""
    if kernel is None:
        return fn

    def call() -> Any:
        kept = streaming_triton._lse_pass_kernel
        streaming_triton._lse_pass_kernel = kernel
        try:
            return fn()
        finally:
            streaming_triton._lse_pass_kernel = kept

    return call


def lse_errors(names: list[str], n: int, d: int, dtype: torch.dtype, device: torch.device) -> dict[str, dict]:
    """Max |LSE - float64 LSE| of rows and columns for the forwards `names`, on the same (rounded) inputs."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=-1).to(dtype)
    y = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=-1).to(dtype)
    logits = loss_bench.SCALE * x.double() @ y.double().T
    want = (torch.logsumexp(logits, 1), torch.logsumexp(logits, 0))
    forward = lambda: streaming_triton.row_col_lse(x, y, loss_bench.SCALE)  # noqa: E731
    errors = {}
    for name in names:
        try:
            got = forward_with(FORWARDS[name], forward)()
        except Exception as exc:  # a descriptor kernel this Triton cannot build: the probe's answer, recorded
            errors[name] = {"error": harness.reason(exc)}
            continue
        errors[name] = {side: (g.double() - w).abs().max().item() for side, g, w in zip(("rows", "cols"), got, want)}
    return errors


def checked_apart(name: str, args: argparse.Namespace) -> dict:
    """`lse_errors` of one descriptor forward in a child process: a compiler that aborts (Hopper's
    warp-specialization pass has asserted on loops like these, triton-lang/triton#9728) ends the
    child, not the probe."""
    cmd = [sys.executable, "-m", "benchmarks.lse_probe", "--check-only", name, "--check-n", str(args.check_n)]
    try:
        child = harness.run_child([*cmd, "--d", str(args.d)], cwd=harness.REPO, timeout=300)
    except subprocess.TimeoutExpired:
        return {"error": "compile and check timed out after 300 s"}
    if child.returncode != 0:
        tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
        return {"error": f"exit {child.returncode}: " + " | ".join(tail)[-500:]}
    return json.loads(child.stdout.strip().splitlines()[-1])[name]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="rows per side (default: 64K on CUDA, 160 on CPU)")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--check-n", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--check-only", choices=list(FORWARDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = harness.default_device()
    cuda = device.type == "cuda"
    if cuda:  # device-side descriptors take their scratch from here
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))
    n, dtype = args.n or (65536 if cuda else 160), torch.bfloat16 if cuda else torch.float32
    if args.check_only:
        print(json.dumps(lse_errors([args.check_only], args.check_n, args.d, dtype, device)))
        return
    meta = harness.metadata(device)
    errors = lse_errors(["pointer"], args.check_n, args.d, dtype, device)
    errors |= {name: checked_apart(name, args) for name in FORWARDS if name != "pointer"}
    print(f"check N={args.check_n}: max |LSE - float64| {errors}", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    zx = F.normalize(torch.randn(n, args.d, device=device, generator=gen), dim=-1).to(dtype).requires_grad_()
    zy = F.normalize(torch.randn(n, args.d, device=device, generator=gen), dim=-1).to(dtype).requires_grad_()
    chunk = LossConfig.stream_chunk_size
    forward = lambda: streaming_triton.row_col_lse(zx.detach(), zy.detach(), loss_bench.SCALE)  # noqa: E731
    loss = lambda: loss_bench.streaming_triton(zx, zy, chunk)  # noqa: E731
    variants = {}
    for name, kernel in FORWARDS.items():
        if "error" not in errors[name]:
            variants |= {f"forward, {name}": forward_with(kernel, forward), f"loss, {name}": forward_with(kernel, loss)}

    def reset(_: str) -> None:
        zx.grad = zy.grad = None

    runs = harness.round_robin(variants, args.repeats, before=reset, device=device, rss=not cuda, tolerate=True)
    rows = [
        {"variant": name, "n": n, "d": args.d, "dtype": str(dtype), "status": m.status, "median_ms": m.median_s * 1e3}
        if m.ok
        else {"variant": name, "n": n, "d": args.d, "dtype": str(dtype), "status": m.status}
        for name, m in runs.items()
    ]
    for row in rows:
        print(row, flush=True)
    payload = {"check_n": args.check_n, "lse_errors": errors, "autotuned": loss_bench.autotuned(), "rows": rows}
    chosen = {name: getattr(kernel, "best_config", None) for name, kernel in FORWARDS.items() if kernel is not None}
    payload["configs"] = {name: str(config) if config is not None else None for name, config in chosen.items()}
    harness.write_json(args.out / f"lse_probe_{'cuda' if cuda else 'cpu'}.json", meta, payload)


if __name__ == "__main__":
    main()
