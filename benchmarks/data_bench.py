"""Throughput of the "bring your own data" input pipeline (CSV and webdataset sources), on CPU.

    python -m benchmarks.data_bench            # full run (~1.5 min on a quiet 2-core CPU)
    python -m benchmarks.data_bench --quick    # smoke run (~20 s; writes under the temp dir)

Run it on an otherwise idle machine: other jobs on the cores change every number several-fold
(the 1-minute load average at start and end is recorded in the JSON).

Test data is made at run time in a temp dir (nothing is downloaded): N (default 1024) JPEGs of
256x256, the bundled 32x32 emoji upscaled with Pillow bicubic and saved at quality 90 (~10 KB
each; real photos are larger files with more detail, so their reads and decodes cost more),
caption "a photo of <emoji name>"; written as a tab-separated CSV (filepath, title) and as
webdataset shards (make_shards.write_shards, 256 samples per shard, read through shards.json).

1. Loader alone: for source in (csv, webdataset) x num_workers in --workers (0, 1, 2), the train split
   (random-resized crop to 224, CLIP BPE tokens, context 77) through build_dataloader with
   local batch 64. The first batch (worker start-up included) is a warm-up, not timed; then
   --batches batches (default: the rest of 2 epochs, so one epoch boundary with its worker
   restart is included; at least 8; each measurement stops after --max-seconds). images/s is
   the median over --repeats, configurations interleaved round-robin by the harness (each repeat
   starting one configuration later). Per worker: images/s / workers (workers=0: the main process alone).
2. Pieces, in the main process, on one batch of 64 (median of 3 passes), in ms per image:
   file read, JPEG decode, crop_resize_pillow (the same boxes cut and resized by Pillow, as
   torchvision's transforms and so open_clip do), crop_resize (ours: torch's antialiased bicubic on
   uint8, the full decode's path), decode_crop (the loader's: a JPEG
   whose crop holds twice the output size decoded at reduced scale, then cropped), normalize,
   tokenization; total = the loader's path (read, decode_crop, normalize, tokenize).
3. The trainer's data-wait share: `python -m titan_contrastive.train` with train_configs/debug.toml
   (clip/debug) on the CSV source, --data.image_size=64 (the debug flavor's patch size 4
   divides it), batch 64, 12 steps, log every 4; `data_share` and `samples_per_s` from
   metrics.jsonl train records without the first (warm-up), median, at --data.num_workers 0 and 2,
   with the peak RSS of the trainer's largest process (harness.run_child).
`--jpeg-size` makes the JPEGs that side instead of 256 (photos are 500-2,000 px). `--uint8`: the
loader serves uint8 pixels and leaves the normalization to the step, as a GPU run's workers do
(`data.pixels_on_device`); without it they normalize to float32, as on a CPU run. Writes
data_bench.{json,csv,png} (other sizes: data_bench_{size}px.*; `--uint8`: *_uint8.*) under --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness

REPO = harness.REPO
SOURCES, WORKERS, BATCH, SIZE, CONTEXT = ("csv", "webdataset"), (0, 1, 2), 64, 224, 77


def make_data(root: Path, n: int, side: int = 256) -> dict[str, str]:
    """n JPEGs + captions as a CSV and as webdataset shards; {source: data.path}."""
    from PIL import Image

    from titan_contrastive.datasets.make_shards import write_shards

    emoji = np.load(REPO / "titan_contrastive" / "assets" / "emoji" / "emoji_32.npz")
    images, names = emoji["images"], emoji["names"]
    (root / "img").mkdir(parents=True)
    rows = []
    for i in range(n):
        rel = f"img/{i:05d}.jpg"
        image = Image.fromarray(images[i % len(images)]).resize((side, side), Image.Resampling.BICUBIC)
        image.save(root / rel, quality=90)
        rows.append((rel, "a photo of " + str(names[i % len(names)])))
    with open(root / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        writer.writerows(rows)
    write_shards(rows, root / "shards", 256, root=root)
    return {"csv": str(root / "train.csv"), "webdataset": str(root / "shards" / "shards.json")}


def build(kind: str, path: str, uint8: bool = False):
    from titan_contrastive.config.data import Data
    from titan_contrastive.datasets import build as b

    # Data(): the [data] section's defaults (tab-separated filepath/title, jpg/txt shard members)
    dataset = b.build_file_dataset(
        kind,
        "train",
        path,
        Data(),
        tokenizer=b.text_tokenizer("clip_bpe", kind, CONTEXT),
        image_size=SIZE,
        seed=0,
        augment=True,
    )
    if uint8:  # what a GPU run's workers make (data.pixels_on_device): the step normalizes on the device
        dataset.serve_uint8()
    return dataset


def time_loader(
    kind: str, path: str, workers: int, batches: int, min_batches: int, max_seconds: float, uint8: bool = False
) -> dict:
    """images/s of `batches` batches after a warm-up batch (stops after max_seconds, >= min_batches): the
    loader's start and first batch are not in the rate, so the harness's own timing of the call is not used."""
    import torch

    from titan_contrastive.datasets.loader import build_dataloader

    loader = build_dataloader(
        build(kind, path, uint8), local_batch_size=BATCH, dp_rank=0, dp_world_size=1, seed=0, num_workers=workers
    )
    start = time.perf_counter()
    next(loader)
    warmup = time.perf_counter() - start
    start, done = time.perf_counter(), 0
    while done < batches and (done < min_batches or time.perf_counter() - start < max_seconds):
        batch = next(loader)
        assert batch["image"].shape == (BATCH, 3, SIZE, SIZE) and (batch["image"].dtype == torch.uint8) == uint8
        done += 1
    elapsed = time.perf_counter() - start
    del loader  # shuts its workers down
    return {"images_per_s": done * BATCH / elapsed, "batches": done, "warmup_s": warmup}


def time_pieces(path: str) -> dict[str, float]:
    """ms per image of each step of FileImageTextDataset.__getitems__, main process, one batch."""
    from PIL import Image

    from titan_contrastive.datasets import image_transforms as tf

    ds = build("csv", path)
    source, idx = ds._source, list(range(BATCH))
    keys = ("read", "decode", "crop_resize_pillow", "crop_resize", "decode_crop", "normalize", "tokenize")
    passes: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(3):
        t0 = time.perf_counter()
        records = [source.read(i) for i in idx]
        t1 = time.perf_counter()
        imgs = [tf.decode_image(r.image) for r in records]
        t2 = time.perf_counter()
        # the same boxes cut and resized by Pillow, as torchvision's transforms (and so open_clip) do
        for i, im in zip(idx, imgs):
            box = tf.draw_box(*im.size, train=True, rng=tf.sample_rng(0, 0, i))
            np.asarray(im.crop(box).resize((SIZE, SIZE), Image.Resampling.BICUBIC))
        t2b = time.perf_counter()
        [tf.crop_resize(im, SIZE, train=True, rng=tf.sample_rng(0, 0, i)) for i, im in zip(idx, imgs)]
        t3 = time.perf_counter()
        pixels = np.stack(
            [tf.decode_crop_resize(r.image, SIZE, train=True, rng=tf.sample_rng(0, 0, i)) for i, r in zip(idx, records)]
        )
        t4 = time.perf_counter()
        ds.normalize(pixels)
        t5 = time.perf_counter()
        ds.tokenizer.encode([r.caption for r in records])
        t6 = time.perf_counter()
        for key, dt in zip(passes, (t1 - t0, t2 - t1, t2b - t2, t3 - t2b, t4 - t3, t5 - t4, t6 - t5)):
            passes[key].append(dt * 1e3 / BATCH)
    pieces = {k: harness.summary(v)["median"] for k, v in passes.items()}
    # the loader's path: decode_crop (a large JPEG decoded at reduced scale) instead of decode + crop_resize
    pieces["total"] = sum(v for k, v in pieces.items() if k not in ("decode", "crop_resize_pillow", "crop_resize"))
    return pieces


def time_trainer(csv_path: str, workers: int, steps: int) -> dict:
    """Median data_share / samples_per_s of the trainer's log records after the first, and the peak RSS
    of the trainer's largest process (its data workers are processes of their own)."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            sys.executable,
            "-m",
            "titan_contrastive.train",
            "--job.config_file=train_configs/debug.toml",
            "--data.dataset=csv",
            f"--data.path={csv_path}",
            "--data.image_size=64",
            f"--training.local_batch_size={BATCH}",
            f"--training.steps={steps}",
            "--metrics.log_freq=4",
            "--eval.enable=false",
            "--metrics.enable_tensorboard=false",
            f"--job.dump_folder={dump}",
            f"--data.num_workers={workers}",
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
        out = harness.run_child(cmd, cwd=REPO, env=env)
        if out.returncode:
            raise SystemExit(f"trainer failed (num_workers={workers}):\n{out.stderr[-4000:]}")
        records = [json.loads(line) for line in Path(dump, "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][1:]
    return {
        "workers": workers,
        "records": len(train),
        "wall_s": out.wall_s,
        "peak_rss_mib": out.peak_rss_mib,
        "data_share": statistics.median(r["data_share"] for r in train),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in train),
        "per_record": [{k: r[k] for k in ("step", "data_share", "samples_per_s")} for r in train],
    }


def plot(rows: list[dict], trainer: list[dict], title: str):  # noqa: ANN201 - a matplotlib figure
    plt = harness.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(SOURCES)
    for i, source in enumerate(SOURCES):
        vals = [r["images_per_s"] for r in rows if r["source"] == source]
        bars = ax.bar([k + i * width for k in range(len(vals))], vals, width, label=source)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    workers = list(dict.fromkeys(r["workers"] for r in rows))
    ax.set_xticks([k + width / 2 for k in range(len(workers))], [f"{w} workers" for w in workers])
    ax.set_ylabel(f"images/s (batch {BATCH}, crop {SIZE}, median)")
    ax.set_title("loader alone", fontsize=9)
    ax.legend(fontsize=8)
    bars = ax2.bar([f"W={t['workers']}" for t in trainer], [100 * t["data_share"] for t in trainer], color="tab:gray")
    ax2.bar_label(
        bars, labels=[f"{100 * t['data_share']:.0f}%\n{t['samples_per_s']:.0f} smp/s" for t in trainer], fontsize=7
    )
    ax2.set_ylim(0, 110)
    ax2.set_ylabel("data-wait share of step time (%)")
    ax2.set_title("trainer clip/debug, csv, 64 px", fontsize=9)
    fig.suptitle(title, fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1024, help="images generated")
    parser.add_argument("--jpeg-size", type=int, default=256, help="their side in pixels (photos: 500-2,000)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batches", type=int, default=0, help="timed batches per measurement (0: the rest of 2 epochs)"
    )
    parser.add_argument("--max-seconds", type=float, default=8.0, help="stop a measurement after this (>= 8 batches)")
    parser.add_argument("--trainer-steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="smoke run: N=128, 1 repeat, 3 batches, 8 trainer steps")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS), help="loader worker counts")
    parser.add_argument(
        "--uint8", action="store_true", help="the loader serves uint8 pixels, as on a GPU (data.pixels_on_device)"
    )
    parser.add_argument("--out", type=Path, help="default: benchmarks/results (--quick: a folder under the temp dir)")
    args = parser.parse_args(argv)
    min_batches = 8
    if args.quick:
        args.n, args.repeats, args.batches, args.trainer_steps, min_batches = 128, 1, 3, 8, 3
    args.out = args.out or (Path(tempfile.gettempdir()) / "data_bench_quick" if args.quick else harness.RESULTS)
    batches = args.batches or max(min_batches, 2 * (args.n // BATCH) - 1)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_data(Path(tmp), args.n, args.jpeg_size)
        jpeg_kb = statistics.mean(p.stat().st_size for p in Path(tmp, "img").iterdir()) / 1024
        print(
            f"data: {args.n} JPEGs {args.jpeg_size}x{args.jpeg_size}, mean {jpeg_kb:.1f} KB "
            f"({time.perf_counter() - t_start:.1f} s)",
            flush=True,
        )
        configs = {f"{s}/{w}": (s, w) for s in SOURCES for w in args.workers}

        def loader(source: str, workers: int) -> dict:
            res = time_loader(source, paths[source], workers, batches, min_batches, args.max_seconds, args.uint8)
            print(
                f"{source:10s} workers={workers} {res['images_per_s']:7.1f} images/s "
                f"({res['batches']} batches, warm-up {res['warmup_s']:.2f} s)",
                flush=True,
            )
            return res

        measured = harness.round_robin(
            {key: (lambda s=s, w=w: loader(s, w)) for key, (s, w) in configs.items()},
            args.repeats,
            warmup=0,
            rss=False,
            keep_values=True,
            log=lambda line: print(line.split(":")[0].replace("round", "repeat"), "done"),
        )
        runs = {configs[key]: m.values for key, m in measured.items()}
        pieces = time_pieces(paths["csv"])
        print("pieces (ms/image): " + ", ".join(f"{k} {v:.3f}" for k, v in pieces.items()), flush=True)
        trainer = []
        for workers in (0, 2):
            trainer.append(time_trainer(paths["csv"], workers, args.trainer_steps))
            print(
                f"trainer workers={workers}: data_share {trainer[-1]['data_share']:.1%}, "
                f"{trainer[-1]['samples_per_s']:.0f} samples/s ({trainer[-1]['wall_s']:.1f} s)",
                flush=True,
            )
    rows = []
    for (source, workers), res in runs.items():
        ips = statistics.median(r["images_per_s"] for r in res)
        rows.append(
            {
                "source": source,
                "workers": workers,
                "images_per_s": ips,
                "images_per_s_per_worker": ips / max(workers, 1),
                "min_images_per_s": min(r["images_per_s"] for r in res),
                "max_images_per_s": max(r["images_per_s"] for r in res),
                "batches": statistics.median(r["batches"] for r in res),
                "warmup_s": statistics.median(r["warmup_s"] for r in res),
            }
        )
    runtime = time.perf_counter() - t_start
    config = {
        "n": args.n,
        "jpeg": f"{args.jpeg_size}x{args.jpeg_size} q90",
        "mean_jpeg_kb": jpeg_kb,
        "batch": BATCH,
        "image_size": SIZE,
        "context_length": CONTEXT,
        "repeats": args.repeats,
        "batches": batches,
        "min_batches": min_batches,
        "max_seconds": args.max_seconds,
        "trainer_steps": args.trainer_steps,
        "trainer_image_size": 64,
        "torch_threads": torch.get_num_threads(),
        "quick": args.quick,
        "uint8_pixels": args.uint8,
    }
    meta = harness.metadata("cpu")
    payload = {
        "config": config,
        "runtime_s": runtime,
        "loadavg_1_5_15min": {"start": load_start, "end": os.getloadavg()},
        "pieces_ms_per_image": pieces,
        "trainer": trainer,
        "runs": {f"{s}/{w}": r for (s, w), r in runs.items()},
    }
    title = f"data_bench: {meta['cpu']}, {meta['cores']} cores, torch {torch.__version__}, {args.n} JPEGs"
    title += f" {args.jpeg_size} px" + (", uint8 pixels" if args.uint8 else "")
    harness.write_results(
        args.out,
        "data_bench" + (f"_{args.jpeg_size}px" if args.jpeg_size != 256 else "") + ("_uint8" if args.uint8 else ""),
        meta,
        payload,
        rows=rows,
        rows_key="loader",
        figure=lambda: plot(rows, trainer, title),
    )
    for row in rows:
        print(row)
    print(f"total runtime {runtime:.0f} s")


if __name__ == "__main__":
    main()
