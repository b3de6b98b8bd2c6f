"""Qwen-VL: fixed GradCache chunks against a visual-token budget, per chunk of the re-forward (issue 30).

    python -m benchmarks.qwen_vl_chunks                       # CPU: the table of docs/performance.md (~3 min)
    python -m benchmarks.qwen_vl_chunks --quick --out /tmp/q  # smoke test (tiny model, small images, seconds)
    python -m benchmarks.qwen_vl_chunks --gpu --time-budget 480 --out DIR             # one H100: gpu_session.sh 8
    python -m benchmarks.qwen_vl_chunks --gpu --size tiny --device cpu --image-sizes 28 56 --chunk-tokens 40 \
        --start-batch 4 --max-batch 8 --repeats 1 --out /tmp/g                        # the --gpu path, smoke

A sample's visual tokens grow with its image's area: a Qwen2-VL image of 224 px is 16 x 16 patches
(64 visual tokens after the 2 x 2 merge), one of 896 px 64 x 64 (1,024). GradCache with a fixed
number of samples per chunk ignores this, so what one chunk holds for its backward depends on
which images land in it; with `[gradcache] chunk_tokens` the samples are sorted by length and
packed to a token budget (text + visual tokens of the chunk's ids, padding included), so a chunk
holds at most that many tokens whatever the images.

CPU mode (default). A random-init Qwen2-VL folder (`models.qwen_vl.random_folder`, size `small`:
4 vision blocks and 4 decoder layers, 128 wide; a word-level tokenizer of the emoji captions' words)
in a temporary folder, trained through the project's own `Trainer.train_step` in this process
(`model.name=qwen_vl`, the bundled emoji, t2i: captions query images, float32), one trainer per
variant, every variant the same batch: `--batch` samples with the images served at `--image-sizes`
px (square images: the issue's "16 x 16 to 64 x 96 patches" is covered as 16 x 16 to 64 x 64),
the same number of each size, in the data's order (`data.max_pixels` lets 896 px through unshrunk).
Variants: GradCache with fixed chunks of `--chunk-sizes` samples, GradCache with token budgets
`--chunk-tokens`, and `plain` (the whole batch in one forward and backward, for reference), run
interleaved (`harness.round_robin`: `--warmup` untimed rounds, then `--repeats` timed ones).

Per variant: the step's median seconds and its peak RSS growth (`harness.PeakRSS`; all variants
share one heap, so a lower bound), and per chunk of the GradCache re-forward (the forward with
gradients; GradCache runs its last chunk's with the first pass and keeps its graph, so every chunk
has exactly one): its samples, the tokens it forwards (query + document ids after trimming,
padding included: what a budget counts), its real and its visual tokens, its vision patches, and
the bytes it saves for its backward, measured with `torch.autograd.graph.saved_tensors_hooks`
around the model's forward: the unique storages of the saved tensors, without the parameters'
and buffers' (held by the model anyway); a saved view of the batch's own inputs counts its own
bytes, not the whole batch's. The chunks are the same at every step (the check is in the JSON:
`chunks_repeatable`), and every variant trains the same model on the same batch, so their losses
agree step by step up to float rounding (GradCache is exact; `loss_spread`).

GPU mode (`--gpu`; benchmarks/gpu_session.sh 8). A random-init `write_random_folder(...,
"qwen2_vl", "2b")` (Qwen2-VL-2B's dimensions) with LoRA (`[lora] enable`, rank `--lora-rank` on the
language model's q_proj / v_proj), bfloat16 autocast on float32 master weights, images at
`--image-sizes` (448-1,024 px), through `Trainer.train_step`, one process (layout single). Modes,
in `--modes` order: `plain` (one forward and backward of the batch) and `gradcache` (token-budget
chunks of `--chunk-tokens`). Each doubles the batch from `--start-batch` until CUDA runs out of
memory, `--max-batch` or the time budget (`harness.search_each_mode`, as decoder_lora_bench: a
start that does not fit is halved until one does, down to 2 samples; the second mode starts at the
first's largest batch when that is smaller, so both have a row there; `--time-budget` seconds from
the start end a mode's search before a batch whose predicted time would pass its share of what is
left). Per batch: one warm-up and `--repeats` timed steps, median samples/s, peak CUDA memory (peak
RSS on CPU), and for gradcache the chunks of the last step (under autocast a chunk's saved bytes
include the bfloat16 copies of the frozen weights, ~3.7 GiB at 2b, that its graph keeps for the
input gradients). The claim it measures: GradCache's peak memory is flat in the batch (the batch stays on the host; a
chunk goes to the device when it is forwarded), so its largest batch is set by time, plain's by
memory. The JSON is written after every row.

Writes qwen_vl_chunks.{json,csv,png} (CPU) or qwen_vl_chunks_gpu.{json,csv,png} (--gpu) under --out.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _qwen_vl_gpu, harness
from benchmarks._qwen_vl_gpu import GPU_MODES
from benchmarks._qwen_vl_probe import (
    ChunkProbe,
    chunk_tokens,
    describe_chunks,
    image_grids,
    is_grid,
    same_chunks,
)
from benchmarks._qwen_vl_trainer import build_folder, build_trainer, trainer_args

NAME = "qwen_vl_chunks"
CPU_DEFAULTS = dict(
    size="small",
    image_sizes=[224, 448, 672, 896],
    batch=8,
    chunk_sizes=[2, 4],
    chunk_tokens=[1100, 2200],
    context_length=16,
    repeats=4,
    warmup=1,
)
QUICK_DEFAULTS = dict(
    size="tiny", image_sizes=[28, 56, 112], batch=6, chunk_sizes=[2, 3], chunk_tokens=[40, 80], repeats=1, warmup=0
)
GPU_DEFAULTS = dict(
    size="2b", image_sizes=[448, 640, 832, 1024], chunk_tokens=[4096], context_length=32, repeats=2, warmup=1
)
CPU_FIELDS = [
    "variant",
    "kind",
    "chunk_size",
    "chunk_tokens",
    "status",
    "chunks",
    "samples_per_chunk",
    "tokens_min",
    "tokens_median",
    "tokens_max",
    "visual_tokens_min",
    "visual_tokens_max",
    "saved_mib_min",
    "saved_mib_median",
    "saved_mib_max",
    "saved_spread",
    "saved_max_over_mean",
    "saved_mib_total",
    "median_s",
    "min_s",
    "max_s",
    "median_cpu_s",
    "rss_growth_mib",
    "loss",
    "reason",
]


# ---------------------------------------------------------------- what each chunk forwards and saves


def indices_of(batch: dict[str, Any]) -> range:
    """The rows of a batch."""
    return range(len(batch["query"]))


def balanced_indices(dataset: Any, sizes: Sequence[int], batch: int) -> list[int]:
    """The first samples of `dataset` in its order such that each of the `sizes` it serves appears
    batch / len(sizes) times (the dataset draws each sample's size from a hash of its index)."""
    import numpy as np

    if batch % len(sizes):
        raise SystemExit(f"--batch {batch}: give a multiple of the {len(sizes)} image sizes (the same number of each)")
    want = batch // len(sizes)
    drawn = dataset._image_size_ids(np.arange(len(dataset)))
    taken: list[int] = []
    counts = [0] * len(sizes)
    for i, s in enumerate(drawn.tolist()):
        if counts[s] < want:
            counts[s] += 1
            taken.append(i)
        if len(taken) == batch:
            return taken
    raise SystemExit(f"the data set has too few samples of some size for a batch of {batch}")


def variants_of(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """{name: {"chunk_size", "chunk_tokens"}}: fixed chunks, token budgets, plain (both 0)."""
    out = {f"chunks of {c}": {"chunk_size": c, "chunk_tokens": 0} for c in args.chunk_sizes}
    out |= {f"<= {t} tokens": {"chunk_size": 0, "chunk_tokens": t} for t in args.chunk_tokens}
    if not args.no_plain:
        out["plain"] = {"chunk_size": 0, "chunk_tokens": 0}
    return out


def run_cpu(args: argparse.Namespace, tmp: Path, start: float) -> None:
    import torch

    folder = build_folder(tmp / f"qwen2_vl-{args.size}", args.size)
    print(f"built {folder.name} in {time.monotonic() - start:.1f} s", flush=True)
    variants = variants_of(args)
    trainers: dict[str, Any] = {}
    probes: dict[str, ChunkProbe] = {}
    try:
        for name, v in variants.items():
            dump = tmp / f"run-{len(trainers)}"
            trainers[name] = build_trainer(trainer_args(args, folder, dump, cuda=False, **v))
            probes[name] = ChunkProbe(trainers[name])
        first = next(iter(trainers.values()))
        params = sum(p.numel() for p in first.model.parameters())
        data = first.train_set
        indices = balanced_indices(data, args.image_sizes, args.batch)
        batch = data.__getitems__(indices)
        grids = [tuple(g) for g in image_grids(batch)[:, 1:].tolist()]
        per_sample = [
            chunk_tokens({k: v[i : i + 1] for k, v in batch.items() if k in ("query", "doc") or is_grid(k)})
            for i in indices_of(batch)
        ]
        longest = max(s["tokens"] for s in per_sample)
        print(f"batch of {args.batch}: patch grids {grids}; longest sample {longest} tokens")
        for budget in args.chunk_tokens:
            if budget < longest:
                print(f"note: a budget of {budget} tokens is below the longest sample: that sample is a chunk alone")
        print(f"{len(variants)} variants, {args.warmup} warm-up + {args.repeats} timed steps each", flush=True)
        calls: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}

        def step(name: str) -> dict[str, Any]:
            out = trainers[name].train_step([batch])
            record = {"loss": float(out["loss"]), "chunks": list(probes[name].chunks)}
            calls[name].append(record)
            return record

        runs = harness.round_robin(
            {name: (lambda name=name: step(name)) for name in variants},
            args.repeats,
            warmup=args.warmup,
            before=lambda name: probes[name].clear(),
            keep_values=True,
            log=lambda line: print(line, flush=True),
        )
    finally:
        for trainer in trainers.values():
            trainer.metrics.close()
    rows = []
    for name, m in runs.items():
        v = variants[name]
        kind = "fixed" if v["chunk_size"] else "tokens" if v["chunk_tokens"] else "plain"
        row: dict[str, Any] = {"variant": name, "kind": kind, **v, "status": m.status}
        if m.ok:
            last = m.values[-1]["chunks"]
            every = [c["chunks"] for c in calls[name]]
            row |= describe_chunks(last)
            keys = (
                "median_s",
                "min_s",
                "max_s",
                "times_s",
                "median_cpu_s",
                "cpu_times_s",
                "rss_growth_mib",
                "peak_rss_mib",
            )
            row |= {k: m.row()[k] for k in keys}
            row |= {
                "loss": m.values[-1]["loss"],
                "losses": [c["loss"] for c in calls[name]],
                "chunks_repeatable": all(same_chunks(every[0], c) for c in every[1:]),
                "per_chunk": last,
            }
        else:
            row["reason"] = m.reason
        rows.append(row)
    ok = [r for r in rows if r["status"] == "ok"]
    n_steps = min((len(r["losses"]) for r in ok), default=0)
    spread = [max(r["losses"][i] for r in ok) - min(r["losses"][i] for r in ok) for i in range(n_steps)]
    meta = harness.metadata(torch.device("cpu"), loadavg_at_start=args.load_at_start)
    payload = {
        "config": vars(args),
        "model": {"arch": "qwen2_vl", "size": args.size, "params": params},
        "batch": {"indices": indices, "patch_grids": grids, "per_sample": per_sample},
        "loss_spread": spread,  # per step: the largest minus the smallest loss over the variants
    }
    print_table(rows)
    if spread:
        print(f"losses of the variants at each step agree within {max(spread):.2e}")
    title = (
        f"Qwen2-VL {args.size} (random init), batch {args.batch} at {'/'.join(map(str, args.image_sizes))} px, "
        f"float32, {harness.device_name('cpu')}"
    )
    harness.write_results(
        args.out, NAME, meta, payload, rows=rows, fields=CPU_FIELDS, figure=lambda: plot_cpu(rows, title)
    )
    print(f"wrote {args.out}/{NAME}.json, .csv and .png ({time.monotonic() - start:.0f} s)")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("variant", "chunks", "tokens min/med/max", "saved MiB min/med/max", "spread", "step s", "cpu s")
    print("{:>18} {:>6} {:>22} {:>24} {:>7} {:>8} {:>8}".format(*head))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['variant']:>18} {r['status']}: {r.get('reason', '')}")
            continue
        tokens = f"{r['tokens_min']}/{r['tokens_median']:g}/{r['tokens_max']}"
        saved = f"{r['saved_mib_min']:.1f}/{r['saved_mib_median']:.1f}/{r['saved_mib_max']:.1f}"
        spread = f"{r['saved_spread']:.2f}x" if r["saved_spread"] else "-"
        times = f"{r['median_s']:>8.2f} {r['median_cpu_s']:>8.2f}"
        print(f"{r['variant']:>18} {r['chunks']:>6} {tokens:>22} {saved:>24} {spread:>7} {times}")


def plot_cpu(rows: list[dict[str, Any]], title: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    for i, r in enumerate(ok):
        chunks = r["per_chunk"]
        ax1.scatter([i] * len(chunks), [c["tokens"] for c in chunks], s=30, alpha=0.7)
        ax2.scatter([i] * len(chunks), [c["saved_mib"] for c in chunks], s=30, alpha=0.7)
        if r["chunk_tokens"]:
            ax1.hlines(r["chunk_tokens"], i - 0.3, i + 0.3, colors="k", linestyles=":", lw=1)
    ax3.bar(range(len(ok)), [r["median_s"] for r in ok], color="0.6")
    labels = [r["variant"] for r in ok]
    for ax, ylabel in (
        (ax1, "tokens forwarded per chunk (ids, padded)"),
        (ax2, "saved for backward per chunk (MiB)"),
        (ax3, "step (s, median)"),
    ):
        ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
    ax2.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    return fig


# ---------------------------------------------------------------- GPU mode: the largest batch of each


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 28-112 px, one timed step")
    parser.add_argument(
        "--gpu", action="store_true", help="the largest batch of plain and GradCache (module docstring)"
    )
    parser.add_argument(
        "--size", choices=["tiny", "small", "2b"], help="random_folder size (small; --quick tiny; --gpu 2b)"
    )
    parser.add_argument(
        "--image-sizes", type=int, nargs="+", help="px, squares (224 448 672 896; --gpu 448 640 832 1024)"
    )
    parser.add_argument("--batch", type=int, help="CPU: samples in the one global batch (8; --quick 6)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", help="CPU: fixed GradCache chunks (2 4)")
    parser.add_argument("--chunk-tokens", type=int, nargs="+", help="token budgets (1100 2200; --gpu one: 4096)")
    parser.add_argument("--no-plain", action="store_true", help="CPU: leave out the plain reference step")
    parser.add_argument("--context-length", type=int, help="caption tokens at most (16; --gpu 32)")
    parser.add_argument("--repeats", type=int, help="timed steps per variant or batch size (4; --gpu 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant or batch size (1; --quick 0)")
    parser.add_argument("--start-batch", type=int, default=8, help="--gpu: the first batch tried")
    parser.add_argument("--max-batch", type=int, default=1 << 16, help="--gpu: no batch above this")
    parser.add_argument("--modes", nargs="+", choices=GPU_MODES, default=list(GPU_MODES), help="--gpu: in this order")
    parser.add_argument("--time-budget", type=float, default=0.0, help="--gpu: seconds from the start; 0 = none")
    parser.add_argument("--lora-rank", type=int, default=16, help="--gpu: LoRA rank (alpha 2 r)")
    parser.add_argument("--precision", choices=["bfloat16", "float32"], help="--gpu: compute dtype (bf16 on CUDA)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="--gpu: where it runs")
    parser.add_argument("--train-arg", action="append", default=[], help="a further trainer override (repeatable)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    defaults = GPU_DEFAULTS if args.gpu else CPU_DEFAULTS | (QUICK_DEFAULTS if args.quick else {})
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.gpu and len(args.chunk_tokens) != 1:
        parser.error("--gpu measures one token budget: give one --chunk-tokens")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.monotonic()
    args.load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None  # others' work, before ours
    logging.basicConfig(
        level=logging.WARNING,
        format="[titan_contrastive] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )
    with tempfile.TemporaryDirectory(prefix="qwen_vl_chunks_") as tmp:
        (_qwen_vl_gpu.run_gpu if args.gpu else run_cpu)(args, Path(tmp), start)


if __name__ == "__main__":
    main()
