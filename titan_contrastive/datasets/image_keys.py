"""An image's key in a file of a frozen model's embeddings (`datasets/frozen.py`): the same image gets the same
key wherever it is stored and whatever view of it a step is served."""

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
