"""Pixel loss through a VAE decoder: v0 vs chunked vs per_chunk_backward, time and memory side by side.

    python -m benchmarks.pixel_loss_bench                       # H100: sd decoder, bf16, 8x1024², 4x512², 8x256²
    python -m benchmarks.pixel_loss_bench --flavor debug --cases 8x64 4x128 --dtype float32 --repeats 3   # CPU smoke

Each measurement is one loss forward + the caller's backward into the latents (a leaf standing in
for the upstream model), with the decoder frozen (seed 003's setting; `--trainable-decoder` to
also compute its parameter gradients). The modes of a case run interleaved on the same inputs
(harness.round_robin: one warm-up round, then `--repeats` rounds). Reported per (case, mode):
median (min, max) time; on CUDA the allocator's peak above the baseline (decoder weights + inputs
already allocated), on CPU the peak RSS during a call (a lower bound: the modes share the heap), on
every device the peak bytes of activations saved for backward and still alive (saved-tensor hooks;
device-independent, one more untimed call). A CUDA out-of-memory is recorded as "oom".
Writes `pixel_loss_bench[_cpu].{json,csv,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from titan_contrastive.components.memory_probe import SavedActivations
from titan_contrastive.components.pixel_loss import compute_pixel_loss
from titan_contrastive.models.vae import Decoder, vae_flavors

MODES = {
    "v0": dict(mode="v0"),
    "chunked": dict(mode="chunked"),
    "chunked+empty_cache/2": dict(mode="chunked", empty_cache_every=2),
    "per_chunk_backward": dict(mode="per_chunk_backward"),
}


def measure(
    decoder: Decoder, n: int, size: int, modes: list[str], args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """One case: every mode on the same latents, images and masks, interleaved; one row per mode."""
    dtype = getattr(torch, args.dtype)
    cfg = vae_flavors[args.flavor]
    side = size // cfg.downsample
    latents = torch.randn(n, cfg.latent_channels, side, side, device=device, dtype=dtype, requires_grad=True)
    images = torch.rand(n, 3, size, size, device=device, dtype=dtype) * 2 - 1
    masks = torch.ones(n, 1, size, size, device=device, dtype=dtype)
    cuda = device.type == "cuda"

    def once(mode: str, probe: SavedActivations | None = None) -> None:
        with probe or contextlib.nullcontext():
            loss = compute_pixel_loss(latents, images, masks, decoder, **MODES[mode])
        loss.backward()

    def reset(_: str = "") -> None:
        latents.grad = None

    runs = harness.round_robin(
        {mode: (lambda mode=mode: once(mode)) for mode in modes},
        args.repeats,
        warmup=1,
        before=reset,
        device=device,
        rss=not cuda,
    )
    rows = []
    for mode, m in runs.items():
        row: dict[str, Any] = {"case": f"{n}x{size}", "mode": mode, "images": n, "size": size}
        rows.append(row)
        if not m.ok:
            row.update(oom=True)
            continue
        if cuda:
            row["peak_extra_gib"] = m.cuda_peak_extra_bytes / 2**30
        else:
            row["peak_rss_mib"] = m.peak_rss_mib
        reset()
        probe = SavedActivations(decoder.parameters())
        try:
            once(mode, probe)
        except torch.OutOfMemoryError:
            row.update(oom=True)
            torch.cuda.empty_cache()
            continue
        stats = harness.summary(m.times_s)
        row.update(
            time_ms=1e3 * stats["median"],
            min_ms=1e3 * stats["min"],
            max_ms=1e3 * stats["max"],
            saved_activations_gib=probe.peak / 2**30,
        )
    reset()
    return rows


def plot(rows: list[dict[str, Any]], title: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
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
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="sd", choices=list(vae_flavors))
    parser.add_argument("--cases", nargs="+", default=["8x1024", "4x512", "8x256"], help="IMAGESxSIZE")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--trainable-decoder", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    decoder = Decoder(vae_flavors[args.flavor]).to(device, getattr(torch, args.dtype))
    decoder.requires_grad_(args.trainable_decoder)
    name = harness.device_name(device)
    modes = [m for m in args.modes if device.type == "cuda" or not m.startswith("chunked+")]
    rows = []
    for case in args.cases:
        n, size = map(int, case.split("x"))
        for row in measure(decoder, n, size, modes, args, device):
            rows.append(row)
            print(json.dumps(row))
    suffix = "" if device.type == "cuda" else "_cpu"
    meta = harness.metadata(device)
    payload = {
        "device": name,
        "flavor": args.flavor,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "decoder_trainable": args.trainable_decoder,
    }
    harness.write_results(
        args.out,
        f"pixel_loss_bench{suffix}",
        meta,
        payload,
        rows=rows,
        dpi=110,
        figure=lambda: plot(rows, f"pixel loss, vae/{args.flavor} decoder, {args.dtype}, {name}"),
    )
    print(f"wrote {args.out}/pixel_loss_bench{suffix}.json and .png")


if __name__ == "__main__":
    main()
