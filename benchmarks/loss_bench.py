"""A contrastive loss alone, forward + backward: dense (open_clip style) vs streaming, side by side.

    python benchmarks/loss_bench.py                                   # GPU: N = 8K .. 1M, d = 512
    python benchmarks/loss_bench.py --n 1024 2048 4096 8192 --repeats 3   # CPU-sized
    python benchmarks/loss_bench.py --losses siglip ...                # only SigLIP's sigmoid loss

Losses (`--losses`, default both): `clip` (symmetric InfoNCE) and `siglip` (the sigmoid loss,
t = 10, b = -10: SigLIP's init). For siglip, `dense` is open_clip's formula (N x N logits,
-logsigmoid(labels * logits).sum() / N) and `streaming` the one-pass streamed loss.

For each N and dtype (float32, bfloat16) every available implementation gets the same unit-norm
embeddings [N, d] (leaf tensors, so "backward" is the gradient w.r.t. the embeddings and the
temperature's gradient is the embeddings' concern), runs warm-up + `--repeats` timed fwd+bwd,
and reports the median time and the peak extra memory (CUDA: allocator peak above the inputs;
CPU: the largest single tensor any op produced, a proxy that still shows N x N vs chunk x N).
Implementations: `dense` (logits = s * Zx Zy^T, cross-entropy both ways), `streaming`
(titan_contrastive's StreamingClipStep, one process, `--chunk` rows per block), and, when
installed, `inf_cl` (PyPI inf-cl) and `memeff`. A run that does not fit is recorded as OOM.
First every implementation's embedding gradients are checked against the dense float64 loss at
N = `--check-n` (printed and stored), so each timed line is known to compute the same thing.
Writes `loss_bench_<device>.json` and `.png` under `--out`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from titan_contrastive.components.loss import clip_loss, sigmoid_loss
from titan_contrastive.components.memory_probe import LargestTensor
from titan_contrastive.distributed_clip import StreamingClipStep

SCALE = 1 / 0.07
SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -10.0
FLOOR = {"clip": 8, "siglip": 6}  # multiply-adds x 2 per pair and dim: fused softmax (8 N^2 d), sigmoid's 3 products (6 N^2 d)


def dense(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    clip_loss(zx, zy, torch.tensor(SCALE, device=zx.device)).backward()


def streaming(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel="pytorch")(lambda _: (zx * 1, zy * 1, None), [None])


def streaming_triton(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA only
    kernel = "triton_exact" if zx.dtype == torch.float32 else "triton"
    StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SCALE, kernel=kernel)(lambda _: (zx * 1, zy * 1, None), [None])


def inf_cl(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA + Triton only
    from inf_cl import cal_inf_loss  # one direction per call, scale applied to the first argument

    scale = torch.tensor(SCALE, device=zx.device)
    (0.5 * (cal_inf_loss(zx, zy, scale=scale) + cal_inf_loss(zy, zx, scale=scale))).backward()


def memeff(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA + Triton only
    from memeff import MemoryEfficientCLIPLoss  # stable=False: the plain loss, unscaled gradients

    MemoryEfficientCLIPLoss(temperature=1 / SCALE, normalized_inputs=True, stable=False)(zx, zy).backward()


def dense_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    scale, bias = torch.tensor(SIGLIP_SCALE, device=zx.device), torch.tensor(SIGLIP_BIAS, device=zx.device)
    sigmoid_loss(zx, zy, scale, bias).backward()


def streaming_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
    StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SIGLIP_SCALE, kernel="pytorch", loss="siglip", fixed_bias=SIGLIP_BIAS)(
        lambda _: (zx * 1, zy * 1), [None])


def streaming_triton_siglip(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:  # pragma: no cover - CUDA only
    kernel = "triton_exact" if zx.dtype == torch.float32 else "triton"
    StreamingClipStep(stream_chunk_size=chunk, fixed_scale=SIGLIP_SCALE, kernel=kernel, loss="siglip", fixed_bias=SIGLIP_BIAS)(
        lambda _: (zx * 1, zy * 1), [None])


SIGLIP: dict[str, Callable[[torch.Tensor, torch.Tensor, int], None]] = {"dense": dense_siglip, "streaming": streaming_siglip}
if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    SIGLIP["streaming_triton"] = streaming_triton_siglip
IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], None]] = {"dense": dense, "streaming": streaming}
if torch.cuda.is_available():  # Triton kernels: ours (needs triton) and the two packages
    for _name, _package, _fn in (("streaming_triton", "triton", streaming_triton), ("inf_cl", "inf_cl", inf_cl),
                                 ("memeff", "memeff", memeff)):
        if importlib.util.find_spec(_package) is not None:
            IMPLEMENTATIONS[_name] = _fn
THIRD_PARTY = {"inf_cl", "memeff"}  # optional peers: an exception in one is recorded as skipped, the rest still run


def skipped(impl: str, exc: Exception) -> dict[str, str]:
    return {"impl": impl, "skipped": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"}


def measure(fn: Callable, n: int, d: int, dtype: torch.dtype, chunk: int, repeats: int, device: torch.device,
            floor: int = 8) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    zx = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=-1).to(dtype).requires_grad_()
    zy = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=-1).to(dtype).requires_grad_()
    cuda = device.type == "cuda"
    times = []
    try:
        for i in range(repeats + 1):
            zx.grad = zy.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            fn(zx, zy, chunk)
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first run is warm-up
                times.append(time.perf_counter() - start)
        if cuda:
            extra = torch.cuda.max_memory_allocated() - base
        else:
            zx.grad = zy.grad = None
            with LargestTensor() as probe:
                fn(zx, zy, chunk)
            extra = probe.largest_bytes
    except torch.OutOfMemoryError:
        return {"status": "OOM"}
    finally:
        zx.grad = zy.grad = None
    median = statistics.median(times)
    return {"status": "ok", "median_s": median, "times_s": times, "extra_bytes": extra, "floor_tflops": floor * n * n * d / median / 1e12,
            "memory_kind": "cuda_peak_above_inputs" if cuda else "largest_tensor"}


def agreement(impls: dict[str, Callable], reference: Callable, n: int, d: int, dtype: torch.dtype,
              device: torch.device) -> dict[str, dict[str, float]]:
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
        result[impl] = {"dzx": ((zx.grad.double() - rx.grad).norm() / rx.grad.norm()).item(),
                        "dzy": ((zy.grad.double() - ry.grad).norm() / ry.grad.norm()).item()}
    return result


def plot(rows: list[dict[str, Any]], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for loss, impl in sorted({(r["loss"], r["impl"]) for r in rows}):
        for dtype, style in (("float32", "-"), ("bfloat16", "--")):
            sel = [r for r in rows if (r["loss"], r["impl"]) == (loss, impl) and r["dtype"] == dtype and r["status"] == "ok"]
            if sel:
                label = f"{loss} {impl} {dtype}"
                ax1.plot([r["n"] for r in sel], [r["median_s"] * 1e3 for r in sel], "o" + style, label=label)
                ax2.plot([r["n"] for r in sel], [r["extra_bytes"] / 2**20 for r in sel], "o" + style, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="N", ylabel="fwd+bwd ms (median)", title="time")
    ax2.set(xscale="log", yscale="log", xlabel="N", ylabel="MiB", title="peak extra memory" if "cuda" in device.lower() or "H100" in device else "largest tensor")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{' and '.join(sorted({r['loss'] for r in rows}))} loss, d={rows[0]['d']}, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2**13, 2**14, 2**15, 2**16, 2**17, 2**18, 2**19, 2**20])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--chunk", type=int, default=1024, help="streaming rows per block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=list(IMPLEMENTATIONS),
                        help="softmax implementations; siglip has dense and streaming")
    parser.add_argument("--losses", nargs="+", default=["clip", "siglip"], choices=["clip", "siglip"])
    parser.add_argument("--check-n", type=int, default=3000, help="N of the gradient agreement check run first")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    impls = {"clip": {i: IMPLEMENTATIONS[i] for i in args.impls}, "siglip": SIGLIP}
    impls = {loss: impls[loss] for loss in args.losses}
    checks: dict[str, dict] = {}
    for loss, fns in impls.items():
        for dtype in args.dtypes:
            checks[f"{loss} {dtype}"] = agreement(fns, fns["dense"], args.check_n, args.d, getattr(torch, dtype), device)
            for impl, err in checks[f"{loss} {dtype}"].items():
                if "skipped" in err:
                    print(f"check N={args.check_n} {loss:>6} {dtype:>8} {impl:>16}: skipped ({err['skipped']})", flush=True)
                    continue
                print(f"check N={args.check_n} {loss:>6} {dtype:>8} {impl:>16}: gradient rel. error vs dense float64 "
                      f"dZx {err['dzx']:.1e}  dZy {err['dzy']:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = ("cuda" if device.type == "cuda" else "cpu") + ("" if args.losses == ["clip", "siglip"] else "_" + "_".join(args.losses))

    def save() -> None:  # after every row: a run stopped at a time limit keeps what it measured
        (out / f"loss_bench_{tag}.json").write_text(json.dumps({"device": name, "torch": torch.__version__, "config": vars(args),
                                                                   "agreement": checks, "rows": rows}, indent=1))

    rows: list[dict] = []
    for n in args.n:
        for dtype in args.dtypes:
            for loss, fns in impls.items():
                for impl, fn in fns.items():
                    chunk = min(args.chunk, max(1, (2**28) // n)) if impl == "streaming" and device.type == "cuda" else args.chunk
                    row = {"loss": loss, "impl": impl, "n": n, "d": args.d, "dtype": dtype, "chunk": chunk}
                    rows.append(row)
                    try:
                        row.update(measure(fn, n, args.d, getattr(torch, dtype), chunk, args.repeats, device, FLOOR[loss]))
                    except Exception as exc:
                        if impl not in THIRD_PARTY:
                            raise
                        row.update(status="skipped", **skipped(impl, exc))
                        print(f"N={n:>8} {dtype:>8} {loss:>6} {impl:>10}: skipped ({row['skipped']})", flush=True)
                        continue
                    shown = (f"{row['median_s'] * 1e3:9.1f} ms  {row['extra_bytes'] / 2**20:9.1f} MiB  {row['floor_tflops']:6.1f} TFLOP/s "
                             f"({FLOOR[loss]}N²d)" if row["status"] == "ok" else "      OOM")
                    print(f"N={n:>8} {dtype:>8} {loss:>6} {impl:>10}: {shown}", flush=True)
                    save()
    save()
    plot(rows, name, out / f"loss_bench_{tag}.png")


if __name__ == "__main__":
    main()
