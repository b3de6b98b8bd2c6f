"""CLIP-style image transforms on Pillow images, with per-sample randomness from (seed, epoch, index).

Train: a random-resized crop (open_clip's defaults: area scale 0.9-1.0 of the image, aspect ratio
3/4-4/3, bicubic) to `size` x `size`. Eval: the central square of the image resized to `size`,
which is Resize(size) + CenterCrop(size) in one resampling instead of two. Then (x/255 - mean)/std
with OpenAI CLIP's mean/std by default.

Pillow decodes; the box is cut out and resized by torch's antialiased bicubic interpolation on
uint8 channels-last pixels, the filter of Pillow's bicubic resize (what torchvision's transforms,
and so open_clip's, run on Pillow images) in torch's vectorized kernel: the same pixels up to a
level in a few per mille of them, in about half Pillow's time or less. Why not torchvision: it does not
import beside every torch build this project supports.

Why `np.random.default_rng((seed, epoch, index))`: a crop must not depend on which rank or worker
loads the sample, nor on what else is in its batch, so that 1 process x 16 samples and 2 processes
x 8 (and a resumed run) see identical pixels.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
CROP_SCALE = (0.9, 1.0)  # open_clip's training default (torchvision's own is 0.08-1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10  # as torchvision, then its fallback

Box = tuple[int, int, int, int]


def decode_image(data: bytes | Image.Image) -> Image.Image:
    """An RGB Pillow image from encoded bytes (JPEG, PNG, WebP, ...) or an image; raises
    OSError/ValueError (Pillow's errors) on data that does not decode. 16-bit grayscale (a 16-bit
    PNG or TIFF) is scaled to 8 bits first (`to_8bit`)."""
    image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    image.load()  # decode now: a truncated file fails here, inside the caller's try
    if image.mode == "I" or image.mode.startswith("I;16"):
        image = to_8bit(image)
    return image if image.mode == "RGB" else image.convert("RGB")


def to_8bit(image: Image.Image) -> Image.Image:
    """An 'L' image from 16-bit grayscale ('I;16', 'I;16B', ..., or 'I' holding 0-65535): the high
    byte of each value, so 16-bit v * 257 gives back 8-bit v. Why: Pillow's own conversion clips at
    255, which turns all but the darkest 0.4 % of a 16-bit image's range white."""
    wide = np.asarray(image).astype(np.int64)
    return Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8))


FILTERS = {int(Image.Resampling.BILINEAR): "bilinear", int(Image.Resampling.BICUBIC): "bicubic"}
"""The image processors' `resample` filters served (Pillow's codes), as `resize_box`'s modes."""


def center_box(width: int, height: int) -> Box:
    """The central square of a width x height image."""
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def random_resized_box(
    width: int, height: int, rng: np.random.Generator, ratio: tuple[float, float] = CROP_RATIO
) -> Box:
    """torchvision's RandomResizedCrop box: area a fraction CROP_SCALE of the image, log-uniform
    aspect ratio (width / height) in `ratio`; after CROP_TRIES misses, the whole image cut to the
    nearest aspect ratio in `ratio`, centred (torchvision's fallback)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(*CROP_SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    w, h = width, height
    if width / height < ratio[0]:
        h = round(width / ratio[0])
    elif width / height > ratio[1]:
        w = round(height * ratio[1])
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's randomness in one epoch (a pure function of the three)."""
    return np.random.default_rng((seed, epoch, index))


def draw_box(width: int, height: int, *, train: bool, rng: np.random.Generator | None, whole: bool = False) -> Box:
    """The train crop's box (needs `rng`); in evaluation the central square (CLIP's processor: the shorter side
    resized, the centre cropped), or with `whole` the whole image (SigLIP's: squashed to the square)."""
    if train and rng is not None:
        return random_resized_box(width, height, rng)
    return (0, 0, width, height) if whole else center_box(width, height)


def resize_box(image: Image.Image, box: Box, size: int | tuple[int, int], mode: str = "bicubic") -> np.ndarray:
    """uint8 [height, width, 3] (`size`: both, or (height, width)): the RGB image's `box` (left, top, right,
    bottom) cut out and resized, antialiased bicubic (Pillow's filter: Keys' a = -0.5, widened when
    shrinking) or `mode="bilinear"` (Pillow's triangle filter, widened when shrinking)."""
    left, top, right, bottom = box
    pixels = torch.from_numpy(np.array(image))[top:bottom, left:right]  # [h, w, 3], a view
    pixels = pixels.permute(2, 0, 1).unsqueeze(0).contiguous(memory_format=torch.channels_last)
    out = F.interpolate(pixels, size=(size, size) if isinstance(size, int) else size, mode=mode, antialias=True)
    return np.ascontiguousarray(out[0].permute(1, 2, 0).numpy())


def crop_resize(
    image: Image.Image,
    size: int,
    *,
    train: bool,
    rng: np.random.Generator | None = None,
    whole: bool = False,
    mode: str = "bicubic",
) -> np.ndarray:
    """uint8 [size, size, 3]: `draw_box`'s box (the train crop, the eval centre or `whole` image) resized with
    `resize_box`'s `mode`."""
    box = draw_box(*image.size, train=train, rng=rng, whole=whole)
    return resize_box(image, box, size, mode)


def decode_crop_resize(
    data: bytes | Image.Image,
    size: int,
    *,
    train: bool,
    rng: np.random.Generator | None = None,
    whole: bool = False,
    mode: str = "bicubic",
) -> np.ndarray:
    """`crop_resize(decode_image(data), ...)` with the JPEG decoder's own downscaling: where the crop
    box holds at least twice `size` pixels each way, the JPEG is decoded at 1/2, 1/4 or 1/8 scale
    (Pillow's `draft`: the DCT scaled in the decoder, the largest reduction that leaves the box at
    least `size` pixels each way) and the box scaled with it (to whole pixels of the smaller image),
    so a large photo costs a fraction of its full decode and of the bicubic pass over it. The box is
    drawn once, on the image's own size (the same draws as `crop_resize`). Raises what
    `decode_image` raises."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return crop_resize(decode_image(data), size, train=train, rng=rng, whole=whole, mode=mode)
    image = Image.open(io.BytesIO(data))
    box = draw_box(*image.size, train=train, rng=rng, whole=whole)
    return resize_box(*decode_reduced(image, box, size, size), size, mode)


def decode_reduced(image: Image.Image, box: Box, width: int, height: int) -> tuple[Image.Image, Box]:
    """(the opened `image` decoded, `box` in it): a JPEG whose `box` holds at least twice `width` x `height`
    pixels is decoded at 1/2, 1/4 or 1/8 scale (Pillow's `draft`, the largest reduction that leaves the
    box at least that size) and the box scaled with it; anything else as it is. Raises what
    `decode_image` raises."""
    w, h = box[2] - box[0], box[3] - box[1]
    if image.format == "JPEG" and w >= 2 * width and h >= 2 * height:
        full = image.width
        image.draft("RGB", (math.ceil(full * width / w), math.ceil(image.height * height / h)))
        box = reduced_box(box, round(full / image.width))  # the factor: 1, 2, 4 or 8
    return decode_image(image), box


def reduced_box(box: Box, factor: int) -> Box:
    """`box` of the full image in the image decoded at 1/`factor` scale: each edge at the nearest whole
    pixel (it moves by at most `factor` / 2 pixels of the full image)."""
    left, top, right, bottom = (round(edge / factor) for edge in box)
    return left, top, right, bottom


class Normalize:
    """uint8 [B, H, W, C] -> float32 [B, C, H, W], (x / 255 - mean) / std as one multiply-add
    (the same float32 operations as the bundled sets, so equal pixels give equal tensors).

    In two halves, for a loader that moves uint8 pixels and normalizes them where the model runs
    (4x fewer bytes to pin and copy): `channels_first` (the worker's) and `apply` (any device);
    `__call__` is both."""

    def __init__(self, mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD) -> None:
        mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -mean_t / std_t
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def channels_first(pixels: np.ndarray) -> torch.Tensor:
        """uint8 [B, H, W, C] -> uint8 [B, C, H, W] (a view: the memory stays channels-last)."""
        return torch.from_numpy(pixels).permute(0, 3, 1, 2)

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, C, H, W] on any device -> float32, normalized there."""
        if images.device not in self._on:
            self._on[images.device] = (self.scale.to(images.device), self.shift.to(images.device))
        scale, shift = self._on[images.device]
        return images.float().mul_(scale).add_(shift)

    def __call__(self, pixels: np.ndarray) -> torch.Tensor:
        return self.apply(self.channels_first(pixels))

    def __getstate__(self) -> dict:  # DataLoader workers: no device copies
        return {**self.__dict__, "_on": {}}
