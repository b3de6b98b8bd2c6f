"""A checkpoint's position tables at the run's sizes (`[model] init_from` with another `data.image_size` or a
shorter `data.context_length`), so a checkpoint trained at one resolution starts a run at another: tuning at a
higher resolution than the pretraining's, as CLIP's 336 px models were made from 224 px ones, or training at
lower resolutions and shorter captions first, as CLIPA does.

Images: the class token's row is kept; the g x g patch rows, a grid over the image, are resized to S/p x S/p
with bicubic interpolation (`align_corners=False`). Growing, that is transformers' own
`interpolate_pos_encoding`, so the run's first embeddings equal `get_image_features(...,
interpolate_pos_encoding=True)`; shrinking, the resize is antialiased (each output row a weighted mean over its
footprint, as timm and open_clip resize).

Captions: the text tower is causal and pools at the EOS, so positions after a caption's EOS never reach its
embedding: the table's first L rows give a caption of at most L tokens the checkpoint's own embedding. A longer
context than the checkpoint's is refused (it learnt no positions past its own).
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
TEXT_KEY = "text.positional_embedding"


def resize_positions(table: Tensor, grid: int, prefix: int = 1) -> Tensor:
    """[prefix + g·g, w] -> [prefix + grid·grid, w]: the class row (`prefix` 1; SigLIP has none), then the patch
    grid resized (see the module)."""
    side = math.isqrt(table.shape[0] - prefix)
    if side * side != table.shape[0] - prefix:
        raise WeightsError(
            f"a position table of {table.shape[0]} rows is not {prefix} class row(s) and a square grid of patches; "
            "it cannot be resized"
        )
    if side == grid:
        return table
    dtype = table.dtype if table.dtype in (torch.float32, torch.float64) else torch.float32
    patches = table[prefix:].to(dtype).T.reshape(1, -1, side, side)
    resized = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False, antialias=grid < side)
    return torch.cat([table[:prefix], resized.reshape(-1, grid * grid).T.to(table.dtype)])


def fit_positions(state: dict[str, Tensor], args: CLIPArgs) -> dict[str, Tensor]:
    """`StateDictAdapter.fit` of the clip family: `state` with its image position table resized to `args`' patch
    grid and its text table cut to `args.context_length` (each change logged); as it is where they fit."""
    state = dict(state)
    table, grid = state.get(KEY), args.image_size // args.patch_size
    if table is not None and table.shape[0] != 1 + grid * grid:
        state[KEY], side = resize_positions(table, grid), math.isqrt(table.shape[0] - 1)
        logger.info(
            f"model.init_from: {KEY} resized from {side}x{side} to {grid}x{grid} patches for {args.image_size} px "
            "images"
        )
    text = state.get(TEXT_KEY)
    if text is not None and text.shape[0] != args.context_length:
        if text.shape[0] < args.context_length:
            raise WeightsError(
                f"data.context_length={args.context_length}: the checkpoint's text tower learnt {text.shape[0]} "
                f"positions; set data.context_length to at most {text.shape[0]}"
            )
        state[TEXT_KEY] = text[: args.context_length]
        logger.info(
            f"model.init_from: {TEXT_KEY} cut from {text.shape[0]} to {args.context_length} positions (captions "
            "that fit embed as in the checkpoint)"
        )
    return state
