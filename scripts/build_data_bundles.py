"""Build the data bundles in titan_contrastive/assets/ from the raw upstream packages.

Run by hand when a bundle changes, never at train time (training needs only numpy and torch):

    apt-get install dataset-fashion-mnist          # -> /usr/share/datasets/fashion-mnist
    npm install emoji-datasource-google@16.0.0     # -> node_modules/emoji-datasource-google
    PYTHONPATH=. python scripts/build_data_bundles.py    # from the repository root

Fashion-MNIST: the t10k files are copied unchanged (all 10,000 test images); the training files
are rewritten with a class-balanced subset of 2,000 images per class (20,000 of 60,000, drawn
with numpy seed 0, kept in original order), still gzipped IDX under the original names, so the
runtime reader handles the bundle, the Debian package and a user folder alike. gzip mtime is 0,
so rebuilding from the same input gives byte-identical files.

Emoji: every base emoji of emoji.json with a Google (Noto) image, skin-tone variants and the five
skin-tone modifier swatches excluded, in emoji.json sort order. Each 64x64 RGBA image is
composited on white, then resized to 32x32 with a Lanczos filter (compositing first keeps the
transparent edges from darkening). Names are the lower-cased `name` field; where two emoji share a
name (there is one such pair) both use their `short_name` instead, so captions are unique.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from titan_contrastive.datasets.emoji import BUNDLE_FILE
from titan_contrastive.datasets.fashion_mnist import BUNDLE_DIR, CLASS_NAMES, FILES, SYSTEM_DIR, load_split

logger = logging.getLogger("build_data_bundles")

TRAIN_PER_CLASS = 2_000
SUBSET_SEED = 0
EMOJI_SIZE = 32
EXCLUDED_CATEGORIES = {"Component"}  # the skin-tone modifier swatches themselves


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzipped IDX file (magic 0x0000080N), reproducibly (mtime 0)."""
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def build_fashion_mnist(source: Path, out: Path) -> None:
    """Copy the test files, write the balanced training subset, log the full-set pixel statistics."""
    out.mkdir(parents=True, exist_ok=True)
    load_split(source, "test")  # validates the files before they are copied
    for name in FILES["test"]:
        shutil.copyfile(source / name, out / name)
    images, labels = load_split(source, "train")
    pixels = images.astype(np.float64) / 255.0
    logger.info("full training set: %d images, pixel mean %.4f std %.4f", len(images), pixels.mean(), pixels.std())
    rng = np.random.default_rng(SUBSET_SEED)
    keep = np.sort(
        np.concatenate(
            [rng.choice(np.flatnonzero(labels == c), TRAIN_PER_CLASS, replace=False) for c in range(len(CLASS_NAMES))]
        )
    )
    write_idx(out / FILES["train"][0], images[keep])
    write_idx(out / FILES["train"][1], labels[keep])
    logger.info("fashion_mnist: wrote %d train + 10000 test images to %s", len(keep), out)


def emoji_entries(package: Path) -> list[dict]:
    """Base emoji with a Google image, in sort order, each with a unique lower-cased name."""
    entries = json.loads((package / "emoji.json").read_text(encoding="utf-8"))
    entries = sorted(
        (e for e in entries if e["has_img_google"] and e["category"] not in EXCLUDED_CATEGORIES),
        key=lambda e: e["sort_order"],
    )
    counts = Counter(e["name"].lower() for e in entries)
    for e in entries:
        name = e["name"].lower()
        if counts[name] > 1:
            e["caption"] = e["short_name"].replace("_", " ").lower()
            logger.info("emoji %s: name %r is shared, using short name %r", e["unified"], name, e["caption"])
        else:
            e["caption"] = name
    captions = [e["caption"] for e in entries]
    if len(set(captions)) != len(captions):
        raise ValueError(f"emoji names are not unique: {sorted(c for c, n in Counter(captions).items() if n > 1)}")
    return entries


def emoji_image(file: Path) -> np.ndarray:
    """RGBA composited on white, resized to EMOJI_SIZE, as uint8 [H,W,3]."""
    with Image.open(file) as im:
        rgba = im.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, rgba).convert("RGB")
    return np.asarray(rgb.resize((EMOJI_SIZE, EMOJI_SIZE), Image.Resampling.LANCZOS), dtype=np.uint8)


def build_emoji(package: Path, out_file: Path) -> None:
    """Write images / names / categories to a compressed npz and log the RGB statistics."""
    entries = emoji_entries(package)
    images = np.stack([emoji_image(package / "img" / "google" / "64" / e["image"]) for e in entries])
    out_file.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out_file,
        images=images,
        names=np.array([e["caption"] for e in entries]),
        categories=np.array([e["category"] for e in entries]),
    )
    pixels = images.reshape(-1, 3).astype(np.float64) / 255.0
    logger.info(
        "emoji: wrote %d images %s to %s; RGB mean %s std %s",
        len(images),
        images.shape[1:],
        out_file,
        np.round(pixels.mean(0), 4).tolist(),
        np.round(pixels.std(0), 4).tolist(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fashion-mnist", type=Path, default=SYSTEM_DIR, help="folder with the four original IDX .gz files"
    )
    parser.add_argument(
        "--emoji-package",
        type=Path,
        default=Path("node_modules/emoji-datasource-google"),
        help="the extracted npm package emoji-datasource-google",
    )
    parser.add_argument("--only", choices=["fashion_mnist", "emoji"], help="build one bundle only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.only in (None, "fashion_mnist"):
        build_fashion_mnist(args.fashion_mnist, BUNDLE_DIR)
    if args.only in (None, "emoji"):
        build_emoji(args.emoji_package, BUNDLE_FILE)


if __name__ == "__main__":
    main()
