"""The fused loss kernel by kernel, per backward panel size: where its milliseconds go.

    python -m benchmarks.loss_profile --out DIR                      # CUDA: N = 64K, d = 512, bf16, panels 2K..16K
    TRITON_INTERPRET=1 python -m benchmarks.loss_profile --n 600 --d 64 --dtype float32 \\
        --panels 128 256 --repeats 1 --out /tmp/bench                  # CPU: the same code through the interpreter

The fused softmax (`clip`) and sigmoid (`siglip`) losses, forward + backward on the loss
benchmark's embeddings (`loss_bench.measure`: unit-norm leaves, interleaved round-robin, medians),
once per backward panel size (`losses.fused.FUSED_PANEL`: the rows x columns of W written per
panel before its two GEMMs; 4K panels of bf16 are 32 MiB and fit an H100's 50 MB L2, 8K panels
are 128 MiB). Then one more call per panel under torch.profiler (`_kernel_profile.kernel_times`):
milliseconds in the forward LSE pass, the W kernels, the GEMMs, copies and fills. Before timing,
each loss's gradients at N = `--check-n` (panels of N / 3, so panel boundaries are crossed) are
checked against the dense float64 loss. With `--baseline REV` (a git revision: its
`kernels/tiles.py` and `kernels/streaming_triton.py`, extracted by `harness.package_at`), each loss
also runs on that revision's kernels at the default panel, in the same round robin, checked the same
way: the kernels' change measured side by side. Writes `loss_profile_<device>.{json,csv,png}`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from benchmarks import harness, loss_bench
from benchmarks._kernel_profile import LOSS_FAMILIES, kernel_times
from titan_contrastive.config.job_config import Loss as LossConfig
from titan_contrastive.losses import fused as fused_loss

FUSED = {"clip": loss_bench.streaming_triton, "siglip": loss_bench.streaming_triton_siglip}
PANEL = fused_loss.FUSED_PANEL  # the backward panel the baseline kernels run with (the default)
DENSE = {"clip": loss_bench.dense, "siglip": loss_bench.dense_siglip}


def with_panel(fn: loss_bench.LossFn, panel: int) -> loss_bench.LossFn:
    """`fn` with the backward's panels at most `panel` x `panel` for the call."""

    @functools.wraps(fn)
    def call(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
        with mock.patch.object(fused_loss, "FUSED_PANEL", panel):
            fn(zx, zy, chunk)

    return call


def load_kernels(package: Path) -> ModuleType:
    """kernels/streaming_triton.py of the package folder `package`, importing the tiles.py beside it (an
    earlier revision's kernels with their own autotune lists; the installed package's modules are left
    as they are)."""

    def load(name: str, path: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    tiles = load("baseline_tiles", package / "kernels/tiles.py")
    with mock.patch.dict(sys.modules, {"titan_contrastive.kernels.tiles": tiles}):
        return load("baseline_streaming_triton", package / "kernels/streaming_triton.py")


def with_kernels(fn: loss_bench.LossFn, kernels: ModuleType) -> loss_bench.LossFn:
    """`fn` with the fused losses calling `kernels` instead of the package's kernel module."""

    @functools.wraps(fn)
    def call(zx: torch.Tensor, zy: torch.Tensor, chunk: int) -> None:
        with mock.patch.object(fused_loss, "_triton", lambda kernel: kernels):
            fn(zx, zy, chunk)

    return call


def profiled(fn: loss_bench.LossFn, n: int, d: int, dtype: torch.dtype, chunk: int, device: torch.device) -> dict:
    """`kernel_times` of one call of `fn` (after one untraced call) on embeddings like `measure`'s."""
    zx, zy = (z.requires_grad_() for z in loss_bench.embeddings(n, d, dtype, device))

    def call() -> None:
        zx.grad = zy.grad = None
        fn(zx, zy, chunk)

    call()
    return kernel_times(call, device, LOSS_FAMILIES)


def plot(rows: list[dict[str, Any]], title: str) -> Any:
    plt = harness.pyplot()
    ok = [r for r in rows if r.get("families_ms")]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['loss']}\n{'baseline ' if r['kernels'] == 'baseline' else ''}panel {r['panel']}" for r in ok]
    bottom = [0.0] * len(ok)
    for family in [*LOSS_FAMILIES, "other"]:
        ms = [r["families_ms"].get(family, 0.0) for r in ok]
        if any(ms):
            ax.bar(range(len(ok)), ms, bottom=bottom, label=family)
            bottom = [b + m for b, m in zip(bottom, ms)]
    ax.scatter(range(len(ok)), [r["median_s"] * 1e3 for r in ok], color="k", zorder=3, label="wall (median)")
    ax.set_xticks(range(len(ok)), labels, fontsize=7)
    ax.set_ylabel("ms per forward + backward")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="rows per side (default: 64K on CUDA, 600 on CPU)")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--panels", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--losses", nargs="+", default=["clip", "siglip"], choices=list(FUSED))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-n", type=int, default=3000)
    parser.add_argument("--baseline", help="a git revision whose kernels run beside this tree's (e.g. 60f25a4)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:  # the baseline's files stay for the run (Triton reads them)
        try:
            root = harness.package_at(args.baseline, Path(tmp)) if args.baseline else None
        except ValueError as e:
            parser.error(str(e))
        profile(args, load_kernels(root / "titan_contrastive") if root else None)


def profile(args: argparse.Namespace, baseline: ModuleType | None) -> None:
    """The round robin, the kernel profiles and the result files of `main`'s arguments."""
    device = harness.default_device()
    cuda = device.type == "cuda"
    n = args.n or (65536 if cuda else 600)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    chunk = LossConfig.stream_chunk_size
    meta = harness.metadata(device)
    name = f"loss_profile_{'cuda' if cuda else 'cpu'}"
    payload: dict[str, Any] = {"config": {**vars(args), "n": n, "dtype": str(dtype)}, "checks": {}}
    rows: list[dict[str, Any]] = []
    for loss in args.losses:
        # (label, loss function, whose kernels, backward panel)
        variants = [(f"{loss} panel {p}", with_panel(FUSED[loss], p), "this tree", p) for p in args.panels]
        check = {"fused": with_panel(FUSED[loss], max(16, args.check_n // 3))}
        if baseline is not None:
            variants.append((f"{loss} baseline kernels", with_kernels(FUSED[loss], baseline), "baseline", PANEL))
            check["baseline"] = with_kernels(check["fused"], baseline)
        agree = loss_bench.agreement(check, DENSE[loss], args.check_n, args.d, dtype, device)
        payload["checks"].update({loss if k == "fused" else f"{loss} {k}": v for k, v in agree.items()})
        print(f"check N={args.check_n} {loss}: gradient rel. error vs dense float64 {agree}")
        fns: dict[str, Callable] = {label: fn for label, fn, _, _ in variants}
        measured = loss_bench.measure(
            fns, n, args.d, dtype, dict.fromkeys(fns, chunk), args.repeats, device, loss_bench.FLOOR[loss]
        )
        for label, fn, kernels, panel in variants:
            row = {"loss": loss, "kernels": kernels, "panel": panel, "n": n, "d": args.d, "dtype": str(dtype)}
            row.update(measured[label])
            if row["status"] == "ok":
                row.update(profiled(fn, n, args.d, dtype, chunk, device))
                shares = ", ".join(f"{k} {v:.1f}" for k, v in row["families_ms"].items() if v)
                print(f"{label}: {row['median_s'] * 1e3:.1f} ms, {row['extra_bytes'] / 2**20:.0f} MiB; {shares}")
            rows.append(row)
        payload["autotuned"] = loss_bench.autotuned()
        if baseline is not None:
            payload["autotuned_baseline"] = loss_bench.autotuned(baseline)
        harness.write_json(args.out / f"{name}.json", meta, {**payload, "rows": rows})  # kept if a limit stops us
    fields = "loss kernels panel n d dtype status median_s extra_bytes floor_tflops total_ms".split()
    flat = [
        {**{k: r.get(k) for k in fields}, **{f"ms {k}": v for k, v in r.get("families_ms", {}).items()}} for r in rows
    ]
    harness.write_results(
        args.out,
        name,
        meta,
        {**payload, "rows": rows},
        rows=flat,
        rows_key="flat",
        fields=list(dict.fromkeys(k for r in flat for k in r)),
        figure=lambda: plot(rows, f"fused loss, N={n}, d={args.d}, {dtype}, {meta.get('device')}") if rows else None,
    )


if __name__ == "__main__":
    main()
