"""An image's key in a file of a frozen model's embeddings (`datasets/frozen.py`): the same image gets the same
key wherever it is stored and whatever view of it a step is served. A file of several views per image
(`embed_images --views K`) keys view v of an image `view_key(key, v)`, and the view's crop is drawn by
`view_rng(key, v)` (the bundled sets' flip: v's parity): a function of the image and the view alone, so any copy of
the data, in any order, serves the views the file holds."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def image_key(image: object) -> str:
    """An image's key in an image-text file: the SHA-1 of its bytes as stored (an encoded file's, a tar member's, a
    dataset cell's; an array's or tensor's raw uint8 values; a Pillow image's mode, size and pixels)."""
    if isinstance(image, torch.Tensor):
        image = image.contiguous().numpy()
    if isinstance(image, np.ndarray):
        data = np.ascontiguousarray(image).tobytes()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    else:  # a decoded Pillow image
        data = f"{image.mode}{image.size}".encode() + image.tobytes()
    return hashlib.sha1(data).hexdigest()


def view_key(key: str, view: int) -> str:
    """The key of view `view` of the image keyed `key`."""
    return f"{key}#{view}"


def view_rng(key: str, view: int) -> np.random.Generator:
    """The generator of view `view`'s randomness of the image keyed `key` (a pure function of the two)."""
    return np.random.default_rng((int(key, 16), view))
