"""Fashion-MNIST (Zalando, MIT licence) as an image-text dataset: captions from the class names.

Where the data comes from, in order: `data.path` if given (an error if it is missing or
incomplete), else the Debian package `dataset-fashion-mnist` if installed, else the subset that
ships in `titan_contrastive/assets/fashion_mnist` (all 10,000 test images, a class-balanced 20,000
of the 60,000 training images). All three hold the original gzipped IDX files under the original
names, so one reader serves them all and a corrupt or truncated file is reported by name.
"""

from __future__ import annotations

import functools
import gzip
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.datasets.base import DataError, ImageTextDataset

CLASS_NAMES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
# At most 30 bytes with the longest class name, so that no caption is cut at the default
# context_length of 32 (BOS + 30 bytes + EOS): a cut would drop the class name itself.
TEMPLATES = (
    "a photo of a {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a photo of the {}.",
    "a black and white {}.",
)
# Pixel mean/std (over [0, 1]) of the full 60,000-image training set, whatever the source, so
# that a model trained on the bundled subset sees the same input scale as one trained on the full set.
MEAN = (0.2860,)
STD = (0.3530,)

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
BUNDLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "fashion_mnist"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
FULL_SIZES = {"train": 60_000, "test": 10_000}
_FIX = (
    "give a folder with the four Fashion-MNIST IDX files, install the Debian package dataset-fashion-mnist, "
    "or leave data.path empty to use the bundled subset"
)


@functools.lru_cache(maxsize=4)
def _gunzip(path: Path, mtime_ns: int, size: int) -> bytes:
    """The file's bytes after gunzip, kept for a later build from the same unchanged file in this
    process (a notebook or a test session builds many trainers); a changed file is read again."""
    with gzip.open(path, "rb") as f:
        return f.read()


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """A gzipped IDX file of unsigned bytes (magic 0x0000080N, N = ndim) as a read-only uint8 array."""
    try:
        stat = path.stat()
        data = _gunzip(path.resolve(), stat.st_mtime_ns, stat.st_size)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(
            f"{path}: not a readable gzip file ({e}); replace it with the original download ({_FIX})"
        ) from e
    magic = bytes([0, 0, 8, ndim])
    header = 4 + 4 * ndim
    if len(data) < header or data[:4] != magic:
        raise DataError(
            f"{path}: IDX magic {data[:4].hex()} is not {magic.hex()} (uint8, {ndim}-d); wrong or corrupt file ({_FIX})"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + math.prod(shape)
    if len(data) != expected:
        raise DataError(
            f"{path}: {len(data)} bytes after gunzip, expected {expected} for an IDX array of shape {shape}; "
            f"truncated or corrupt file ({_FIX})"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def data_folder(path: str) -> Path:
    """`path` if given, else the Debian package folder if it exists, else the bundle."""
    if path:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise DataError(f"data.path={path}: no such folder; {_FIX}")
        return folder
    return SYSTEM_DIR if SYSTEM_DIR.is_dir() else BUNDLE_DIR


def load_split(folder: Path, split: str, path_setting: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N,H,W] and labels uint8 [N] of one split, checked for consistency."""
    image_file, label_file = (folder / name for name in FILES[split])
    where = f"data.path={path_setting}" if path_setting else f"data.path='' (using {folder})"
    for file in (image_file, label_file):
        if not file.is_file():
            raise DataError(f"{where}: missing file {file}; {_FIX}")
    images = read_idx(image_file, 3)
    labels = read_idx(label_file, 1)
    if len(labels) != len(images):
        raise DataError(
            f"{label_file}: {len(labels)} labels for {len(images)} images in {image_file}; the two files do not belong "
            f"together ({_FIX})"
        )
    if len(labels) and labels.max() >= len(CLASS_NAMES):
        raise DataError(
            f"{label_file}: label {labels.max()} out of range 0..{len(CLASS_NAMES) - 1}; not a Fashion-MNIST label "
            f"file ({_FIX})"
        )
    return images, labels


def build_fashion_mnist(
    split: str, *, path: str = "", seed: int = 0, context_length: int = 32, augment: bool = True, tokenizer: Any = None
) -> ImageTextDataset:
    """The Fashion-MNIST split as an ImageTextDataset; train samples get a random template and,
    with `augment`, a random horizontal flip (clothes are left-right symmetric)."""
    folder = data_folder(path)
    images, labels = load_split(folder, split, path)
    return ImageTextDataset(
        name="fashion_mnist",
        split=split,
        images=torch.from_numpy(images.copy()).unsqueeze(1),
        labels=torch.from_numpy(labels.astype(np.int64)),
        text_ids=torch.from_numpy(labels.astype(np.int64)),
        subjects=CLASS_NAMES,
        templates=TEMPLATES,
        mean=MEAN,
        std=STD,
        class_names=list(CLASS_NAMES),
        seed=seed,
        hflip=augment and split == "train",
        context_length=context_length,
        source=str(folder),
        full=len(labels) == FULL_SIZES[split],
        tokenizer=tokenizer,
    )
