"""Pixel loss through a VAE decoder: v0 vs chunked vs per_chunk_backward, time and memory side by side.

    python benchmarks/pixel_loss_bench.py                       # H100: sd decoder, bf16, 8x1024², 4x512², 8x256²
    python benchmarks/pixel_loss_bench.py --flavor debug --cases 8x64 4x128 --dtype float32 --repeats 3   # CPU smoke

Each measurement is one loss forward + the caller's backward into the latents (a leaf standing in
for the upstream model), with the decoder frozen (seed 003's setting; `--trainable-decoder` to
also compute its parameter gradients). Reported per (case, mode): median time of `--repeats`
after one warm-up; on CUDA the allocator's peak above the baseline (decoder weights + inputs
already allocated), on every device the peak bytes of activations saved for backward and still
alive (saved-tensor hooks; device-independent). A CUDA out-of-memory is recorded as "oom".
Writes `pixel_loss_bench[_cpu].json` and `.png` under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from titan_contrastive.components.memory_probe import SavedActivations
from titan_contrastive.components.pixel_loss import compute_pixel_loss
from titan_contrastive.models.vae import Decoder, vae_flavors

MODES = {"v0": dict(mode="v0"), "chunked": dict(mode="chunked"), "chunked+empty_cache/2": dict(mode="chunked", empty_cache_every=2),
         "per_chunk_backward": dict(mode="per_chunk_backward")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(decoder: Decoder, n: int, size: int, mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    cfg = vae_flavors[args.flavor]
    latents = torch.randn(n, cfg.latent_channels, size // cfg.downsample, size // cfg.downsample, device=device, dtype=dtype, requires_grad=True)
    images = torch.rand(n, 3, size, size, device=device, dtype=dtype) * 2 - 1
    masks = torch.ones(n, 1, size, size, device=device, dtype=dtype)
    row: dict[str, Any] = {"case": f"{n}x{size}", "mode": mode, "images": n, "size": size}

    def once(probe: SavedActivations | None = None) -> None:
        latents.grad = None
        with probe or contextlib.nullcontext():
            loss = compute_pixel_loss(latents, images, masks, decoder, **MODES[mode])
        loss.backward()

    try:
        once()  # warm-up (cuDNN autotuning, allocator)
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.repeats):
            sync(device)
            start = time.perf_counter()
            once()
            sync(device)
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        probe = SavedActivations(decoder.parameters())
        once(probe)
        row.update(time_ms=1e3 * statistics.median(times), saved_activations_gib=probe.peak / 2**30)
    except torch.OutOfMemoryError:
        row.update(oom=True)
        latents.grad = None
        torch.cuda.empty_cache()
    return row


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    memory_key = "peak_extra_gib" if any("peak_extra_gib" in r for r in rows) else "saved_activations_gib"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(modes)
    for ax, key, label in ((axes[0], memory_key, f"{memory_key} (GiB)"), (axes[1], "time_ms", "median time (ms)")):
        for k, mode in enumerate(modes):
            values = [next((r.get(key, 0.0) for r in rows if r["case"] == c and r["mode"] == mode), 0.0) for c in cases]
            bars = ax.bar([i + k * width for i in range(len(cases))], values, width, label=mode)
            for bar, c in zip(bars, cases):
                if any(r.get("oom") for r in rows if r["case"] == c and r["mode"] == mode):
                    ax.text(bar.get_x(), 0, "OOM", rotation=90, va="bottom")
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(cases))], cases)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="sd", choices=list(vae_flavors))
    parser.add_argument("--cases", nargs="+", default=["8x1024", "4x512", "8x256"], help="IMAGESxSIZE")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--trainable-decoder", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    decoder = Decoder(vae_flavors[args.flavor]).to(device, getattr(torch, args.dtype)).requires_grad_(args.trainable_decoder)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = []
    for case in args.cases:
        n, size = map(int, case.split("x"))
        for mode in args.modes:
            if mode.startswith("chunked+") and device.type != "cuda":
                continue
            rows.append(measure(decoder, n, size, mode, args, device))
            print(json.dumps(rows[-1]))
    suffix = "" if device.type == "cuda" else "_cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__, "flavor": args.flavor, "dtype": args.dtype, "repeats": args.repeats,
            "decoder_trainable": args.trainable_decoder, "date": time.strftime("%Y-%m-%d")}
    (args.out / f"pixel_loss_bench{suffix}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, f"pixel loss, vae/{args.flavor} decoder, {args.dtype}, {name}", args.out / f"pixel_loss_bench{suffix}.png")
    print(f"wrote {args.out}/pixel_loss_bench{suffix}.json and .png")


if __name__ == "__main__":
    main()
