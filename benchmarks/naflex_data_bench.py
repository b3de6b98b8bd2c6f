"""What SigLIP 2's NaFlex serving costs a data worker, beside the square crops CLIP and SigLIP are served:
ms per image of `FileImageTextDataset.__getitems__` in one process on one thread (a loader worker's
setting), on photos of four shapes.

    python -m benchmarks.naflex_data_bench            # about a minute on CPU
    python -m benchmarks.naflex_data_bench --quick    # smoke run

Data made at run time in a temp dir: --n JPEGs (quality 90) of 640x480, 480x640, 1024x256 and 512x512,
smooth random pictures (16 px noise upscaled bicubic), captions of a few words, as a CSV. Modes, each for the
train split (augmentation on) and the eval split:
- `square224`: the clip family's path (the JPEG decoded at reduced scale where the crop allows, cut and
  resized by torch's antialiased bicubic to 224 x 224, normalized);
- `square256`: the same at 256 (a SigLIP at 256 px, and what the square SigLIP 2 would read);
- `naflex256`: SigLIP 2's NaFlex (`datasets/naflex.py`) at its released checkpoints' 16 px patches and
  `max_num_patches = 256`: the crop (eval: the whole picture) at its own aspect ratio, Pillow's bilinear
  resize to whole patches, normalized, cut into patches, padded.
Batches of --batch; medians of --repeats timed calls, the six variants interleaved (`harness.round_robin`).
Rows: ms per image, images/s per core, and that times 16 (the GPU host's cores: an extrapolation that
assumes workers scale linearly, as `data_bench.py` measures up to this machine's cores). Writes
naflex_data_bench.{json,csv,png} under --out.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness

NAME = "naflex_data_bench"
SHAPES = ((640, 480), (480, 640), (1024, 256), (512, 512))
MODES = {"square224": 224, "square256": 256, "naflex256": 256}
SPLITS = ("train", "eval")
HOST_CORES = 16
FIELDS = ["mode", "split", "batch", "ms_per_image", "images_per_s_per_core", "images_per_s_16_cores"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256, help="JPEGs to make")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="16 JPEGs, batches of 8, 1 repeat")
    p.add_argument("--out", default=str(harness.RESULTS))
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.repeats = 16, 8, 1
    return args


def make_data(root: Path, n: int) -> Path:
    """n JPEGs of the four SHAPES in turn, with captions, as a tab-separated CSV."""
    from PIL import Image

    g = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    rows = []
    for i in range(n):
        width, height = SHAPES[i % len(SHAPES)]
        noise = Image.fromarray(g.integers(0, 256, (16, 16, 3), dtype=np.uint8))
        noise.resize((width, height), Image.Resampling.BICUBIC).save(root / "img" / f"{i}.jpg", quality=90)
        rows.append((f"img/{i}.jpg", f"a picture of {width} by {height} pixels"))
    with open(root / "train.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["filepath", "title"])
        writer.writerows(rows)
    return root / "train.csv"


def dataset(path: Path, mode: str, split: str) -> Any:
    from titan_contrastive.config.data import Data
    from titan_contrastive.datasets import build
    from titan_contrastive.datasets.naflex import NaFlexImages

    data = build.build_file_dataset(
        "csv",
        "train" if split == "train" else "test",
        str(path),
        Data(),
        tokenizer=build.text_tokenizer("clip_bpe", "csv", 77),
        image_size=MODES[mode],
        seed=0,
        augment=True,
    )
    if mode.startswith("naflex"):
        data.normalize_as((0.5,) * 3, (0.5,) * 3)
        data.serve_naflex(NaFlexImages(patch_size=16, max_num_patches=256))
    return data


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    torch.set_num_threads(1)  # as in a loader worker: one core's rate
    meta = harness.metadata("cpu")
    with tempfile.TemporaryDirectory(prefix="naflex_data_") as tmp:
        path = make_data(Path(tmp), args.n)
        sets = {f"{mode}/{split}": dataset(path, mode, split) for mode in MODES for split in SPLITS}
        batches = max(1, args.n // args.batch)
        calls = {name: 0 for name in sets}

        def read(name: str) -> Any:
            start = calls[name] % batches * args.batch  # the batches in turn
            calls[name] += 1
            return sets[name].__getitems__(list(range(start, start + args.batch)))

        measured = harness.round_robin({name: (lambda name=name: read(name)) for name in sets}, args.repeats)
        grids = sets["naflex256/eval"].__getitems__(list(range(len(SHAPES))))["image"]["spatial_shapes"].tolist()
    rows = []
    for name, m in measured.items():
        mode, split = name.split("/")
        per_image = m.median_s / args.batch
        rows.append(
            {
                "mode": mode,
                "split": split,
                "batch": args.batch,
                "ms_per_image": per_image * 1e3,
                "images_per_s_per_core": 1 / per_image,
                "images_per_s_16_cores": HOST_CORES / per_image,
                "times_s": m.times_s,
            }
        )

    def figure() -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, split in enumerate(SPLITS):
            values = [
                next(r["ms_per_image"] for r in rows if r["mode"] == mode and r["split"] == split) for mode in MODES
            ]
            ax.bar([j + 0.38 * i for j in range(len(MODES))], values, width=0.38, label=split)
        ax.set_xticks([j + 0.19 for j in range(len(MODES))], list(MODES))
        ax.set_ylabel("ms per image, one core (median)")
        ax.set_title("image serving per sample: square crops vs SigLIP 2 NaFlex, CPU")
        ax.legend()
        return fig

    payload = {"config": vars(args), "shapes": SHAPES, "naflex_grids": grids}
    harness.write_results(args.out, NAME, meta, payload, rows=rows, fields=FIELDS, figure=figure)
    for row in rows:
        print(
            f"{row['mode']:10s} {row['split']:5s} {row['ms_per_image']:.2f} ms/image  "
            f"{row['images_per_s_per_core']:.0f} images/s per core  x16: {row['images_per_s_16_cores']:.0f}"
        )
    print(f"NaFlex grids of {SHAPES}: {grids}")


if __name__ == "__main__":
    main()
