"""The --gpu mode of `benchmarks.qwen_vl_chunks` (see its docstring): on one GPU, a random-init
Qwen-VL embedder with LoRA in bf16, the batch doubled until out of memory for plain training and for
GradCache with a visual-token budget; samples/s and peak memory per batch, JSON after every row."""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks._qwen_vl_probe import PAD, ChunkProbe, is_packed
from benchmarks._qwen_vl_trainer import build_folder, build_trainer, trainer_args

GPU_NAME = "qwen_vl_chunks_gpu"
GPU_MODES = ("plain", "gradcache")
GPU_FIELDS = [
    "mode",
    "batch",
    "chunk_tokens",
    "status",
    "samples_per_s",
    "median_s",
    "min_s",
    "max_s",
    "cuda_peak_gib",
    "peak_rss_mib",
    "chunks",
    "tokens_max",
    "saved_mib_max",
    "loss",
    "reason",
]


def search(
    args: argparse.Namespace,
    mode: str,
    trainer: Any,
    make_batch: Callable[[int], dict[str, Any]],
    start: int,
    deadline: float | None,
    record: Callable[[dict[str, Any]], None],
    probe: ChunkProbe | None = None,
) -> dict[str, Any]:
    """Double the batch from `start` (halving first while the start does not fit; `harness.doubling_search`);
    each measured batch goes to `record(row)`. Returns how the search ended: {"stop": reason}."""
    import torch

    device = trainer.device
    cuda = device.type == "cuda"

    def measure(batch: int) -> dict[str, Any]:
        prepared = time.monotonic()
        data = make_batch(batch)
        prepare_s = time.monotonic() - prepared

        def step(data: dict[str, Any] = data) -> dict[str, Any]:
            try:
                out = trainer.train_step([data])
            except torch.OutOfMemoryError:
                raise
            except Exception:
                traceback.print_exc()  # the harness keeps only its first line
                raise
            return {"loss": float(out["loss"]), "chunks": list(probe.chunks) if probe else []}

        m = harness.round_robin(
            {mode: step},
            args.repeats,
            warmup=args.warmup,
            before=(lambda _: probe.clear()) if probe else None,
            device=device,
            rss=not cuda,
            tolerate=True,
            keep_values=True,
        )[mode]
        del data
        row: dict[str, Any] = {"mode": mode, "batch": batch, "chunk_tokens": args.chunk_tokens[0] if probe else None}
        if m.ok:
            chunks = m.values[-1]["chunks"]
            row |= {
                "status": "ok",
                "samples_per_s": batch / m.median_s,
                "median_s": m.median_s,
                "min_s": min(m.times_s),
                "max_s": max(m.times_s),
                "times_s": m.times_s,
                "prepare_s": prepare_s,
                "cuda_peak_gib": None if m.cuda_peak_bytes is None else m.cuda_peak_bytes / 2**30,
                "peak_rss_mib": m.peak_rss_mib,
                "loss": m.values[-1]["loss"],
            }
            if chunks:
                row |= {
                    "chunks": len(chunks),
                    "tokens_max": max(c["tokens"] for c in chunks),
                    "saved_mib_max": max(c["saved_mib"] for c in chunks),
                }
            m.values.clear()
        else:
            row |= {"status": "OOM" if harness.is_oom(m) else "error", "reason": m.reason}
        record(row)
        return row

    def seconds_for(previous: dict[str, Any], batch: int) -> float:
        per_step = previous["median_s"] * batch / previous["batch"]
        return 1.15 * (per_step * (args.warmup + args.repeats) + previous["prepare_s"] * 2)

    return harness.doubling_search(
        start,
        measure,
        smallest=2,  # a contrastive batch needs two samples
        largest=args.max_batch,
        deadline=deadline,
        seconds_for=seconds_for,
        device=device,
    )


class Batches:
    """The first n samples of a data set (wrapping around), as one batch; a larger n processes only
    the samples it adds to the largest batch made so far (the images are resized and cut into patches
    on the host, ~0.1 s each at 1,024 px: the doubling search would otherwise process each twice)."""

    def __init__(self, data: Any) -> None:
        self.data, self.have = data, None

    def _take(self, start: int, stop: int) -> dict[str, Any]:
        return self.data.__getitems__([i % len(self.data) for i in range(start, stop)])

    def first(self, n: int) -> dict[str, Any]:
        have = 0 if self.have is None else len(self.have["query"])
        if n <= have:
            return self.have if n == have else self._take(0, n)
        self.have = self._take(0, n) if self.have is None else concat_batches(self.have, self._take(have, n))
        return self.have


def concat_batches(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two processed batches as one, as the data set serves it: packed patches and grids one after the
    other, right-padded token ids [B, L] padded to the wider of the two (PAD), the rest concatenated."""
    import torch
    import torch.nn.functional as F

    out = {}
    for key, x in a.items():
        y = b[key]
        if not is_packed(key) and x.dim() == 2 and x.shape[1] != y.shape[1]:
            width = max(x.shape[1], y.shape[1])
            x, y = (F.pad(t, (0, width - t.shape[1]), value=PAD) for t in (x, y))
        out[key] = torch.cat([x, y])
    return out


def summarize_gpu(rows: list[dict[str, Any]], ends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {mode: [r for r in rows if r["mode"] == mode and r["status"] == "ok"] for mode in GPU_MODES}
    largest = {mode: max(rs, key=lambda r: r["batch"]) if rs else None for mode, rs in ok.items()}
    peaks = {mode: [r.get("cuda_peak_gib") for r in rs] for mode, rs in ok.items()}
    out: dict[str, Any] = {
        "largest_batch": {m: r["batch"] if r else None for m, r in largest.items()},
        "samples_per_s_at_largest": {m: r["samples_per_s"] if r else None for m, r in largest.items()},
        "peak_gib_at_largest": {m: r.get("cuda_peak_gib") if r else None for m, r in largest.items()},
        "peak_gib_range": {
            m: [min(p), max(p)] if p and None not in p else None for m, p in peaks.items()
        },  # flat for gradcache is the claim
        "stop": {m: e["stop"] for m, e in ends.items()},
        "gradcache_vs_plain_batch": None,
        "gradcache_vs_plain_samples_per_s": None,
    }
    g, p = largest["gradcache"], largest["plain"]
    if g and p:
        out["gradcache_vs_plain_batch"] = g["batch"] / p["batch"]
        out["gradcache_vs_plain_samples_per_s"] = g["samples_per_s"] / p["samples_per_s"]
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for mode in GPU_MODES:
        batch, rate = summary["largest_batch"].get(mode), summary["samples_per_s_at_largest"].get(mode)
        stop = summary["stop"].get(mode, "not run")
        if batch is None:
            lines.append(f"{mode}: no batch fits ({stop})")
            continue
        peaks = summary["peak_gib_range"].get(mode)
        memory = f", peak {peaks[0]:.1f}-{peaks[1]:.1f} GiB over its batches" if peaks else ""
        lines.append(f"{mode}: largest batch {batch}, {rate:.2f} samples/s{memory} (stopped: {stop})")
    if summary["gradcache_vs_plain_batch"] is not None:
        lines.append(
            f"GradCache at its largest batch against plain at its largest: {summary['gradcache_vs_plain_batch']:g}x "
            f"the batch, {summary['gradcache_vs_plain_samples_per_s']:.3f}x the samples/s"
        )
    return lines


def run_gpu(args: argparse.Namespace, tmp: Path, start: float) -> None:
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit(
            "qwen_vl_chunks --gpu runs as one process (an out-of-memory rank would leave its peers waiting)"
        )
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None
    meta = harness.metadata(
        device, pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), loadavg_at_start=args.load_at_start
    )
    setup: dict[str, Any] = {"config": vars(args), "device": harness.device_name(device), "capacity_gib": capacity}
    title = (
        f"Qwen2-VL {args.size} (random init), LoRA r{args.lora_rank}, "
        f"images {'/'.join(map(str, args.image_sizes))} px, "
        f"GradCache <= {args.chunk_tokens[0]} tokens per chunk, {harness.device_name(device)}"
    )
    log = harness.SearchLog(
        args.out,
        GPU_NAME,
        meta,
        GPU_FIELDS,
        args.modes,
        title,
        summarize_gpu,
        setup,
        note=lambda row: f", {row['chunks']} chunks (<= {row['tokens_max']} tokens)" if row.get("chunks") else "",
    )

    folder = build_folder(tmp / f"qwen2_vl-{args.size}", args.size)
    print(f"built {folder.name} in {time.monotonic() - start:.1f} s", flush=True)
    batches: list[Batches] = []  # the data of every mode's trainer is the same: built once

    def build(mode: str) -> Any:
        tokens = args.chunk_tokens[0] if mode == "gradcache" else 0
        trainer = build_trainer(trainer_args(args, folder, tmp / f"run-{mode}", cuda=cuda, chunk_tokens=tokens))
        params = list(trainer.model.parameters())
        log.setup.update(
            layout=trainer.dims.mode,
            params=sum(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in params if p.requires_grad),
            lora_targets=list(trainer.model_args.lora_targets),
        )
        batches[:] = batches or [Batches(trainer.train_set)]
        return trainer

    def make_batch(n: int) -> dict[str, Any]:
        out = batches[0].first(n)
        return {k: v.pin_memory() if cuda and hasattr(v, "pin_memory") else v for k, v in out.items()}

    def search_mode(mode: str, trainer: Any, first: int, deadline: float | None) -> dict[str, Any]:
        probe = ChunkProbe(trainer) if mode == "gradcache" else None
        return search(args, mode, trainer, make_batch, first, deadline, log.record, probe)

    harness.search_each_mode(
        log,
        build=build,
        search=search_mode,
        start_batch=args.start_batch,
        device=device,
        start=start,
        time_budget=args.time_budget,
    )
    harness.finish_modes(log, summary_lines, start)
