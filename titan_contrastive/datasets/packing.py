"""Batches of images at mixed resolutions: Qwen-VL-style packed patches, or zero-padding + masks.

Packed (`pack_images`, for the vlm family): one [total_patches, C·p·p] tensor.

Why packed: a VLM processor keeps each image at (close to) its own resolution, so a batch has no
common [C, H, W]; it flattens every image into its p×p patches and concatenates them, with
`image_grid_thw` [num_images, 3] = (t, h, w) in patches telling where each image starts. This
module produces exactly that from a float image batch, so the `vlm` family and
`batching.split_vlm_inputs` run on real mixed-resolution data.

Order inside one image: row-major over the h×w grid (t = 1: still images); each row of
`pixel_values` is one patch flattened channel-major (C, p, p), like Qwen2-VL's processor with
temporal patch 1.

Padded (`pad_to_batch`, for the vae family's masked pixel loss): a [N, C, H, W] batch with every
image in its top-left corner and a [N, 1, H, W] mask that is 1 on its real pixels.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["pack_images", "pad_to_batch", "patchify", "resize_each", "unpatchify"]


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[n, C, H, W] -> [n·(H/p)·(W/p), C·p·p], image by image, patches row-major."""
    n, c, h, w = images.shape
    p = patch_size
    x = images.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # n, gh, gw, C, p, p
    return x.reshape(n * (h // p) * (w // p), c * p * p)


def unpatchify(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, channels: int, patch_size: int
) -> list[torch.Tensor]:
    """The inverse of packing: one [C, h·p, w·p] image per `grid_thw` row (for tests and debugging)."""
    p, out, start = patch_size, [], 0
    for t, h, w in grid_thw.tolist():
        rows = pixel_values[start : start + t * h * w].reshape(h, w, channels, p, p)
        out.append(rows.permute(2, 0, 3, 1, 4).reshape(channels, h * p, w * p))
        start += t * h * w
    return out


def resize_each(pixels: torch.Tensor, sizes: np.ndarray) -> list[torch.Tensor]:
    """Image i of a [B, C, H, W] float batch resized to sizes[i]² (bilinear; antialiased when
    shrinking); images that share a size are resized together."""
    out: list[torch.Tensor | None] = [None] * len(pixels)
    for size in np.unique(sizes).tolist():
        members = np.flatnonzero(sizes == size)
        group = pixels[torch.from_numpy(members)]
        if size != group.shape[-1]:
            group = F.interpolate(
                group, size=(size, size), mode="bilinear", align_corners=False, antialias=size < group.shape[-1]
            )
        for i, image in zip(members.tolist(), group):
            out[i] = image
    return out  # type: ignore[return-value]


def pack_images(pixels: torch.Tensor, sizes: np.ndarray, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of a [B, C, H, W] float batch, image i at sizes[i]², its
    patches following image i-1's."""
    pixel_values = torch.cat([patchify(image[None], patch_size) for image in resize_each(pixels, sizes)])
    grid = torch.tensor([[1, s // patch_size, s // patch_size] for s in sizes.tolist()], dtype=torch.long).reshape(
        -1, 3
    )
    return pixel_values, grid


def pad_to_batch(images: list[torch.Tensor], multiple: int = 1, size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-size [C, h_i, w_i] images -> zero-padded [N, C, H, W] batch and [N, 1, H, W] mask
    (1 on real pixels). H, W: the largest side, at least `size`, rounded up to `multiple` (e.g. a
    VAE's downsampling factor)."""
    height = -(-max(size, *(x.shape[1] for x in images)) // multiple) * multiple
    width = -(-max(size, *(x.shape[2] for x in images)) // multiple) * multiple
    batch = images[0].new_zeros(len(images), images[0].shape[0], height, width)
    mask = images[0].new_zeros(len(images), 1, height, width)
    for i, x in enumerate(images):
        batch[i, :, : x.shape[1], : x.shape[2]] = x
        mask[i, :, : x.shape[1], : x.shape[2]] = 1
    return batch, mask
