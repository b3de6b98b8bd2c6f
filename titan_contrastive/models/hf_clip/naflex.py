"""SigLIP 2's vision inputs in the hf_clip family.

transformers' `Siglip2VisionModel` reads `pixel_values` [B, max_num_patches, p·p·C] (each image's
patches, then zero rows), `pixel_attention_mask` and `spatial_shapes` (each image's grid), and adds
position embeddings resized from its square table to each grid. The data serves exactly that
(`datasets.naflex`); square image tensors (the export's probes, `[B, 3, S, S]` from code) are cut the
same way by `naflex_inputs`.

`NaFlexEmbeddings` replaces the model's `embeddings` (the same parameters under the same names): it
resizes the position table to each image's grid with the weights of `F.interpolate(mode="bilinear",
align_corners=False, antialias=True)` in the table's own dtype. transformers resizes in float32,
which rounds the table's gradient in a float64 run (1e-8 between two chunkings of one batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_contrastive.datasets.naflex import patchify

__all__ = ["NaFlexEmbeddings", "naflex_inputs", "resized_positions"]


def naflex_inputs(images: Tensor, patch_size: int, max_num_patches: int) -> dict[str, Tensor]:
    """SigLIP 2's inputs of square images [B, C, g·p, g·p], as its processor makes them of a square picture of
    that size: the g x g patches then zero rows, their int32 mask, and the grids (g, g)."""
    b, g = len(images), images.shape[-1] // patch_size
    real = torch.arange(max_num_patches, device=images.device) < g * g
    return {
        "pixel_values": F.pad(patchify(images, patch_size), (0, 0, 0, max_num_patches - g * g)),
        "pixel_attention_mask": real.to(torch.int32).expand(b, -1),
        "spatial_shapes": torch.full((b, 2), g, device=images.device),
    }


def _axis_weights(source: int, sizes: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """[B, length, source]: row i, the weights over `source` table positions of output i on an axis of `sizes[b]`
    outputs: a triangle filter around the output's centre, widened by the downscale (rows past `sizes[b]`:
    unused)."""
    scale = (source / sizes.to(dtype))[:, None, None]
    centre = (torch.arange(length, dtype=dtype, device=sizes.device)[None, :, None] + 0.5) * scale - 0.5
    at = torch.arange(source, dtype=dtype, device=sizes.device)
    weights = (1 - (at - centre).abs() / scale.clamp(min=1)).clamp(min=0)
    return weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)


def resized_positions(table: Tensor, spatial_shapes: Tensor, length: int) -> Tensor:
    """[B, length, D]: the square position table [G·G, D] resized to each image's (h, w) grid, in row-major order,
    then the first position on the padding rows (as transformers'; the mask hides them). In the table's dtype,
    computed in float32 for half types."""
    dtype = table.dtype if table.dtype in (torch.float32, torch.float64) else torch.float32
    side = math.isqrt(table.shape[0])
    position = torch.arange(length, device=table.device)[None]
    width = spatial_shapes[:, 1:]
    real = position < spatial_shapes.prod(-1, keepdim=True)
    row = torch.where(real, torch.div(position, width, rounding_mode="floor"), 0)
    column = torch.where(real, position - row * width, 0)

    def along(axis: int, index: Tensor) -> Tensor:
        weights = _axis_weights(side, spatial_shapes[:, axis], length, dtype)
        return weights.gather(1, index[..., None].expand(-1, -1, side))

    weights = (along(0, row)[..., :, None] * along(1, column)[..., None, :]).flatten(-2)
    return (weights @ table.to(dtype)).to(table.dtype)


class NaFlexEmbeddings(nn.Module):
    """`Siglip2VisionEmbeddings` (its `patch_embedding` and `position_embedding`): the patches' embeddings plus
    the position table resized to each image's grid (`resized_positions`)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.patch_embedding, self.position_embedding = embeddings.patch_embedding, embeddings.position_embedding

    def forward(self, pixel_values: Tensor, spatial_shapes: Tensor) -> Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        positions = resized_positions(self.position_embedding.weight, spatial_shapes, pixel_values.shape[1])
        return patches + positions.to(patches.dtype)
