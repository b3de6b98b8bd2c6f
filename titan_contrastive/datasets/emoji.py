"""Emoji (Noto images, Apache-2.0) as an image-text dataset: each image's caption is its name.

Unlike Fashion-MNIST every caption is distinct, so this is a retrieval task: the test split
is 200 held-out emoji (chosen by a fixed permutation, independent of the training seed, so every
run evaluates on the same ones) and evaluation asks whether an image finds its own name.
The label of a sample is its emoji id (row in the npz), unique across both splits.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_contrastive.datasets.base import DataError, ImageTextDataset

TEMPLATES = ("{}", "an emoji of {}", "a {} emoji")
BUNDLE_FILE = Path(__file__).resolve().parents[1] / "assets" / "emoji" / "emoji_32.npz"
NUM_TEST = 200
SPLIT_SEED = 0  # the held-out set never depends on training.seed
# Per-channel RGB mean/std (over [0, 1]) of the bundled emoji_32.npz, all splits.
MEAN = (0.8207, 0.7690, 0.7084)
STD = (0.2810, 0.2814, 0.3471)
_FIX = (
    "give an .npz with arrays images (uint8 [N,H,W,3]) and names (str [N]) as written by "
    "scripts/build_data_bundles.py, or leave data.path empty to use the bundled emoji"
)


def npz_file(path: str) -> Path:
    """`path` (a file, or a folder holding emoji_32.npz) if given, else the bundle."""
    if not path:
        return BUNDLE_FILE
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / BUNDLE_FILE.name
    if not file.is_file():
        raise DataError(f"data.path={path}: missing file {file}; {_FIX}")
    return file


def load_emoji(file: Path) -> tuple[np.ndarray, list[str]]:
    """Images uint8 [N,H,W,3] and names from an emoji npz, checked for consistency (the bundle's
    `categories` array is metadata for users and not needed here)."""
    try:
        with np.load(file, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files if key in ("images", "names")}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{file}: not a readable .npz file ({e}); {_FIX}") from e
    missing = [key for key in ("images", "names") if key not in arrays]
    if missing:
        raise DataError(f"{file}: missing array(s) {', '.join(missing)}; {_FIX}")
    images, names = arrays["images"], arrays["names"]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise DataError(
            f"{file}: field images is {images.dtype} {list(images.shape)}, expected uint8 [N,H,W,3]; {_FIX}"
        )
    if names.shape != images.shape[:1]:
        raise DataError(
            f"{file}: field names has shape {list(names.shape)} for {len(images)} images; expected one name per image; "
            f"{_FIX}"
        )
    if len(images) <= NUM_TEST:
        raise DataError(
            f"{file}: {len(images)} emoji, but {NUM_TEST} are held out for the test split; give more than {NUM_TEST}"
        )
    return images, [str(n) for n in names]


def split_ids(num_emoji: int, split: str) -> np.ndarray:
    """Sorted emoji ids of a split: NUM_TEST held out by a fixed permutation, train is the rest."""
    perm = np.random.default_rng(SPLIT_SEED).permutation(num_emoji)
    return np.sort(perm[:NUM_TEST] if split == "test" else perm[NUM_TEST:])


def build_emoji(
    split: str, *, path: str = "", seed: int = 0, context_length: int = 32, augment: bool = True, tokenizer: Any = None
) -> ImageTextDataset:
    """The emoji split as an ImageTextDataset. `augment` is accepted for a uniform signature but
    does nothing: emoji are not flipped (many are asymmetric symbols, arrows and letters)."""
    file = npz_file(path)
    images, names = load_emoji(file)
    ids = split_ids(len(images), split)
    subset = torch.from_numpy(np.ascontiguousarray(images[ids].transpose(0, 3, 1, 2)))
    return ImageTextDataset(
        name="emoji",
        split=split,
        images=subset,
        labels=torch.from_numpy(ids.astype(np.int64)),
        text_ids=torch.arange(len(ids)),
        subjects=[names[i] for i in ids],
        templates=TEMPLATES,
        mean=MEAN,
        std=STD,
        class_names=None,
        seed=seed,
        hflip=False,
        context_length=context_length,
        source=str(file),
        full=True,
        tokenizer=tokenizer,
    )
