"""Qwen-VL-style packed patches: images of mixed resolutions as one [total_patches, C·p·p] tensor.

Why packed: a VLM processor keeps each image at (close to) its own resolution, so a batch has no
common [C, H, W]; it flattens every image into its p×p patches and concatenates them, with
`image_grid_thw` [num_images, 3] = (t, h, w) in patches telling where each image starts. This
module produces exactly that from a float image batch, so the `vlm` family and
`grad_cache.split_vlm_inputs` run on real mixed-resolution data.

Order inside one image: row-major over the h×w grid (t = 1: still images); each row of
`pixel_values` is one patch flattened channel-major (C, p, p), like Qwen2-VL's processor with
temporal patch 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["pack_images", "patchify", "unpatchify"]


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[n, C, H, W] -> [n·(H/p)·(W/p), C·p·p], image by image, patches row-major."""
    n, c, h, w = images.shape
    p = patch_size
    x = images.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # n, gh, gw, C, p, p
    return x.reshape(n * (h // p) * (w // p), c * p * p)


def unpatchify(pixel_values: torch.Tensor, grid_thw: torch.Tensor, channels: int, patch_size: int) -> list[torch.Tensor]:
    """The inverse of packing: one [C, h·p, w·p] image per `grid_thw` row (for tests and debugging)."""
    p, out, start = patch_size, [], 0
    for t, h, w in grid_thw.tolist():
        rows = pixel_values[start : start + t * h * w].reshape(h, w, channels, p, p)
        out.append(rows.permute(2, 0, 3, 1, 4).reshape(channels, h * p, w * p))
        start += t * h * w
    return out


def pack_images(pixels: torch.Tensor, sizes: np.ndarray, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of a [B, C, H, W] float batch, image i resized to sizes[i]².

    Images that share a size are resized together (bilinear; antialiased when shrinking); the
    packed rows are then laid out in batch order, so image i's patches follow image i-1's.
    """
    per_image: list[torch.Tensor | None] = [None] * len(pixels)
    for size in np.unique(sizes).tolist():
        members = np.flatnonzero(sizes == size)
        group = pixels[torch.from_numpy(members)]
        if size != group.shape[-1]:
            group = F.interpolate(group, size=(size, size), mode="bilinear", align_corners=False,
                                  antialias=size < group.shape[-1])
        for i, patches in zip(members.tolist(), patchify(group, patch_size).split((size // patch_size) ** 2)):
            per_image[i] = patches
    grid = torch.tensor([[1, s // patch_size, s // patch_size] for s in sizes.tolist()], dtype=torch.long).reshape(-1, 3)
    return torch.cat(per_image), grid  # type: ignore[arg-type]
