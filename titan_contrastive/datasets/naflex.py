"""SigLIP 2's NaFlex images, served as its processor makes them (the hf_clip family on a `siglip2` folder).

Each picture keeps its own aspect ratio: the train crop (`image_transforms.random_resized_box`: 90 to
100 % of the area, the picture's aspect ratio times 3/4 to 4/3; a JPEG decoded at reduced scale where the
crop holds twice the size it is resized to, `image_transforms.decode_reduced`, as square crops are) or,
in evaluation, the whole picture (decoded at full scale, as its processor does), is
resized with the processor's filter to the largest size in whole patches whose count fits
`max_num_patches` (transformers' `get_image_size_for_max_num_patches`), normalized, cut into patches
in row-major order (each flattened row, column, channel) and zero-padded to `max_num_patches`, with
its `pixel_attention_mask` and its grid in `spatial_shapes`. A batch's `image` is the dict of the
three, batch-major, which every chunking cuts by samples. The filter runs in torch's antialiased
kernel, as the square crops' does: Pillow's pixels up to one level in a few of them, in much less
time (benchmarks/naflex_data_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from titan_contrastive.datasets.image_transforms import FILTERS, Box, Normalize, resize_box

__all__ = ["NaFlexImages", "patchify"]


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """[B, C, h·p, w·p] -> [B, h·w, p·p·C]: the patches in row-major order, each flattened (row, column, channel)."""
    b, c, height, width = images.shape
    h, w = height // patch_size, width // patch_size
    patches = images.reshape(b, c, h, patch_size, w, patch_size).permute(0, 2, 4, 3, 5, 1)
    return patches.reshape(b, h * w, patch_size * patch_size * c)


@dataclass(frozen=True)
class NaFlexImages:
    """How a SigLIP 2 folder's processor cuts pictures: its `patch_size`, `max_num_patches` and `resample`
    (a Pillow filter: bilinear or bicubic, `FILTERS`)."""

    patch_size: int
    max_num_patches: int
    resample: int = Image.Resampling.BILINEAR

    def size_of(self, box: Box) -> tuple[int, int]:
        """(height, width) in pixels, whole patches, that the processor resizes a picture of `box`'s size to."""
        from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches

        left, top, right, bottom = box
        return get_image_size_for_max_num_patches(bottom - top, right - left, self.patch_size, self.max_num_patches)

    def sample(
        self, image: Image.Image, box: Box, normalize: Normalize, size: tuple[int, int] | None = None
    ) -> tuple[Tensor, tuple[int, int]]:
        """(patches [h·w, p·p·3] float32, (h, w)) of the RGB image's `box`, resized to `size` (default:
        `size_of(box)`; the size of the box before a reduced-scale decode)."""
        height, width = size or self.size_of(box)
        pixels = resize_box(image, box, (height, width), FILTERS[self.resample])
        patches = patchify(normalize(pixels[None]), self.patch_size)[0]
        return patches, (height // self.patch_size, width // self.patch_size)

    def batch(self, samples: list[tuple[Tensor, tuple[int, int]]]) -> dict[str, Tensor]:
        """`pixel_values` [B, max_num_patches, p·p·3] (zero rows after each image's), `pixel_attention_mask`
        [B, max_num_patches] int32, `spatial_shapes` [B, 2] int64."""
        width = 3 * self.patch_size**2
        pixel_values = torch.zeros(len(samples), self.max_num_patches, width)
        mask = torch.zeros(len(samples), self.max_num_patches, dtype=torch.int32)
        for row, (patches, _) in enumerate(samples):
            pixel_values[row, : len(patches)] = patches
            mask[row, : len(patches)] = 1
        shapes = torch.tensor([grid for _, grid in samples], dtype=torch.long).reshape(len(samples), 2)
        return {"pixel_values": pixel_values, "pixel_attention_mask": mask, "spatial_shapes": shapes}
