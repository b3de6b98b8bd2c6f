"""A contrastive loss alone, forward + backward: dense (open_clip style) vs streaming, side by side.

    python -m benchmarks.loss_bench                                   # GPU: N = 8K .. 1M, d = 512
    python -m benchmarks.loss_bench --n 2048 8192 --dtypes float32 --losses clip --repeats 7   # CPU quick run
    python -m benchmarks.loss_bench --losses siglip ...                # only SigLIP's sigmoid loss
    python -m benchmarks.loss_bench --losses clip pairwise ...         # InfoNCE beside the pairwise loss

Losses (`--losses`, default both): `clip` (symmetric InfoNCE) and `siglip` (the sigmoid loss,
t = 10, b = -10: SigLIP's init). For siglip, `dense` is open_clip's formula (N x N logits,
-logsigmoid(labels * logits).sum() / N) and `streaming` the one-pass streamed loss. `pairwise` (colpali-engine's
pairwise loss, `losses/pairwise.py`, at the softmax's t; only when asked): `dense` its definition over the N x N
scores, `streaming` its streamed form (each block's hardest negative picked without a graph).

For each N and dtype (float32, bfloat16) every available implementation gets the same unit-norm
embeddings [N, d] (leaf tensors, so "backward" is the gradient w.r.t. the embeddings and the
temperature's gradient is the embeddings' concern). The implementations are timed interleaved,
round-robin in one process by the harness (one warm-up round, then `--repeats` rounds, each starting
at the next implementation), so drift in a shared machine's load hits all of them alike; each
reports its median (and min, max) fwd+bwd time and its peak extra memory (CUDA: allocator peak above
the inputs over the timed calls; CPU, which has no allocator peak counter: one more untimed call
under `memory_probe.PeakMemory`, the most bytes of tensors alive at once, and `LargestTensor`, the
largest single tensor any op produced, a proxy that still shows N x N vs chunk x N; `extra_bytes`
is the latter, as before; the harness's peak RSS per call is stored too, a lower bound because the
implementations share one heap).
Implementations: `dense` (logits = s * Zx Zy^T, cross-entropy both ways), `streaming`
(titan_contrastive's StreamingClipStep on the PyTorch path, one process, `--chunk` rows per
block, default the config's loss.stream_chunk_size; its encode returns the input embeddings
themselves, so the step's memory is the loss's, measured like the peers' loss functions),
`open_clip` (open_clip's own `ClipLoss`, world size 1, from the installed open-clip-torch wheel:
two logit matmuls), and, on CUDA, `streaming_triton` and, when installed, `inf_cl` (PyPI inf-cl)
and `memeff`. A run that does not fit is recorded as OOM. First every implementation's embedding
gradients are checked against the dense float64 loss at N = `--check-n` (printed and stored), so
each timed line is known to compute the same thing. Writes
`loss_bench_<device>[_<losses>].{json,csv,png}` under `--out`.

On a CPU shared with other processes, OpenMP's default wait policy (worker threads spin at each
parallel op's barrier) makes every op wait for a descheduled thread: implementations with many
small ops (streaming's per-tile passes) then lose several-fold. `OMP_WAIT_POLICY=PASSIVE` (or
`OMP_NUM_THREADS=1`) avoids that; the JSON records both variables.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from titan_contrastive.components.memory_probe import LargestTensor, PeakMemory
from titan_contrastive.config.job_config import Loss as LossConfig
from titan_contrastive.distributed_clip import StreamingClipStep
from titan_contrastive.losses import InfoNCE, Pairwise, Sigmoid
from titan_contrastive.losses import fused as fused_loss
from titan_contrastive.losses import streaming as streaming_loss

SCALE = 1 / 0.07
SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -10.0
# multiply-adds x 2 per pair and dim: fused softmax (8 N^2 d), sigmoid's 3 products (6 N^2 d), pairwise's one
# product without a backward over it (2 N^2 d)
FLOOR = {"clip": 8, "siglip": 6, "pairwise": 2}


def dense(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    InfoNCE().dense(zx, zy, torch.tensor(SCALE, device=zx.device)).backward()


def streaming(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel="pytorch")
    step(lambda _: (zx, zy, None), [None])  # the inputs themselves: the loss alone, as the peers


@functools.cache
def open_clip_loss_module():  # noqa: ANN201 - the module, or None when open-clip-torch is not installed
    """open_clip's loss.py from the installed wheel, loaded on its own (the package imports
    torchvision, which need not import beside this torch; loss.py imports only torch), as
    tests/test_siglip.py does; loaded on first use, not when this module is imported."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    module_spec = importlib.util.spec_from_file_location("open_clip_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def open_clip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    """open_clip's ClipLoss at world size 1: s * Zx Zy^T and s * Zy Zx^T as two matmuls, cross-entropy each way."""
    open_clip_loss_module().ClipLoss()(zx, zy, torch.tensor(SCALE, device=zx.device)).backward()


def streaming_triton(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA only
    kernel = "triton_exact" if zx.dtype == torch.float32 else "triton"
    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel=kernel)
    step(lambda _: (zx, zy, None), [None])  # the inputs themselves: the loss alone, as the peers


def inf_cl(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA + Triton only
    from inf_cl import cal_inf_loss  # one direction per call, scale applied to the first argument

    scale = torch.tensor(SCALE, device=zx.device)
    (0.5 * (cal_inf_loss(zx, zy, scale=scale) + cal_inf_loss(zy, zx, scale=scale))).backward()


def memeff(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA + Triton only
    from memeff import MemoryEfficientCLIPLoss  # stable=False: the plain loss, unscaled gradients

    MemoryEfficientCLIPLoss(temperature=1 / SCALE, normalized_inputs=True, stable=False)(zx, zy).backward()


def dense_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    scale, bias = torch.tensor(SIGLIP_SCALE, device=zx.device), torch.tensor(SIGLIP_BIAS, device=zx.device)
    Sigmoid().dense(zx, zy, scale, bias).backward()


def streaming_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    step = StreamingClipStep(
        stream_chunk_size=chunk, fixed_scale=SIGLIP_SCALE, kernel="pytorch", objective=Sigmoid(), fixed_bias=SIGLIP_BIAS
    )
    step(lambda _: (zx, zy), [None])


def streaming_triton_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA only
    kernel = "triton_exact" if zx.dtype == torch.float32 else "triton"
    step = StreamingClipStep(
        stream_chunk_size=chunk, fixed_scale=SIGLIP_SCALE, kernel=kernel, objective=Sigmoid(), fixed_bias=SIGLIP_BIAS
    )
    step(lambda _: (zx, zy), [None])


def dense_pairwise(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    Pairwise().dense(zx, zy, torch.tensor(SCALE, device=zx.device)).backward()


def streaming_pairwise(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    step = StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel="pytorch", objective=Pairwise())
    step(lambda _: (zx, zy, None), [None])


LossFn = Callable[[torch.Tensor, torch.Tensor, int], None]
PAIRWISE: dict[str, LossFn] = {"dense": dense_pairwise, "streaming": streaming_pairwise}
SIGLIP: dict[str, LossFn] = {"dense": dense_siglip, "streaming": streaming_siglip}
if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    SIGLIP["streaming_triton"] = streaming_triton_siglip
IMPLEMENTATIONS: dict[str, LossFn] = {"dense": dense, "streaming": streaming}
if importlib.util.find_spec("open_clip") is not None:  # the wheel is there (its loss.py is loaded on first use)
    IMPLEMENTATIONS["open_clip"] = open_clip
if torch.cuda.is_available():  # Triton kernels: ours (needs triton) and the two packages
    for _name, _package, _fn in (
        ("streaming_triton", "triton", streaming_triton),
        ("inf_cl", "inf_cl", inf_cl),
        ("memeff", "memeff", memeff),
    ):
        if importlib.util.find_spec(_package) is not None:
            IMPLEMENTATIONS[_name] = _fn
THIRD_PARTY = {"inf_cl", "memeff"}  # optional peers: an exception in one is recorded as skipped, the rest still run


def skipped(impl: str, exc: Exception) -> dict[str, str]:
    return {"impl": impl, "skipped": harness.reason(exc)}


def embeddings(n: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Two [n, d] sets of unit-norm random embeddings in `dtype`, the same for the same seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(F.normalize(torch.randn(n, d, device=device, generator=gen), dim=-1).to(dtype) for _ in range(2))


def measure(
    fns: dict[str, Callable],
    n: int,
    d: int,
    dtype: torch.dtype,
    chunks: dict[str, int],
    repeats: int,
    device: torch.device,
    floor: int = 8,
) -> dict[str, dict[str, Any]]:
    """Every implementation of `fns` on the same embeddings, interleaved (harness.round_robin): a
    warm-up round, then `repeats` rounds, round r starting at implementation r (mod the count), so
    slow drift in the machine's load cannot favour one. An implementation that runs out of memory is
    recorded as OOM (a third-party one that raises, as skipped) and leaves the rotation; the others go on."""
    zx, zy = (z.requires_grad_() for z in embeddings(n, d, dtype, device))
    cuda = device.type == "cuda"

    def reset(_: str = "") -> None:
        zx.grad = zy.grad = None

    runs = harness.round_robin(
        {impl: (lambda fn=fn, impl=impl: fn(zx, zy, chunks[impl])) for impl, fn in fns.items()},
        repeats,
        warmup=1,
        before=reset,
        device=device,
        rss=not cuda,
        tolerate=THIRD_PARTY,
    )
    results: dict[str, dict[str, Any]] = {}
    for impl, m in runs.items():
        if m.status == "OOM":
            results[impl] = {"status": "OOM"}
            continue
        if m.status == "skipped":
            results[impl] = {"status": "skipped", "impl": impl, "skipped": m.reason}
            continue
        stats = harness.summary(m.times_s)
        row = {
            "status": "ok",
            "median_s": stats["median"],
            "min_s": stats["min"],
            "max_s": stats["max"],
            "times_s": m.times_s,
            "floor_tflops": floor * n * n * d / stats["median"] / 1e12,
        }
        if cuda:
            row.update(extra_bytes=m.cuda_peak_extra_bytes, memory_kind="cuda_peak_above_inputs")
        else:  # untimed: the probes dispatch every op through Python
            reset()
            with LargestTensor() as largest:
                fns[impl](zx, zy, chunks[impl])
            reset()
            with PeakMemory(device) as peak:
                fns[impl](zx, zy, chunks[impl])
            row.update(
                extra_bytes=largest.largest_bytes,
                memory_kind="largest_tensor",
                peak_live_bytes=peak.peak,
                peak_rss_mib=m.peak_rss_mib,
                rss_growth_mib=m.rss_growth_mib,
            )
        results[impl] = row
    reset()
    return results


def agreement(
    impls: dict[str, Callable], reference: Callable, n: int, d: int, dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, float]]:
    """Before timing: each implementation's loss gradients against the dense float64 reference on
    the same embeddings (relative errors), so every timed line computes the same quantity."""
    gen = torch.Generator(device=device).manual_seed(1)
    x64 = F.normalize(torch.randn(n, d, device=device, generator=gen, dtype=torch.float64), dim=-1)
    y64 = F.normalize(torch.randn(n, d, device=device, generator=gen, dtype=torch.float64), dim=-1)
    rx, ry = x64.clone().requires_grad_(), y64.clone().requires_grad_()
    reference(rx, ry, 256)
    result = {}
    for impl, fn in impls.items():
        zx, zy = x64.to(dtype).requires_grad_(), y64.to(dtype).requires_grad_()
        try:
            fn(zx, zy, 256)
        except Exception as exc:
            if impl not in THIRD_PARTY:
                raise
            result[impl] = skipped(impl, exc)
            continue
        result[impl] = {
            "dzx": ((zx.grad.double() - rx.grad).norm() / rx.grad.norm()).item(),
            "dzy": ((zy.grad.double() - ry.grad).norm() / ry.grad.norm()).item(),
        }
    return result


def plot(rows: list[dict[str, Any]], device: str, cuda: bool):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss, impl in sorted({(r["loss"], r["impl"]) for r in rows}):
        for dtype, style in (("float32", "-"), ("bfloat16", "--")):
            sel = [r for r in rows if (r["loss"], r["impl"], r["dtype"], r["status"]) == (loss, impl, dtype, "ok")]
            if sel:
                label = f"{loss} {impl} {dtype}"
                ax1.plot([r["n"] for r in sel], [r["median_s"] * 1e3 for r in sel], "o" + style, label=label)
                ax2.plot([r["n"] for r in sel], [r["extra_bytes"] / 2**20 for r in sel], "o" + style, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="N", ylabel="fwd+bwd ms (median)", title="time")
    ax2.set(
        xscale="log", yscale="log", xlabel="N", ylabel="MiB", title="peak extra memory" if cuda else "largest tensor"
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{' and '.join(sorted({r['loss'] for r in rows}))} loss, d={rows[0]['d']}, {device}")
    return fig


def autotuned(kernels: Any = None) -> dict[str, dict[str, Any]]:
    """The configs the Triton autotuner chose so far, per kernel and key (d, exact, dtypes): which
    tiles won, and whether the forward kept its rows resident (docs/kernels.md); with
    `last_tuning_ms`, every candidate's time in the kernel's last tuning (Triton's
    `configs_timings`: how close the losers came). `kernels`: a kernel module (default: the
    package's `kernels/streaming_triton`, if imported)."""
    kernels = kernels or sys.modules.get("titan_contrastive.kernels.streaming_triton")
    if kernels is None or kernels.INTERPRET:
        return {}
    tuners = {"lse": kernels._lse_pass_kernel, "weights": kernels._weights_kernel, "sigmoid": kernels._sigmoid_kernel}
    result: dict[str, dict[str, Any]] = {}
    for name, tuner in tuners.items():
        result[name] = {str(k): str(c) for k, c in getattr(tuner, "cache", {}).items()}
        timings = getattr(tuner, "configs_timings", None) or {}
        if timings:
            finite = {
                str(c): [float(v) for v in (t if isinstance(t, list | tuple) else [t])] for c, t in timings.items()
            }
            result[name]["last_tuning_ms"] = {
                c: t if all(math.isfinite(v) for v in t) else None for c, t in finite.items()
            }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, nargs="+", default=None, help="batch sizes (default: 8K .. 1M on CUDA, 2K and 8K on CPU)"
    )
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--chunk",
        type=int,
        default=LossConfig.stream_chunk_size,
        help="streaming rows per block (default: the config's loss.stream_chunk_size)",
    )
    parser.add_argument(
        "--tile-bytes",
        type=int,
        default=streaming_loss.TILE_BYTES,
        help="CPU streaming: bytes per elementwise row tile (losses/streaming.py TILE_BYTES; 2**40 = no tiling)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds after the warm-up (the median is reported)"
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        default=list(IMPLEMENTATIONS),
        choices=list(IMPLEMENTATIONS),
        help="softmax implementations; siglip has dense and streaming",
    )
    parser.add_argument("--losses", nargs="+", default=["clip", "siglip"], choices=["clip", "siglip", "pairwise"])
    parser.add_argument("--check-n", type=int, default=3000, help="N of the gradient agreement check run first")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    device = harness.default_device()
    cuda = device.type == "cuda"
    streaming_loss.TILE_BYTES = args.tile_bytes
    if args.n is None:
        args.n = [2**13, 2**14, 2**15, 2**16, 2**17, 2**18, 2**19, 2**20] if cuda else [2**11, 2**13]
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    impls = {"clip": {i: IMPLEMENTATIONS[i] for i in args.impls}, "siglip": SIGLIP, "pairwise": PAIRWISE}
    impls = {loss: impls[loss] for loss in args.losses}
    checks: dict[str, dict] = {}
    for loss, fns in impls.items():
        for dtype in args.dtypes:
            reference = {"clip": IMPLEMENTATIONS, "siglip": SIGLIP, "pairwise": PAIRWISE}[loss]["dense"]  # timed or not
            checks[f"{loss} {dtype}"] = agreement(fns, reference, args.check_n, args.d, getattr(torch, dtype), device)
            for impl, err in checks[f"{loss} {dtype}"].items():
                where = f"check N={args.check_n} {loss:>6} {dtype:>8} {impl:>16}"
                if "skipped" in err:
                    print(f"{where}: skipped ({err['skipped']})", flush=True)
                    continue
                print(
                    f"{where}: gradient rel. error vs dense float64 dZx {err['dzx']:.1e}  dZy {err['dzy']:.1e}",
                    flush=True,
                )
    tag = ("cuda" if cuda else "cpu") + ("" if args.losses == ["clip", "siglip"] else "_" + "_".join(args.losses))
    meta = harness.metadata(device)
    if cuda:  # whether the fused path's panel products go straight into float32 (losses/fused.py)
        meta["fused_float32_gemm"] = fused_loss._add_product_fn(device, torch.bfloat16).__name__ == "_add_wide"
    rows: list[dict] = []

    def payload() -> dict[str, Any]:
        return {
            "device": name,
            "config": vars(args),
            "timing": "interleaved round-robin, median of the timed rounds",
            "agreement": checks,
            "autotuned": autotuned(),
        }

    for n in args.n:
        for dtype in args.dtypes:
            for loss, fns in impls.items():
                chunks = {
                    impl: min(args.chunk, max(1, (2**28) // n)) if impl == "streaming" and cuda else args.chunk
                    for impl in fns
                }
                measured = measure(fns, n, args.d, getattr(torch, dtype), chunks, args.repeats, device, FLOOR[loss])
                dense_s = measured.get("dense", {}).get("median_s")
                for impl, result in measured.items():
                    row = {
                        "loss": loss,
                        "impl": impl,
                        "n": n,
                        "d": args.d,
                        "dtype": dtype,
                        "chunk": chunks[impl],
                        **result,
                    }
                    if row["status"] == "ok" and dense_s:
                        row["vs_dense"] = row["median_s"] / dense_s
                    rows.append(row)
                    where = f"N={n:>8} {dtype:>8} {loss:>6} {impl:>16}"
                    if row["status"] == "skipped":
                        print(f"{where}: skipped ({row['skipped']})", flush=True)
                        continue
                    shown = (
                        f"{row['median_s'] * 1e3:9.1f} ms  {row['extra_bytes'] / 2**20:9.1f} MiB  "
                        f"{row['floor_tflops']:6.2f} TFLOP/s ({FLOOR[loss]}N²d)"
                        if row["status"] == "ok"
                        else "      OOM"
                    )
                    if "vs_dense" in row:
                        shown += f"  {row['vs_dense']:5.2f}x dense"
                    if "peak_live_bytes" in row:
                        shown += f"  peak live {row['peak_live_bytes'] / 2**20:.1f} MiB"
                    print(f"{where}: {shown}", flush=True)
                # after every (N, dtype, loss): a run stopped at a time limit keeps what it measured
                harness.write_json(args.out / f"loss_bench_{tag}.json", meta, {**payload(), "rows": rows})
    harness.write_results(
        args.out,
        f"loss_bench_{tag}",
        meta,
        payload(),
        rows=rows,
        fields=[
            "loss",
            "impl",
            "n",
            "d",
            "dtype",
            "chunk",
            "status",
            "median_s",
            "min_s",
            "max_s",
            "vs_dense",
            "floor_tflops",
            "extra_bytes",
            "memory_kind",
            "peak_live_bytes",
            "peak_rss_mib",
            "skipped",
        ],
        figure=lambda: plot(rows, name, cuda) if any(r["status"] == "ok" for r in rows) else None,
    )


if __name__ == "__main__":
    main()
