"""The image tower's position table at another image size, so a checkpoint trained at one resolution starts a
run at another (`[model] init_from` with `data.image_size` = S): tuning at a higher resolution than the
pretraining's, as CLIP's 336 px models were made from 224 px ones, or training at a lower one first (CLIPA).

The class token's row is kept; the g x g patch rows, a grid over the image, are resized to S/p x S/p with
bicubic interpolation (`align_corners=False`). Growing, that is transformers' own `interpolate_pos_encoding`,
so the run's first embeddings equal `get_image_features(..., interpolate_pos_encoding=True)`; shrinking, the
resize is antialiased (each output row a weighted mean over its footprint, as timm and open_clip resize).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_contrastive.models.clip.args import CLIPArgs
from titan_contrastive.models.weights import WeightsError

__all__ = ["fit_positions", "resize_positions"]

logger = logging.getLogger("titan_contrastive")
KEY = "visual.positional_embedding"


def resize_positions(table: Tensor, grid: int) -> Tensor:
    """[1 + g·g, w] -> [1 + grid·grid, w]: the class row, then the patch grid resized (see the module)."""
    side = math.isqrt(table.shape[0] - 1)
    if side * side != table.shape[0] - 1:
        raise WeightsError(
            f"{KEY} has {table.shape[0]} rows, not a class row and a square grid of patches; it cannot be resized"
        )
    if side == grid:
        return table
    dtype = table.dtype if table.dtype in (torch.float32, torch.float64) else torch.float32
    patches = table[1:].to(dtype).T.reshape(1, -1, side, side)
    resized = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False, antialias=grid < side)
    return torch.cat([table[:1], resized.reshape(-1, grid * grid).T.to(table.dtype)])


def fit_positions(state: dict[str, Tensor], args: CLIPArgs) -> dict[str, Tensor]:
    """`StateDictAdapter.fit` of the clip family: `state` with its position table resized to `args`' patch grid
    (logged), or as it is when it already fits."""
    table, grid = state.get(KEY), args.image_size // args.patch_size
    if table is None or table.shape[0] == 1 + grid * grid:
        return state
    resized, side = resize_positions(table, grid), math.isqrt(table.shape[0] - 1)
    logger.info(
        f"model.init_from: {KEY} resized from {side}x{side} to {grid}x{grid} patches for {args.image_size} px images"
    )
    return {**state, KEY: resized}
