"""SigLIP 2's NaFlex inputs for the hf_clip family, which serves it square images of one size per run.

transformers' `Siglip2VisionModel` reads `pixel_values` [B, max_num_patches, p·p·C] (each image's patches,
then zero rows), `pixel_attention_mask` and `spatial_shapes` (each image's grid), and adds position
embeddings resized from its square table to each grid. Its processor makes these of a picture of any
shape; here every image is a g x g grid of the run's size (`HFClipArgs.image_size`), so:
- `naflex_inputs` cuts square images into what its processor gives for a square picture, on the device;
- `GridEmbeddings` replaces the model's `embeddings` (the same parameters, the same names): its position
  table is resized to g x g once per forward, by `F.interpolate` (bilinear, antialiased: what
  transformers' interpolation weights reproduce) in the table's own dtype. transformers resizes in
  float32, which would round the table's gradient in a float64 run (1e-8 between chunkings).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GridEmbeddings", "naflex_inputs"]


def naflex_inputs(images: Tensor, patch_size: int, max_num_patches: int) -> dict[str, Tensor]:
    """SigLIP 2's inputs of square images [B, C, g·p, g·p]: `pixel_values` [B, max_num_patches, p·p·C], the
    g x g patches in row-major order, each flattened (row, column, channel), then zero rows;
    `pixel_attention_mask` [B, max_num_patches] (int32, 1 on the patches); `spatial_shapes` [B, 2] = (g, g)."""
    b, c, size, _ = images.shape
    g = size // patch_size
    patches = images.reshape(b, c, g, patch_size, g, patch_size).permute(0, 2, 4, 3, 5, 1).reshape(b, g * g, -1)
    real = torch.arange(max_num_patches, device=images.device) < g * g
    return {
        "pixel_values": F.pad(patches, (0, 0, 0, max_num_patches - g * g)),
        "pixel_attention_mask": real.to(torch.int32).expand(b, -1),
        "spatial_shapes": torch.full((b, 2), g, device=images.device),
    }


class GridEmbeddings(nn.Module):
    """`Siglip2VisionEmbeddings` (its `patch_embedding` and `position_embedding`) for images of one g x g grid:
    patch embeddings plus the position table resized to g x g, the padding rows taking the first position
    (as transformers' do; the mask hides them)."""

    def __init__(self, embeddings: nn.Module, grid: int) -> None:
        super().__init__()
        self.patch_embedding, self.position_embedding = embeddings.patch_embedding, embeddings.position_embedding
        self.grid = grid

    def forward(self, pixel_values: Tensor, spatial_shapes: Tensor) -> Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))
        table = self.position_embedding.weight
        side, width = math.isqrt(table.shape[0]), table.shape[1]
        exact = table.dtype in (torch.float32, torch.float64)  # CPU's antialiased resize has no half types
        square = table.reshape(side, side, width).permute(2, 0, 1)[None].to(table.dtype if exact else torch.float32)
        resized = F.interpolate(
            square, size=(self.grid, self.grid), mode="bilinear", align_corners=False, antialias=True
        )
        positions = resized[0].reshape(width, -1).T.to(patches.dtype)
        padding = positions[:1].expand(pixel_values.shape[1] - positions.shape[0], -1)
        return patches + torch.cat([positions, padding])
