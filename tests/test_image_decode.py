"""`resize_box` is Pillow's crop + bicubic resize (torchvision's and so open_clip's transform on Pillow
images) up to a level; `decode_crop_resize`: a large JPEG decoded at reduced scale gives nearly the full
decode's crop of the same region, faster to make; anything else is exactly `crop_resize(decode_image(...))`."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from titan_contrastive.datasets.image_transforms import (
    crop_resize,
    decode_crop_resize,
    decode_image,
    draw_box,
    reduced_box,
    resize_box,
    sample_rng,
)


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


def test_resize_box_is_pillows_crop_and_bicubic_resize() -> None:
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (260, 300, 3), dtype=np.uint8))
    smooth = decode_image(_encoded(300, 260, "PNG"))
    cases = (((8, 5, 248, 250), 224), ((30, 40, 130, 180), 224), ((0, 0, 300, 260), 64), ((3, 7, 90, 60), 32))
    for image in (noise, smooth):
        for box, size in cases:  # shrink, enlarge, the whole image, a non-square box
            ours = resize_box(image, box, size).astype(int)
            pillow = np.asarray(image.crop(box).resize((size, size), Image.Resampling.BICUBIC)).astype(int)
            assert ours.shape == pillow.shape == (size, size, 3)
            assert np.abs(ours - pillow).max() <= 2 and (ours != pillow).mean() < 0.01, (box, (ours != pillow).mean())
    assert not np.array_equal(resize_box(noise, (8, 5, 248, 250), 224), resize_box(noise, (9, 5, 249, 250), 224))


def test_the_whole_image_squashed_with_the_processors_filter() -> None:
    """Evaluation with `whole` (SigLIP's processor) is Pillow's resize of the whole image to the square with the
    filter asked for (bilinear here), up to a level; without it, the central square."""
    image = decode_image(_encoded(300, 200, "PNG"))
    ours = decode_crop_resize(_encoded(300, 200, "PNG"), 64, train=False, whole=True, mode="bilinear").astype(int)
    pillow = np.asarray(image.resize((64, 64), Image.Resampling.BILINEAR)).astype(int)
    assert np.abs(ours - pillow).max() <= 2 and (ours != pillow).mean() < 0.05
    bicubic = decode_crop_resize(_encoded(300, 200, "PNG"), 64, train=False, whole=True).astype(int)
    assert (bicubic != ours).mean() > 0.05  # the filter is the one asked for
    centre = np.asarray(image.crop((50, 0, 250, 200)).resize((64, 64), Image.Resampling.BICUBIC)).astype(int)
    assert np.abs(ours - centre).max() > 50
    plain = decode_crop_resize(_encoded(300, 200, "PNG"), 64, train=False).astype(int)
    assert np.abs(plain - centre).max() <= 2


def test_a_large_jpeg_is_decoded_smaller_and_keeps_its_crop() -> None:
    for width, height in ((1024, 800), (2000, 1500), (1001, 777)):
        data = _encoded(width, height, "JPEG")
        for train in (True, False):
            for index in range(3):
                box = draw_box(width, height, train=train, rng=sample_rng(0, 0, index))
                image = Image.open(io.BytesIO(data))  # the reduction decode_crop_resize asks the decoder for
                image.draft(
                    "RGB", (math.ceil(width * 224 / (box[2] - box[0])), math.ceil(height * 224 / (box[3] - box[1])))
                )
                factor = round(width / image.width)
                small = reduced_box(box, factor)
                assert factor in (2, 4), factor
                assert all(abs(a * factor - b) <= factor / 2 for a, b in zip(small, box)), (small, box)
                fast = decode_crop_resize(data, 224, train=train, rng=sample_rng(0, 0, index)).astype(float)
                full = resize_box(decode_image(data), tuple(a * factor for a in small), 224).astype(float)
                assert np.abs(fast - full).mean() < 0.5 and np.abs(fast - full).max() < 20, np.abs(fast - full).mean()
                assert not np.array_equal(fast, full)  # the reduced decode ran
    image = Image.open(io.BytesIO(_encoded(1024, 800, "JPEG")))
    image.draft("RGB", (300, 300))
    assert image.size == (512, 400)  # Pillow's DCT scaling: 1/2 is the largest reduction keeping 300 x 300
