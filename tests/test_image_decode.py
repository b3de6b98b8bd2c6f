"""`decode_crop_resize`: a large JPEG decoded at reduced scale gives nearly the full decode's crop, faster to
make; anything else is exactly `crop_resize(decode_image(...))`."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from titan_contrastive.datasets.image_transforms import crop_resize, decode_crop_resize, decode_image, sample_rng


def _encoded(width: int, height: int, fmt: str) -> bytes:
    """A smooth photo-like image (gradients and a few discs), encoded."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1).astype(np.uint8)
    for cx, cy, r in ((width // 3, height // 2, height // 5), (2 * width // 3, height // 3, height // 7)):
        rgb[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = (230, 40, 60)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return out.getvalue()


def test_small_images_and_pngs_are_the_plain_crop() -> None:
    for data in (_encoded(300, 260, "JPEG"), _encoded(900, 700, "PNG")):
        for train in (True, False):
            full = crop_resize(decode_image(data), 224, train=train, rng=sample_rng(0, 0, 3))
            assert np.array_equal(decode_crop_resize(data, 224, train=train, rng=sample_rng(0, 0, 3)), full)


def test_a_large_jpeg_is_decoded_smaller_and_keeps_its_crop() -> None:
    data = _encoded(1024, 800, "JPEG")
    for train in (True, False):
        full = crop_resize(decode_image(data), 224, train=train, rng=sample_rng(0, 0, 3)).astype(float)
        fast = decode_crop_resize(data, 224, train=train, rng=sample_rng(0, 0, 3)).astype(float)
        assert not np.array_equal(fast, full)  # the reduced decode ran
        assert np.abs(fast - full).mean() < 1.0 and np.abs(fast - full).max() < 40, np.abs(fast - full).mean()
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (300, 300))
    assert image.size == (512, 400)  # Pillow's DCT scaling: 1/2 is the largest reduction keeping 300 x 300
